"""The runtime's tests share the engine's models (a random tiny Llama and GPT-2, saved by transformers)."""

from ..engine.conftest import gpt2_pair, tiny_gpt2, tiny_llama  # noqa: F401  (fixtures)
