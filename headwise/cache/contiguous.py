"""Preallocated KV cache: (B, Hkv, T_max, D) per layer, written in place.

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
scales (see quantized.py); a read dequantizes the slice it returns.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..attention.step import CacheStep
from .protocol import CacheRead
from .quantized import SCALE_DTYPE, Int8CacheRead, dequantize_int8, is_int8, quantize_int8


class KVStore:
    """K and V buffers of one layer, (B, Hkv, N, D), in the compute dtype or as int8 + scales.

    Each of K and V is a tuple of planes written with the same index: (values,) or
    (int8 values, (B, Hkv, N, 1) fp32 scales).
    """

    def __init__(self, B: int, Hkv: int, N: int, D: int, *, dtype: torch.dtype, device, int8: bool):
        self.dtype, self.int8 = dtype, int8
        if int8:

            def planes():
                return (
                    torch.zeros(B, Hkv, N, D, dtype=torch.int8, device=device),
                    torch.zeros(B, Hkv, N, 1, dtype=SCALE_DTYPE, device=device),
                )
        else:

            def planes():  # zeros, not empty: masked slots are still multiplied by 0 weights, NaN would leak
                return (torch.zeros(B, Hkv, N, D, dtype=dtype, device=device),)

        self.k, self.v = planes(), planes()

    def _encode(self, x: Tensor) -> tuple[Tensor, ...]:
        return quantize_int8(x) if self.int8 else (x,)

    def _pairs(self, k: Tensor, v: Tensor):
        for planes, x in ((self.k, k), (self.v, v)):
            yield from zip(planes, self._encode(x))

    def write_slice(self, lo: int, k: Tensor, v: Tensor) -> None:
        """k, v (B, Hkv, T, D) -> slots [lo, lo + T) of every sequence."""
        T = k.shape[2]
        for buf, part in self._pairs(k, v):
            buf.narrow(2, lo, T).copy_(part)  # narrow + copy_: fewer dispatches than buf[:, :, lo:hi] = part

    def write_at(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Token t of sequence b -> slot slots[b, t]; slots (B, T) long, distinct per row."""
        for buf, part in self._pairs(k, v):
            idx = slots[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3])  # (B, Hkv, T, D|1)
            buf.scatter_(2, idx, part)

    def write_tokens(self, b: Tensor, t: Tensor, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Only the listed tokens: token t[i] of sequence b[i] -> slot[i] (1-D long tensors)."""
        for buf, part in self._pairs(k, v):
            buf[b, :, slot] = part[b, :, t]  # (N, Hkv, D|1) on both sides

    def read(
        self, S: int, key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None
    ) -> CacheRead | Int8CacheRead:
        """Slots [:S] as a read (views; int8 is dequantized only when attended)."""
        if self.int8:
            (kq, ks), (vq, vs) = self.k, self.v
            return Int8CacheRead(
                kq[:, :, :S], ks[:, :, :S], vq[:, :, :S], vs[:, :, :S], self.dtype, key_padding_mask, attn_mask
            )
        return CacheRead(self.k[0].narrow(2, 0, S), self.v[0].narrow(2, 0, S), key_padding_mask, attn_mask)

    def dense(self) -> tuple[Tensor, Tensor]:
        """All N slots of K and V in the compute dtype (views, or dequantized copies)."""
        if self.int8:
            return dequantize_int8(*self.k, self.dtype), dequantize_int8(*self.v, self.dtype)
        return self.k[0], self.v[0]

    def round_trip(self, x: Tensor) -> Tensor:
        """x as a later read will see it (int8: quantized and back), for attending before writing."""
        return dequantize_int8(*quantize_int8(x), self.dtype) if self.int8 else x

    def reorder(self, idx: Tensor) -> None:
        for buf in (*self.k, *self.v):
            buf.copy_(buf.index_select(0, idx))  # in place: the storage (and a compiled graph's view of it) stays

    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in (*self.k, *self.v))


# ------------------------------------------------------------------ checks shared with sliding.py
def check_new_kv(k: Tensor, v: Tensor, B: int, Hkv: int, D: int, dtype: torch.dtype, device) -> int:
    """Validate new keys/values against a cache; return T. Errors name both sides' numbers."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be (B, Hkv, T, D) = ({B}, {Hkv}, T, {D}), got {got}")
        if x.shape[0] != B:
            raise ValueError(f"{name} has batch {x.shape[0]} but this cache was built for batch_size={B}")
        if x.shape[1] != Hkv:
            raise ValueError(
                f"{name} has {x.shape[1]} KV heads but this cache holds num_kv_heads={Hkv} "
                f"({name} shape {tuple(x.shape)})"
            )
        if x.shape[3] != D:
            raise ValueError(f"{name} has head dim {x.shape[3]} but this cache holds head_dim={D}")
        if x.dtype != dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but this cache holds {dtype}; "
                f"build the cache with dtype={x.dtype} or cast the model"
            )
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but this cache lives on {device}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k has {k.shape[2]} new tokens but v has {v.shape[2]}")
    return k.shape[2]


