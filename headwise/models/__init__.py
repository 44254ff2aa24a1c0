"""Transformer families built from `MultiHeadAttention`, and loading real checkpoints.

    model = headwise.load("path/to/checkpoint")     # or a .gguf file, or a builtin name
    logits = model(input_ids)                       # decoders: (B, T, V) fp32
    hidden = model(input_ids, attention_mask)       # encoders: (B, T, C)

Decoder families (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) are data in families/:
each module's config_from_hf and HF weight table, one model (families/decoder.py) for all;
gpt2.py and bert.py hold their own models. loading.py applies the tables.

The names below load on first use (as headwise's own), so that `models.builtin` and `models.sources`
(which name a model and find its files) answer the command line's checks without importing torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Bert": ".bert",
    "GPT2": ".gpt2",
    "Llama": ".llama",
    "load": ".from_path",
    "CheckpointError": ".loading",
    "from_hf": ".loading",
}
__all__ = ["Bert", "GPT2", "Llama", "CheckpointError", "from_hf", "load"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
