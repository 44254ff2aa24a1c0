"""Qwen3 (dense): Llama's block with QK-norm -- an RMSNorm over each head's D on q and k after the
projections, before RoPE -- and no q/k/v biases (attention_bias, default False)."""

from __future__ import annotations

from ...core.config import ModelConfig
from ..loading import To
from . import llama
from .decoder import Decoder
from .hf import decoder_fields
from .llama import ignored  # noqa: F401
from .qwen2 import qwen_windows

Model = Decoder


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF Qwen3Config dict -> ModelConfig."""
    return ModelConfig(**decoder_fields(hf), qk_norm=True, **qwen_windows(hf))


# fmt: off
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """Llama's table and each layer's two qk-norm weights (D,)."""
    hf, hw, D = "model.layers.{i}.self_attn.", "layers.{i}.attn.", cfg.head_dim
    return llama.weight_table(cfg) | {
        hf + "q_norm.weight":  To(hw + "q_norm.weight", (D,)),
        hf + "k_norm.weight":  To(hw + "k_norm.weight", (D,)),
    }
# fmt: on
