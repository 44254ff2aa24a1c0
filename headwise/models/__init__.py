"""Transformer families built from `MultiHeadAttention`, and loading real checkpoints.

    model = headwise.load("path/to/checkpoint")     # or a .gguf file, or a builtin name
    logits = model(input_ids)                       # decoders: (B, T, V) fp32
    hidden = model(input_ids, attention_mask)       # encoders: (B, T, C)

One file per family (llama.py: Llama, Mistral, Qwen2; gpt2.py; bert.py), each with its
HF weight table; loading.py applies the tables.
"""

from .bert import Bert
from .gpt2 import GPT2
from .llama import Llama
from .from_path import load
from .loading import CheckpointError, from_hf

__all__ = ["Bert", "GPT2", "Llama", "CheckpointError", "from_hf", "load"]
