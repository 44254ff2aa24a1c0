"""Sampling and single-process generation."""

from .generate import GenerationResult, generate
from .sampling import SamplingParams, filter_logits, sample

__all__ = ["GenerationResult", "generate", "SamplingParams", "filter_logits", "sample"]
