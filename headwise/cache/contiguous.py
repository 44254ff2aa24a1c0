"""Preallocated KV cache: (B, Hkv, T_max, D) per layer, written in place.

ContiguousLayerCache (one layer) and ContiguousKVCache (all layers). The buffers and
the shared checks are in store.py, the lengths and the layer stack in base.py.

gpt-fast's layout (`k_cache[:, :, pos] = k`) with ragged lengths: each sequence b
of the batch holds L_b tokens at slots [0, L_b), and slot = absolute position.
Appending never copies what is already cached, so decoding N tokens moves O(N)
bytes into the cache instead of the O(N^2) of growing it with `torch.cat`.

Three ways a step is written and read, cheapest first:

- uniform: every sequence has the same length L and every new token is real.
  Slice assignment into [L, L+T), and the read is the view [:L+T] with no mask:
  the layer's bottom-right causal mask is exactly right (and a T=1 decode needs
  none at all).
- ragged: lengths differ, or `num_new` marks right padding. Tokens go to slots
  L_b + t by scatter (padding tokens are dropped: lengths advance by num_new),
  and the read is [:max_b(L_b + n_b)] plus a (B, 1, T, S) bool mask giving each
  query its own causal view: query t of sequence b (position L_b + t) sees keys
  j <= L_b + t and j < L_b + n_b.
- static (`static=True`): always the ragged path over all T_max slots, so every
  tensor shape depends only on T, never on the lengths: `torch.compile` captures
  a decode step once.

With kv_dtype="int8" the same writes go to int8 buffers plus per-(token, head)
scales (see quantized.py); a read dequantizes the slice it returns. With "bfloat16" /
"float16" they go to 16-bit buffers (rounded to nearest even), converted back when read,
except by the one-call decode kernel, which reads them as stored.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .base import LayerCacheBase, LayeredCache, StackParts
from .sliding import SlidingWindowLayerCache, WindowedRead, ring_bases
from .store import _as_rows, causal_visibility, check_dims, check_new_kv, check_windows


class ContiguousLayerCache(LayerCacheBase):
    """One layer's cache, slot = position; implements `LayerKVCache` (positions, update)."""

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
        kv_dtype=None,
        static: bool = False,
        window: int | None = None,
    ):
        super().__init__(
            batch_size,
            num_kv_heads,
            max_seq_len,
            head_dim,
            dtype=dtype,
            device=device,
            kv_dtype=kv_dtype,
            static=static,
        )
        self.max_seq_len = max_seq_len
        # A sliding window of this many keys kept in the read's mask (a static cache's windowed
        # layer, for torch.compile; a dynamic cache gives windowed layers a ring, sliding.py)
        self.window = window
        # claim_decode's (rows, batch stride, key offsets of each sequence): the same every step,
        # remade when the rows or the buffers' batch stride change
        self._decode_base: tuple[int, int, Tensor] | None = None
        if static:  # made here, not at import: torch.compiler.disable imports dynamo (~1 s)
            self._book_outside_graph = torch.compiler.disable(self._book)

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None):
        """Append k, v (B, Hkv, T, D); num_new (B,) real tokens per sequence (rest = right padding)."""
        T = check_new_kv(k, v, self.batch_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        if self.static:
            # The host bookkeeping runs outside any torch.compile graph, so lengths never become
            # guards (that would recompile every step); the step itself reads only self._len.
            # Inside a graph it is skipped altogether: whoever compiles books the step before
            # calling it (`ContiguousKVCache.book`), which keeps the whole forward one graph.
            if not torch.compiler.is_compiling():
                self._book_outside_graph(T, num_new)
            n_t = None if num_new is None else torch.as_tensor(num_new, device=self.device).long()
            return self._write_masked(k, v, T, n_t)
        if self.window is not None:
            counts = self._book(T, num_new)
            n_t = None if counts is None else torch.tensor(counts, dtype=torch.long, device=self.device)
            return self._write_masked(k, v, T, n_t)
        L, uniform = self._host[0], self._uniform
        counts = self._book(T, num_new)
        if counts is None and uniform:  # the fast path: no mask, no scatter
            self.store.write_slice(L, k, v)
            self._len = self._len + T  # a new tensor: claim_decode_stack shares one among layers
            return self.store.read(L + T)
        n_t = None if counts is None else torch.tensor(counts, dtype=torch.long, device=self.device)
        return self._write_masked(k, v, T, n_t)

    def claim_decode(self, rows: int):
        """For a caller that writes one new token per sequence into the buffers itself and then
        attends over each sequence's keys (kernels.layer's one-call decode step): books the tokens
        and returns (K, V, (base, pos, head stride, key stride)) — sequence b's keys start base[b]
        elements into K, its new key is pos[b]; an int8 cache's K and V are each its (int8 values,
        fp32 scales) pair, the scale of the row at element offset e at e / head_dim — or None where
        this cache cannot hand its buffers out (static for torch.compile, not fp32, or `rows` is
        not one per sequence)."""
        if rows != self.batch_size or self.static or self.window is not None or self.dtype is not torch.float32:
            return None
        host = self._host  # _book(1, None) for one token each, without its general checks
        if max(host) >= self.max_seq_len:
            self._check_fits([1] * rows)  # raises, naming the sequence
        self._host = [L + 1 for L in host]  # all one longer: _uniform stays what it was
        pos = self._len  # this step's new keys: the kernel reads it, nothing writes it again
        self._len = pos + 1  # one op where clone() + `+= 1` took two (x 30 layers a step)
        k, v = self.store.planes()
        sb, sh, st = self.store.k[0].stride()[:3]
        memo = self._decode_base
        if memo is None or memo[:2] != (rows, sb):
            memo = self._decode_base = (rows, sb, torch.arange(rows, dtype=torch.int64) * sb)
        return k, v, (memo[2], pos, sh, st)

    def _check_fits(self, n: list[int]) -> None:
        for b, (L, c) in enumerate(zip(self._host, n)):
            if L + c > self.max_seq_len:
                raise ValueError(
                    f"append of {c} tokens to sequence {b} at length {L} exceeds max_seq_len={self.max_seq_len}"
                )

    def _write_masked(self, k: Tensor, v: Tensor, T: int, n_t: Tensor | None):
        """The ragged/static path: scatter at L_b + t, read with a per-sequence causal mask."""
        pos = self._len[:, None] + torch.arange(T, device=self.device)  # (B, T) slot = position
        if n_t is None:
            self.store.write_at(pos, k, v)
            end = self._len + T
        else:
            b, t = (torch.arange(T, device=self.device) < n_t[:, None]).nonzero(as_tuple=True)
            self.store.write_tokens(b, t, pos[b, t], k, v)  # padding tokens are not kept
            end = self._len + n_t
        S = self.max_seq_len if self.static else max(1, max(self._host))  # S=1 keeps a 0-key read legal
        mask = causal_visibility(pos, end, S)  # (B, 1, T, S)
        if self.window is not None:  # and no older than the window: slot = position
            mask = mask & (pos[:, None, :, None] - torch.arange(S, device=self.device) < self.window)
        if self.static:
            self._len.copy_(end)  # the tensor a compiled step reads stays the same
        else:
            self._len = end  # a new tensor: claim_decode_stack shares one among layers
        read = self.store.read(S, attn_mask=mask)
        return read if self.window is None else WindowedRead(read, self.window)

    def trim(self, lengths: int | Sequence[int] | Tensor) -> None:
        """Keep only the first `lengths` tokens of each sequence (int: the same for all)."""
        self._set_lengths(self._trimmed(lengths))

    def _trimmed(self, lengths) -> list[int]:
        new = _as_rows(lengths, self.batch_size, "trim")
        for b, (L, keep) in enumerate(zip(self._host, new)):
            if not 0 <= keep <= L:
                raise ValueError(f"cannot trim sequence {b} to {keep} tokens: it holds {L}")
        return new


class ContiguousKVCache(LayeredCache):
    """Preallocated K/V for `num_layers` layers, (B, Hkv, max_seq_len, D) each.

    Args:
        dtype: the compute dtype K/V arrive and are returned in.
        kv_dtype: None (store `dtype`), "bfloat16" / "float16" (16 bits, rounded to nearest even) or
            "int8" (int8 + fp32 scale per (token, head)).
        static: reads always cover all max_seq_len slots with a mask, so shapes never
            change between steps (for torch.compile / CUDA graphs).
        windows: per layer, None (global: every key) or W (the layer sees the W keys ending
            at each query; `ModelConfig.windows`). A windowed layer keeps a ring of its last W
            tokens (sliding.py), (B, Hkv, W, D), so a long sequence of Gemma 3 (5 local
            512-key layers to 1 global) holds ~0.27x the K/V of all-global layers at 4,096
            tokens. A static cache keeps every slot and masks by the window instead (one
            graph); W >= max_seq_len never bites and gets a plain layer.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
        kv_dtype=None,
        static: bool = False,
        windows: Sequence[int | None] | None = None,
    ):
        check_dims(
            num_layers=num_layers,
            batch_size=batch_size,
            num_kv_heads=num_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=head_dim,
        )
        self.batch_size, self.num_kv_heads, self.max_seq_len, self.head_dim = (
            batch_size,
            num_kv_heads,
            max_seq_len,
            head_dim,
        )
        self.dtype, self.static = dtype, static
        self.windows = check_windows(windows, num_layers)
        dims = (batch_size, num_kv_heads)
        kw = dict(dtype=dtype, device=device, kv_dtype=kv_dtype)
        self.layers = []
        for W in self.windows:
            if W is None or W >= max_seq_len:
                layer = ContiguousLayerCache(*dims, max_seq_len, head_dim, static=static, **kw)
            elif static:
                layer = ContiguousLayerCache(*dims, max_seq_len, head_dim, static=True, window=W, **kw)
            else:
                layer = SlidingWindowLayerCache(*dims, W, head_dim, **kw)
            self.layers.append(layer)
        self.kv_dtype = self.layers[0].kv_dtype
        # claim_decode_stack's parts (_stack_parts builds them): the same object step after step,
        # remade when the rows or the list of layers change
        self._stack_memo: StackParts | None = None

    def claim_decode_stack(self, rows: int, num_layers: int) -> tuple[StackParts, tuple] | None:
        """claim_decode for every layer at once, where the stack holds exactly num_layers layers
        at the same lengths (as after every whole step of a model): books one token per sequence
        in each and returns (parts, (base, pos)): parts.layers per layer (K, V, head stride, key
        stride), a windowed layer's ring (K, V, head stride, key stride, its own base, W: key p at
        row p % W), the same object step after step while the buffers stay; base, each sequence's
        first key (floats into K, the same in every layer) and pos, this step's new key
        positions, one tensor for all the layers (each layer's lengths are that tensor + 1 then:
        one op for the stack, where each claim_decode takes one). None, with nothing booked,
        where that does not hold or any layer's claim_decode would refuse."""
        layers = self.layers
        first = layers[0]
        parts = self._stack_memo
        if parts is None or parts.rows != rows or parts.cache_layers != layers:
            parts = self._stack_parts(rows, num_layers)
            if parts is None:
                return None
        host = first._host
        for layer in layers:  # equal lengths; after a stack claim they share one list
            if layer._host is not host and layer._host != host:
                return None
        if max(host) >= self.max_seq_len:  # a layer of every key is full (a ring always has room)
            full = [layer for layer in layers if type(layer) is ContiguousLayerCache]
            if full:
                full[0]._check_fits([1] * rows)  # raises, naming the sequence
        pos, host = first._len, [L + 1 for L in host]
        new = pos + 1  # never written in place (update() and the ragged path make new tensors)
        for layer in layers:
            layer._host, layer._len = host, new
        return parts, (parts.base, pos)

    def _stack_parts(self, rows: int, num_layers: int) -> StackParts | None:
        layers = self.layers
        kinds = (ContiguousLayerCache, SlidingWindowLayerCache)  # a windowed layer's ring: its own base
        if len(layers) != num_layers or any(
            type(layer) not in kinds
            or layer.static
            or (type(layer) is ContiguousLayerCache and layer.window is not None)
            for layer in layers
        ):
            return None
        want = (rows, layers[0].store.int8, layers[0].store.stored, torch.float32)
        entries, strides = [], set()
        for layer in layers:
            if (layer.batch_size, layer.store.int8, layer.store.stored, layer.dtype) != want:
                return None
            sb, sh, st = layer.store.k[0].stride()[:3]
            if type(layer) is SlidingWindowLayerCache:
                entries.append((*layer.store.planes(), sh, st, ring_bases(rows, sb), layer.window))
                continue
            strides.add(sb)
            entries.append((*layer.store.planes(), sh, st))
        if len(strides) > 1:
            return None
        base = torch.arange(rows, dtype=torch.int64) * (strides.pop() if strides else 0)  # rings: their own
        parts = self._stack_memo = StackParts(rows, list(layers), entries, base)
        return parts

    def book(self, num_new: int) -> None:
        """Check and advance every layer's host lengths by num_new tokens per sequence, for a
        static cache whose next step runs inside a compiled graph (which skips this)."""
        if not self.static:
            raise ValueError("book() is for static caches: a dynamic cache books inside update()")
        for layer in self.layers:
            layer._book(num_new, None)

    def trim(self, lengths: int | Sequence[int] | Tensor) -> None:
        """Keep only the first `lengths` tokens of each sequence in every layer (all checked first)."""
        if any(not isinstance(layer, ContiguousLayerCache) for layer in self.layers):
            raise ValueError("trim: a windowed layer's ring has dropped its older tokens, which cannot come back")
        rows = [layer._trimmed(lengths) for layer in self.layers]
        for layer, new in zip(self.layers, rows):
            layer._set_lengths(new)

    def bytes_per_token(self) -> float:
        """memory_bytes() / (batch_size * max_seq_len): K/V bytes per cached token, all layers."""
        return self.memory_bytes() / (self.batch_size * self.max_seq_len)

    def __repr__(self) -> str:
        return (
            f"ContiguousKVCache(num_layers={self.num_layers}, batch_size={self.batch_size}, "
            f"num_kv_heads={self.num_kv_heads}, max_seq_len={self.max_seq_len}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, kv_dtype={self.kv_dtype}, static={self.static}"
            + (f", windows={list(self.windows)})" if any(w is not None for w in self.windows) else ")")
        )
