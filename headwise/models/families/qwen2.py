"""Qwen2 / Qwen2.5: Llama's block with biases on q, k and v (not o; no flag in the config says so),
and a window only where use_sliding_window is set, on the layers HF's layer_types name (by default
those from max_window_layers on)."""

from __future__ import annotations

from ...core.config import ModelConfig
from .decoder import Decoder
from .hf import FULL, SLIDING, decoder_fields, layer_windows
from .llama import ignored, weight_table  # noqa: F401 -- Qwen2's names are Llama's

Model = Decoder


def qwen_windows(hf: dict) -> dict:
    """sliding_window / layer_windows of Qwen2 and Qwen3: none unless use_sliding_window."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    n, first = hf.get("num_hidden_layers", 0), hf.get("max_window_layers", 0)
    return layer_windows(hf, window, [SLIDING if i >= first else FULL for i in range(n)])


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF Qwen2Config dict -> ModelConfig."""
    return ModelConfig(**{**decoder_fields(hf), "attn_bias": True, "out_bias": False, **qwen_windows(hf)})
