"""Attention: one functional entry point over interchangeable backends, and the layer."""

from .backends import backends, get_backend, register_backend
from .functional import Explanation, attend, attend_kv, explain, weights_from_lse
from .kv import LayerKV, LayerKVCache, fold_heads, unfold_heads
from .layer import MultiHeadAttention
from .masks import alibi_slopes, causal_mask
from .rope import RotaryEmbedding
from .spec import AttentionOutput, AttentionSpec

__all__ = [
    "attend",
    "attend_kv",
    "LayerKV",
    "LayerKVCache",
    "fold_heads",
    "unfold_heads",
    "explain",
    "Explanation",
    "weights_from_lse",
    "backends",
    "get_backend",
    "register_backend",
    "alibi_slopes",
    "causal_mask",
    "AttentionOutput",
    "AttentionSpec",
    "MultiHeadAttention",
    "RotaryEmbedding",
]