def new_counts(num_new, B: int, T: int) -> list[int] | None:
    """num_new (B,) -> host list of real-token counts, or None when every token is real."""
    if num_new is None:
        return None
    n = torch.as_tensor(num_new)
    if tuple(n.shape) != (B,) or n.is_floating_point() or n.dtype == torch.bool:
        raise ValueError(f"num_new must be (B,) = ({B},) integer counts of real tokens, got {tuple(n.shape)} {n.dtype}")
    counts = n.tolist()  # one device sync: lengths live on the host too, for the checks and slicing
    bad = [(b, c) for b, c in enumerate(counts) if not 0 <= c <= T]
    if bad:
        b, c = bad[0]
        raise ValueError(f"num_new[{b}]={c} is outside [0, T={T}] (T = tokens passed this step)")
    return None if all(c == T for c in counts) else counts


def causal_visibility(qpos: Tensor, end: Tensor, S: int) -> Tensor:
    """(B, 1, T, S) bool: query at qpos[b, t] sees slot j iff j <= qpos[b, t] and j < end[b]."""
    j = torch.arange(S, device=qpos.device)
    return ((j <= qpos[:, :, None]) & (j < end[:, None, None]))[:, None]


def _as_rows(x, B: int, what: str) -> list[int]:
    rows = [int(x)] * B if isinstance(x, int) else [int(r) for r in torch.as_tensor(x).reshape(-1).tolist()]
    if len(rows) != B:
        raise ValueError(f"{what} needs one value per sequence (batch_size={B}), got {len(rows)}")
    return rows


