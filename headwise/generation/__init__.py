"""generate(): a one-request (or one-batch) run of the runtime's loop (headwise.runtime)."""

from ..runtime.sampler import sample
from ..runtime.sampling import SamplingParams, filter_logits
from .generate import GenerationResult, generate

__all__ = ["GenerationResult", "generate", "SamplingParams", "filter_logits", "sample"]
