"""The small protocol between `MultiHeadAttention` and a KV cache.

A model hands each attention layer the cache object for that layer. The layer
asks it where the new tokens sit (for RoPE), writes the new keys/values, and
attends through what `update` returns:

    pos = cache.positions(T)                 # (B, T) absolute positions
    read = cache.update(k, v, num_new)       # k, v: (B, Hkv, T, D)
    out = read.attend(q, **attend_kwargs)    # (B, H, T, D)

Caches keep the seed's layout, (B, Hkv, S, D), and decide how they store it
(contiguous, paged, quantized). A cache whose keys live in one tensor returns a
`CacheRead` (attention runs through `headwise.attend`); a paged cache returns its
own read object with the same `attend` method, which hands the `paged` backend a
description of where the step's K/V live (`headwise.attention.kv`), so blocks are
read in place. The protocol itself is `headwise.attention.kv.LayerKVCache`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..attention.functional import attend
from ..attention.kv import LayerKVCache  # the protocol lives with attention; re-exported here

__all__ = ["CacheRead", "LayerKVCache", "merge_padding", "merge_visibility"]


class CacheRead(NamedTuple):
    k: Tensor  # (B, Hkv, S, D): cached keys followed by the new ones
    v: Tensor  # (B, Hkv, S, Dv)
    key_padding_mask: Tensor | None = None  # (B, S) bool, True = slot holds no real key
    attn_mask: Tensor | None = None  # (B, 1, T, S) bool, True = may attend; when given it
    # already encodes causality (ragged batches), and
    # is_causal is not applied on top

    def attend(
        self,
        q: Tensor,
        *,
        attn_mask=None,
        key_padding_mask=None,
        is_causal=False,
        kv_map: Tensor | None = None,
        **kwargs,
    ):
        """headwise.attend over the cached keys; user masks are combined with the cache's.

        attn_mask here is over (T, S) of the cached sequence; key_padding_mask (B, S).
        kv_map: (H,) KV head of each query head, for layers pruned into uneven groups.
        """
        k, v = self.k, self.v
        if kv_map is not None:
            k, v = k.index_select(1, kv_map), v.index_select(1, kv_map)
        kpm = merge_padding(key_padding_mask, self.key_padding_mask)
        if self.attn_mask is not None:
            attn_mask = merge_visibility(attn_mask, self.attn_mask)
            is_causal = False
        return attend(q, k, v, attn_mask=attn_mask, key_padding_mask=kpm, is_causal=is_causal, **kwargs)


def merge_padding(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    if a.shape != b.shape:
        raise ValueError(
            f"key_padding_mask has shape {tuple(a.shape)} but the cache holds keys {tuple(b.shape)} (B, S)"
        )
    return a | b


def merge_visibility(user: Tensor | None, cache_mask: Tensor) -> Tensor:
    """AND a user mask (bool: may attend, or float: added) with the cache's bool visibility."""
    if user is None:
        return cache_mask
    if user.dtype == torch.bool:
        return user & cache_mask
    return user.masked_fill(~cache_mask, float("-inf"))