# ------------------------------------------------------------------ one layer
class LayerCacheBase:
    """Per-sequence lengths and the bookkeeping every single-layer cache shares.

    Lengths live twice: (B,) on the device, for positions and masks inside a step,
    and as a host list, so checks and slicing never wait for the device.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        slots: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device,
        kv_dtype,
        static: bool = False,
    ):
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.dtype, self.static = dtype, static
        self.kv_dtype = "int8" if is_int8(kv_dtype) else None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.store = KVStore(
            batch_size, num_kv_heads, slots, head_dim, dtype=dtype, device=self.device, int8=self.kv_dtype == "int8"
        )
        self._len = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # (B,) tokens seen
        self._host = [0] * batch_size  # the same on the host
        self._uniform = True  # all _host equal

    def positions(self, num_new: int) -> Tensor:
        """(B, T) absolute positions of the next T tokens: L_b + t."""
        if not self.static and self._uniform:  # `static` first: a compiled step never reads _uniform
            L = self._host[0]
            return torch.arange(L, L + num_new, device=self.device).expand(self.batch_size, num_new)
        return self._len[:, None] + torch.arange(num_new, device=self.device)

    @property
    def lengths(self) -> Tensor:
        """(B,) long: tokens appended per sequence (real ones; padding is not counted)."""
        return self._len.clone()

    def _book(self, T: int, num_new) -> list[int] | None:
        """Check that the new tokens fit and advance the host lengths (the device ones are the
        caller's). Returns the real-token counts per sequence, or None when all T are real."""
        counts = new_counts(num_new, self.batch_size, T)
        n = [T] * self.batch_size if counts is None else counts
        self._check_fits(n)
        self._host = [L + c for L, c in zip(self._host, n)]
        self._uniform = len(set(self._host)) == 1
        return counts

    def _check_fits(self, n: list[int]) -> None:
        """Raise if n[b] more tokens do not fit sequence b (a ring always has room)."""

    def _set_lengths(self, rows: list[int]) -> None:
        self._host = list(rows)
        self._uniform = len(set(rows)) == 1
        self._len.copy_(torch.tensor(rows, dtype=torch.long))

    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Forget every sequence, or only `rows` (their slots are reused; nothing is zeroed)."""
        drop = set(range(self.batch_size)) if rows is None else {int(r) for r in rows}
        self._set_lengths([0 if b in drop else L for b, L in enumerate(self._host)])

    def reorder(self, batch_indices: Sequence[int] | Tensor) -> None:
        """Row i becomes a copy of old row batch_indices[i] (beam search); the batch size stays."""
        idx = torch.as_tensor(batch_indices, dtype=torch.long).reshape(-1)
        B = self.batch_size
        if idx.numel() != B or ((idx < 0) | (idx >= B)).any():
            raise ValueError(f"reorder needs {B} row indices in [0, {B}), got {idx.tolist()}")
        self.store.reorder(idx.to(self.device))
        self._set_lengths([self._host[i] for i in idx.tolist()])

    def memory_bytes(self) -> int:
        """Bytes of K/V storage (int8: values + scales), allocated up front."""
        return self.store.nbytes()


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
        if static:  # made here, not at import: torch.compiler.disable imports dynamo (~1 s)
            self._book_outside_graph = torch.compiler.disable(self._book)

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None):
        """Append k, v (B, Hkv, T, D); num_new (B,) real tokens per sequence (rest = right padding)."""
        if num_new is None and self._uniform and not self.static and self.kv_dtype is None:
            read = self._append_uniform(k, v)  # a decode step: ~1/3 of the checks' and calls' cost
            if read is not None:
                return read
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
        L, uniform = self._host[0], self._uniform
        counts = self._book(T, num_new)
        if counts is None and uniform:  # the fast path: no mask, no scatter
            self.store.write_slice(L, k, v)
            self._len += T
            return self.store.read(L + T)
        n_t = None if counts is None else torch.tensor(counts, dtype=torch.long, device=self.device)
        return self._write_masked(k, v, T, n_t)

    def _append_uniform(self, k: Tensor, v: Tensor):
        """The common step, every sequence at one length and every token real: when k, v are
        what this cache holds and fit, write them in place and return the read; else None (the
        caller runs the checks that name the problem)."""
        kb, vb = self.store.k[0], self.store.v[0]  # (B, Hkv, N, D)
        shape = k.shape
        L = self._host[0]
        if (
            not isinstance(k, Tensor)
            or not isinstance(v, Tensor)
            or len(shape) != 4
            or v.shape != shape
            or shape[0] != kb.shape[0]
            or shape[1] != kb.shape[1]
            or shape[3] != kb.shape[3]
            or k.dtype != kb.dtype
            or v.dtype != kb.dtype
            or k.device != kb.device
            or v.device != kb.device
            or L + shape[2] > self.max_seq_len
        ):
            return None
        T = shape[2]
        kb.narrow(2, L, T).copy_(k)
        vb.narrow(2, L, T).copy_(v)
        self._host = [L + T] * self.batch_size
        self._len += T
        return CacheRead(kb.narrow(2, 0, L + T), vb.narrow(2, 0, L + T))

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
        self._len.copy_(end)
        return self.store.read(S, attn_mask=mask)

    def trim(self, lengths: int | Sequence[int] | Tensor) -> None:
        """Keep only the first `lengths` tokens of each sequence (int: the same for all)."""
        self._set_lengths(self._trimmed(lengths))

    def _trimmed(self, lengths) -> list[int]:
        new = _as_rows(lengths, self.batch_size, "trim")
        for b, (L, keep) in enumerate(zip(self._host, new)):
            if not 0 <= keep <= L:
                raise ValueError(f"cannot trim sequence {b} to {keep} tokens: it holds {L}")
        return new


# ------------------------------------------------------------------ all layers
class LayeredCache:
    """A stack of per-layer caches: `cache.layer(i)` goes to attention layer i.

    With one layer the stack itself is a `LayerKVCache`, so it can be passed
    straight to one `MultiHeadAttention(cache=...)`.
    """

    layers: list

    def layer(self, i: int):
        if not -len(self.layers) <= i < len(self.layers):
            raise IndexError(f"layer {i} out of range: this cache has num_layers={len(self.layers)}")
        return self.layers[i]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens per sequence, as layer 0 holds them (all layers agree after a full model step)."""
        return self.layers[0].lengths

    def step(self, T: int, num_new: Tensor | None = None, logits_indices: Tensor | None = None) -> CacheStep:
        """The `Step` of T new tokens per sequence (`model(input_ids, cache.step(T))`).

        num_new: (B,) real tokens per sequence when rows are right-padded (the padding is not
        kept); None = all T. logits_indices: flat rows b * T + t whose logits are wanted.
        """
        return CacheStep(self.layer, T, num_new, logits_indices)

    def _only_layer(self):
        if len(self.layers) != 1:
            raise TypeError(f"this cache has num_layers={len(self.layers)}; pass cache.layer(i) to layer i")
        return self.layers[0]

    def positions(self, num_new: int) -> Tensor:
        return self._only_layer().positions(num_new)

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None):
        return self._only_layer().update(k, v, num_new)

    def reset(self, rows: Sequence[int] | None = None) -> None:
        for layer in self.layers:
            layer.reset(rows)

    def reorder(self, batch_indices: Sequence[int] | Tensor) -> None:
        for layer in self.layers:
            layer.reorder(batch_indices)

    def memory_bytes(self) -> int:
        return sum(layer.memory_bytes() for layer in self.layers)


