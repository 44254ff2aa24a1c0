"""Sliding-window KV cache: a ring buffer of the last W tokens per sequence.

For sliding-window attention (Mistral 7B, Jiang et al. 2023: "rolling buffer
cache"), where the query at position p sees keys (p - W, p]. Memory is bounded by
W slots per sequence however long the sequence gets.

Position p lives in slot p % W; positions keep growing (RoPE sees the absolute
position). Keys are rotated before they are cached, so the scores do not depend
on where in the ring a key sits, and the read may hand the W slots to attention
in ring order, with a mask computed from each slot's absolute position.

Chunked prefill (T > 1 new tokens): the chunk evicts keys that its own first
queries still need (the query at L sees L-W+1, which token L+1 overwrites). So a
chunk attends over [the ring as it was, the new chunk] (W + T keys, one copy),
and only then are its last W real tokens written into the ring. A decode step
(T = 1) evicts only position L - W, which its query does not see, so it writes
first and reads the ring in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import LayerCacheBase, LayeredCache
from .protocol import CacheRead
from .quantized import Int8CacheRead
from .store import check_dims, check_new_kv


def slot_positions(lengths: Tensor, W: int) -> Tensor:
    """(B, W): absolute position held by each slot after `lengths` tokens; negative = empty."""
    last = lengths[:, None] - 1  # (B, 1) newest position
    s = torch.arange(W, device=lengths.device)
    return last - torch.remainder(last - s, W)  # largest p <= last with p % W == s


@dataclass(frozen=True)
class WindowedRead:
    """A read whose mask already holds the layer's window (keys in ring order, or a masked read
    of a contiguous layer): the attention layer's own `window=` is taken here, not applied again
    by index (an index is not a position in ring order, nor in a ragged batch's padded key axis)."""

    read: CacheRead | Int8CacheRead
    window: int
    # The read's keys are positions 0 .. S - 1 in order and it has no mask (a first chunk): the
    # window is applied by index, causal, which is then by position (no (T, S) mask tensor).
    by_index: bool = False

    def attend(self, q: Tensor, *, alibi_slopes: Tensor | None = None, window=None, **kwargs):
        if window is not None and window != self.window and window != (self.window - 1, 0):
            raise ValueError(
                f"the layer asks for a window of {window} keys but its cache keeps a window of "
                f"{self.window}; build the cache with the model's windows (ModelConfig.windows)"
            )
        if alibi_slopes is not None:
            # ALiBi adds -slope * (query index - key index), taking index = position; ring order breaks that.
            raise ValueError(
                "ALiBi needs keys in position order; SlidingWindowCache holds them in ring "
                "order. Use ContiguousKVCache with a window mask for ALiBi models"
            )
        if self.by_index:
            return self.read.attend(q, **{**kwargs, "is_causal": True}, window=self.window)
        return self.read.attend(q, **kwargs)


RingRead = WindowedRead  # its older name


class SlidingWindowLayerCache(LayerCacheBase):
    """One layer's ring of `window` slots; implements `LayerKVCache` (positions, update)."""

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        window: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
        kv_dtype=None,
    ):
        super().__init__(batch_size, num_kv_heads, window, head_dim, dtype=dtype, device=device, kv_dtype=kv_dtype)
        self.window = window

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None) -> WindowedRead:
        """Append k, v (B, Hkv, T, D); each new query sees the last W positions up to its own."""
        W = self.window
        T = check_new_kv(k, v, self.batch_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        empty = self._uniform and self._host[0] == 0
        counts = self._book(T, num_new)
        n = [T] * self.batch_size if counts is None else counts

        if empty and counts is None and T > 1:  # a first chunk: its own keys, window by index
            m = min(T, W)  # its last m tokens stay in the ring
            slots = (torch.arange(T - m, T, device=self.device) % W).expand(self.batch_size, m)
            self.store.write_at(slots, k[:, :, T - m :], v[:, :, T - m :])
            self._len = self._len + T
            read = CacheRead(self.store.round_trip(k), self.store.round_trip(v))
            return WindowedRead(read, W, by_index=True)

        if T == 1 and counts is None:  # decode: write, then read the ring in place
            self.store.write_at((self._len % W)[:, None], k, v)
            self._len = self._len + 1  # a new tensor: a stack claim shares one among layers
            end = self._len
            if min(self._host) >= W:  # every slot holds one of the last W keys
                return WindowedRead(self.store.read(W), W)
            filled = slot_positions(end, W) >= 0  # (B, W)
            return WindowedRead(self.store.read(W, attn_mask=filled[:, None, None, :]), W)

        ring_k, ring_v = self.store.dense()  # (B, Hkv, W, D): positions < L
        keys = torch.cat([ring_k, self.store.round_trip(k)], dim=2)  # (B, Hkv, W + T, D)
        values = torch.cat([ring_v, self.store.round_trip(v)], dim=2)
        t = torch.arange(T, device=self.device)
        n_t = torch.tensor(n, dtype=torch.long, device=self.device)  # (B,)
        qpos = self._len[:, None] + t  # (B, T)
        kpos = torch.cat(
            [slot_positions(self._len, W), torch.where(t < n_t[:, None], qpos, -1)], dim=1
        )  # (B, W + T), < 0 = no key
        rel = qpos[:, :, None] - kpos[:, None, :]  # (B, T, W + T)
        mask = (kpos[:, None, :] >= 0) & (rel >= 0) & (rel < W)  # causal, in the window

        keep = (t >= n_t[:, None] - W) & (t < n_t[:, None])  # the last W real tokens survive
        b, tt = keep.nonzero(as_tuple=True)
        self.store.write_tokens(b, tt, qpos[b, tt] % W, k, v)  # distinct slots per sequence
        self._len = self._len + n_t
        return WindowedRead(CacheRead(keys, values, attn_mask=mask[:, None]), W)  # mask (B, 1, T, W + T)

    def claim_decode(self, rows: int):
        """ContiguousLayerCache.claim_decode for a ring (kernels.layer's one-call decode step): books
        one token per sequence and returns (K, V, (base, pos, head stride, key stride, None, 0, W)):
        sequence b's ring starts base[b] elements into K, its new key pos[b] goes to row pos[b] % W
        and it attends over the ring's min(pos[b] + 1, W) rows; None where `rows` is not one per
        sequence or the compute dtype is not fp32."""
        if rows != self.batch_size or self.dtype is not torch.float32:
            return None
        self._host = [L + 1 for L in self._host]  # _book(1, None): a ring always has room
        pos = self._len
        self._len = pos + 1
        k, v = self.store.planes()
        sb, sh, st = self.store.k[0].stride()[:3]
        return k, v, (ring_bases(rows, sb), pos, sh, st, None, 0, self.window)


def ring_bases(rows: int, batch_stride: int) -> Tensor:
    """Each sequence's first key (elements into K): row b at b * batch_stride."""
    return torch.arange(rows, dtype=torch.int64) * batch_stride


class SlidingWindowCache(LayeredCache):
    """Ring buffers of the last `window` tokens for `num_layers` layers, (B, Hkv, W, D) each.

    No `trim`: evicted tokens cannot come back. kv_dtype="int8" stores int8 + scales, "bfloat16" /
    "float16" 16-bit values.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        window: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
        kv_dtype=None,
    ):
        check_dims(
            num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, window=window, head_dim=head_dim
        )
        self.batch_size, self.num_kv_heads, self.window, self.head_dim = batch_size, num_kv_heads, window, head_dim
        self.dtype = dtype
        self.layers = [
            SlidingWindowLayerCache(
                batch_size, num_kv_heads, window, head_dim, dtype=dtype, device=device, kv_dtype=kv_dtype
            )
            for _ in range(num_layers)
        ]
        self.kv_dtype = self.layers[0].kv_dtype

    def __repr__(self) -> str:
        return (
            f"SlidingWindowCache(num_layers={self.num_layers}, batch_size={self.batch_size}, "
            f"num_kv_heads={self.num_kv_heads}, window={self.window}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, kv_dtype={self.kv_dtype})"
        )
