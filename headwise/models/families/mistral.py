"""Mistral (Jiang et al. 2023, arXiv:2310.06825): Llama's block and weight names with a sliding
window on every layer -- each query sees the `sliding_window` keys ending at itself (HF's mask)."""

from __future__ import annotations

from ...core.config import ModelConfig
from .decoder import Decoder
from .hf import decoder_fields
from .llama import ignored, weight_table  # noqa: F401 -- Mistral's names are Llama's

Model = Decoder


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF MistralConfig dict -> ModelConfig."""
    return ModelConfig(**decoder_fields(hf), sliding_window=hf.get("sliding_window"))
