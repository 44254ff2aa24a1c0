"""Llama's names, kept where callers import them: the model is families/decoder.py's `Decoder`,
which every RoPE decoder family shares; the Llama family's table is families/llama.py."""

from __future__ import annotations

from ..core.config import ModelConfig
from .families.decoder import Decoder, DynamicNTKRotary, make_rope, rope_inv_freq
from .families.llama import ignored, weight_table
from .loading import family_of

Llama = Model = Decoder

__all__ = ["Llama", "Model", "DynamicNTKRotary", "make_rope", "rope_inv_freq", "weight_table", "ignored"]


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """Any decoder family's HF config dict -> ModelConfig, by its model_type (Llama's without one)."""
    return family_of({"model_type": "llama", **hf}).config_from_hf(hf, names)
