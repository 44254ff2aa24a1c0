"""The small protocol between `MultiHeadAttention` and a KV cache.

A model hands each attention layer the cache object for that layer. The layer
asks it where the new tokens sit (for RoPE), writes the new keys/values, and
attends over what `update` returns. Caches keep the seed's layout,
(B, Hkv, S, D), and decide how they store it (contiguous, paged, quantized).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from torch import Tensor


class CacheRead(NamedTuple):
    k: Tensor                                # (B, Hkv, S, D): cached keys followed by the new ones
    v: Tensor                                # (B, Hkv, S, Dv)
    key_padding_mask: Tensor | None = None   # (B, S) bool, True = slot holds no real key
    attn_mask: Tensor | None = None          # (B, 1, T, S) bool, True = may attend; when given it
                                             # already encodes causality (ragged batches), and the
                                             # layer does not add its own causal mask


@runtime_checkable
class LayerKVCache(Protocol):
    def positions(self, num_new: int) -> Tensor:
        """Absolute positions, (T,) or (B, T) long, of the next `num_new` tokens."""
        ...

    def update(self, k: Tensor, v: Tensor) -> CacheRead:
        """Append new keys/values (B, Hkv, T, D) and return what attention reads."""
        ...
