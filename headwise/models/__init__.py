"""Transformer families built from `MultiHeadAttention`, and loading real checkpoints.

    model = headwise.load("path/to/checkpoint")     # or a .gguf file, or a builtin name
    logits = model(input_ids)                       # decoders: (B, T, V) fp32
    hidden = model(input_ids, attention_mask)       # encoders: (B, T, C)

Decoder families (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) are data in families/:
each module's config_from_hf and HF weight table, one model (families/decoder.py) for all;
gpt2.py and bert.py hold their own models. loading.py applies the tables.
"""

from .bert import Bert
from .gpt2 import GPT2
from .llama import Llama
from .from_path import load
from .loading import CheckpointError, from_hf

__all__ = ["Bert", "GPT2", "Llama", "CheckpointError", "from_hf", "load"]
