"""Storage of the (B, Hkv, S, D) caches and the checks they share.

KVStore     one layer's K and V buffers, (B, Hkv, N, D), in the compute dtype, in bf16 / fp16,
            or as int8 + per-(token, head) scales (quantized.py): slice, scatter and per-token
            writes, and reads of the first S slots (views; 16-bit and int8 converted when read).
check_new_kv, new_counts, causal_visibility, check_dims, _as_rows
            validation and masks used by the contiguous (contiguous.py) and sliding
            (sliding.py) caches; errors name both sides' numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .protocol import CacheRead
from .quantized import SCALE_DTYPE, Int8CacheRead, dequantize_int8, quantize_int8


class KVStore:
    """K and V buffers of one layer, (B, Hkv, N, D), in the compute dtype, in `stored` (bf16 /
    fp16: written rounded to nearest even, read converted back exactly), or as int8 + scales.

    Each of K and V is a tuple of planes written with the same index: (values,) or
    (int8 values, (B, Hkv, N, 1) fp32 scales).
    """

    def __init__(self, B: int, Hkv: int, N: int, D: int, *, dtype: torch.dtype, device, int8: bool, stored=None):
        self.dtype, self.int8 = dtype, int8
        self.stored = dtype if stored is None or int8 else stored  # the values' dtype (not int8's)
        if int8:

            def planes():
                return (
                    torch.zeros(B, Hkv, N, D, dtype=torch.int8, device=device),
                    torch.zeros(B, Hkv, N, 1, dtype=SCALE_DTYPE, device=device),
                )
        else:

            def planes():  # zeros, not empty: masked slots are still multiplied by 0 weights, NaN would leak
                return (torch.zeros(B, Hkv, N, D, dtype=self.stored, device=device),)

        self.k, self.v = planes(), planes()

    def planes(self) -> tuple:
        """(K, V) as a kernel reads them in place: the fp32 / 16-bit buffers, or each an (int8, scales) pair."""
        if self.int8:
            return self.k, self.v
        return self.k[0], self.v[0]

    def _encode(self, x: Tensor) -> tuple[Tensor, ...]:
        return quantize_int8(x) if self.int8 else (x.to(self.stored),)

    def _decode(self, x: Tensor) -> Tensor:
        return x if x.dtype == self.dtype else x.to(self.dtype)

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
        k, v = self.k[0].narrow(2, 0, S), self.v[0].narrow(2, 0, S)
        return CacheRead(self._decode(k), self._decode(v), key_padding_mask, attn_mask)

    def dense(self) -> tuple[Tensor, Tensor]:
        """All N slots of K and V in the compute dtype (views, or converted copies)."""
        if self.int8:
            return dequantize_int8(*self.k, self.dtype), dequantize_int8(*self.v, self.dtype)
        return self._decode(self.k[0]), self._decode(self.v[0])

    def round_trip(self, x: Tensor) -> Tensor:
        """x as a later read will see it (int8: quantized and back; 16-bit: rounded), for attending
        before writing."""
        if self.int8:
            return dequantize_int8(*quantize_int8(x), self.dtype)
        return self._decode(x.to(self.stored))

    def reorder(self, idx: Tensor) -> None:
        for buf in (*self.k, *self.v):
            buf.copy_(buf.index_select(0, idx))  # in place: the storage (and a compiled graph's view of it) stays

    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in (*self.k, *self.v))


# ------------------------------------------------------------------ checks shared with sliding.py
def check_new_kv(k: Tensor, v: Tensor, B: int, Hkv: int, D: int, dtype: torch.dtype, device) -> int:
    """Validate new keys/values against a cache; return T. Errors name both sides' numbers."""
    if (  # the common case in one test (a decode step calls this once a layer); else find what is wrong
        isinstance(k, Tensor)
        and isinstance(v, Tensor)
        and k.dim() == 4
        and v.shape == k.shape
        and k.shape[0] == B
        and k.shape[1] == Hkv
        and k.shape[3] == D
        and k.dtype == dtype
        and v.dtype == dtype
        and k.device == device
        and v.device == device
    ):
        return k.shape[2]
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


def check_dims(**dims: int) -> None:
    bad = {k: v for k, v in dims.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError("cache sizes must be positive ints, got " + ", ".join(f"{k}={v!r}" for k, v in bad.items()))


def check_windows(windows, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows (None = global, int W >= 1 = the last W keys), one per layer; None: all global."""
    if windows is None:
        return (None,) * num_layers
    windows = tuple(windows)
    if len(windows) != num_layers:
        raise ValueError(f"windows has {len(windows)} entries but the cache has num_layers={num_layers}")
    for i, w in enumerate(windows):
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"windows[{i}] must be None (a global layer) or an int >= 1, got {w!r}")
    return windows