def check_dims(**dims: int) -> None:
    bad = {k: v for k, v in dims.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError("cache sizes must be positive ints, got " + ", ".join(f"{k}={v!r}" for k, v in bad.items()))


class ContiguousKVCache(LayeredCache):
    """Preallocated K/V for `num_layers` layers, (B, Hkv, max_seq_len, D) each.

    Args:
        dtype: the compute dtype K/V arrive and are returned in.
        kv_dtype: None (store `dtype`) or "int8" (int8 + fp32 scale per (token, head)).
        static: reads always cover all max_seq_len slots with a mask, so shapes never
            change between steps (for torch.compile / CUDA graphs).
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
        self.layers = [
            ContiguousLayerCache(
                batch_size,
                num_kv_heads,
                max_seq_len,
                head_dim,
                dtype=dtype,
                device=device,
                kv_dtype=kv_dtype,
                static=static,
            )
            for _ in range(num_layers)
        ]
        self.kv_dtype = self.layers[0].kv_dtype

    def book(self, num_new: int) -> None:
        """Check and advance every layer's host lengths by num_new tokens per sequence, for a
        static cache whose next step runs inside a compiled graph (which skips this)."""
        if not self.static:
            raise ValueError("book() is for static caches: a dynamic cache books inside update()")
        for layer in self.layers:
            layer._book(num_new, None)

    def trim(self, lengths: int | Sequence[int] | Tensor) -> None:
        """Keep only the first `lengths` tokens of each sequence in every layer (all checked first)."""
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
            f"dtype={self.dtype}, kv_dtype={self.kv_dtype}, static={self.static})"
        )
