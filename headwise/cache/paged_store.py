"""Storage of the paged cache: every layer's K/V planes, and the writes and reads of their blocks.

Storage, per layer, for K and for V: (Hkv, num_blocks, block_size, D), head-major.
Consecutive blocks are then a strided *view* (Hkv, n * block_size, D) whose rows are
contiguous per head, the contiguous cache's own layout, so attention reads them in
place at its speed. The issue's block-major (num_blocks, Hkv, block_size, D) needs a
permuting copy for that, and vLLM's token-major (num_blocks, block_size, Hkv, D) view
puts a head's rows Hkv * D apart, which the CPU kernel read 1.7-2.4x slower. Blocks
that are not consecutive are gathered a tile at a time (one `index_select` into a
reused buffer) and attended while the tile is in cache; tiles merge by log-sum-exp
(online softmax, Milakov & Gimelshein 2018). The pool hands a growing sequence the
block after its last one when that block is free, so a sequence decoded alone is one run.

int8 (`kv_dtype="int8"`): int8 K/V plus an fp32 scale per (token, head)
(quantized.py); a read dequantizes one tile at a time, never the whole sequence.
bf16 / fp16 (`kv_dtype="bfloat16"`, `"float16"`): 16-bit K/V, rounded to nearest even when
written; the C decode kernels (the one-call decode stack, the block-table decode read) read
them as stored, other reads convert one tile at a time.

The planes are allocated with torch.empty, so the OS makes their pages resident only as they
are written: a big pool costs memory as it fills, not up front. A block is zeroed the first
time the pool hands it out (`_fresh`): every read then meets finite values, also in the slots
of a block a sequence has not filled yet (masked slots still meet a 0 weight, and 0 * NaN = NaN).

`PagedStorage` is a base class of `PagedKVCache` (paged.py), which owns the sequences and
their block tables; the steps (paged_step.py, packed.py) write through `_write` and read
through `_tile`.
"""

from __future__ import annotations

import math
from typing import Hashable

import torch
from torch import Tensor

from ..attention.kv import Tile
from .base import StackParts
from .quantized import SCALE_DTYPE, dequantize_int8, quantize_int8, storage_dtype

# Keys per gathered tile. A K tile is Hkv * TILE_TOKENS * D * 4 bytes: 3 MiB at Hkv=12,
# D=64 (fp32), which stays in L2/L3 between the gather and the kernel. Fragmented decode at
# N=8192 (Hkv=12, D=64): 512 -> 7.4 ms, 1024 -> 6.8 ms, 2048 -> 8.6-16 ms (noisy, shared box).
TILE_TOKENS = 1024


class PagedStorage:
    """K and V planes, each (L, Hkv, num_blocks, block_size, D) (int8: plus (..., 1) fp32 scales).

    The subclass sets num_layers, num_kv_heads, head_dim, block_size, dtype, device and
    kv_dtype before `_allocate_storage`, and provides `_seq(seq_id)` for `read_sequence`.
    """

    def _allocate_storage(self, num_blocks: int) -> None:
        shape = (self.num_layers, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)  # (L, Hkv, NB, bs, D)
        stored = storage_dtype(self.kv_dtype, self.dtype)

        def planes():  # empty: resident as written; each block zeroed when first handed out (_zero_fresh)
            if self.kv_dtype == "int8":
                return (
                    torch.empty(shape, dtype=torch.int8, device=self.device),
                    torch.empty(shape[:-1] + (1,), dtype=SCALE_DTYPE, device=self.device),
                )
            return (torch.empty(shape, dtype=stored, device=self.device),)

        self._k, self._v = planes(), planes()
        self._fresh = bytearray(b"\x01") * num_blocks  # 1: never handed out, its memory unwritten
        self.pool.on_first_use = self._zero_fresh
        self._zero_fresh([b for b in range(num_blocks) if not self.pool.is_free(b)])  # held already (a null block)
        # each layer's value planes (Hkv, NB, bs, D), as views made once: indexing the pool per layer
        # per step showed up in a serving profile (a decode step asks 2 x num_layers times)
        self._layer_kv = [(self._k[0][i], self._v[0][i]) for i in range(self.num_layers)]
        # (K, V) as the one-call decode kernel reads them: those planes, or (int8, scales) pairs
        self._layer_planes = (
            [tuple((x[0][i], x[1][i]) for x in (self._k, self._v)) for i in range(self.num_layers)]
            if self.kv_dtype == "int8"
            else self._layer_kv
        )
        self._scratch: dict[tuple[int, int], Tensor] = {}  # gather buffers, reused tile to tile
        # PackedStep.claim_stack's parts over these planes (packed.py): the same object step after
        # step, remade when the planes are (its cache_layers is this _layer_kv)
        self.stack_memo: StackParts | None = None

    def _share_storage(self, other: "PagedStorage") -> None:
        """Read and write `other`'s planes (a hybrid cache's groups: one pool, one storage)."""
        if (other.num_layers, other.num_kv_heads, other.head_dim, other.block_size, other.dtype, other.kv_dtype) != (
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            self.dtype,
            self.kv_dtype,
        ):
            raise ValueError("a cache that shares another's storage needs its geometry (layers, heads, dims, dtypes)")
        self._k, self._v, self._layer_kv, self._layer_planes = other._k, other._v, other._layer_kv, other._layer_planes
        self._fresh = other._fresh
        self._scratch = {}
        self.stack_memo = None

    def memory_bytes(self) -> int:
        """Bytes of K/V storage for all layers (int8: values + scales) when every block is in use
        (the pool's pages become resident as blocks are first handed out)."""
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def _zero_fresh(self, blocks: list[int]) -> None:
        """Zero, in every layer, the blocks among `blocks` that were never handed out before (the
        pool's on_first_use): what was never written then reads as 0, never as stale or NaN bits."""
        fresh = [b for b in blocks if self._fresh[b]]
        if not fresh:
            return
        for b in fresh:
            self._fresh[b] = 0
        idx = torch.tensor(fresh, dtype=torch.long, device=self.device)
        for plane in (*self._k, *self._v):
            plane.index_fill_(2, idx, 0)  # (L, Hkv, NB, bs, D|1): dim 2 is the block

    # ------------------------------------------------------------------ storage access
    def _write(self, layer: int, slots: Tensor, src_index: Tensor | None, k: Tensor, v: Tensor) -> None:
        """New k, v (B, Hkv, T, D) -> their slots (flat block * block_size + offset) in `layer`."""
        B, Hkv, T, _ = k.shape
        for planes, x in ((self._k, k), (self._v, v)):
            parts = quantize_int8(x) if self.kv_dtype == "int8" else (x,)  # 16-bit: rounded by .to() below
            for plane, part in zip(planes, parts):
                src = part.permute(1, 0, 2, 3).reshape(Hkv, B * T, part.shape[-1])  # (Hkv, B*T, D|1)
                if src_index is not None:
                    src = src.index_select(1, src_index)  # real tokens only
                dst = plane[layer].view(Hkv, -1, plane.shape[-1])  # (Hkv, NB*bs, D|1)
                dst.index_copy_(1, slots, src.to(plane.dtype))

    def _tile(self, layer: int, seg: Tile, B: int, dtype: torch.dtype, scratch: bool = True) -> tuple[Tensor, Tensor]:
        """K and V of one segment, (B, Hkv, k1 - k0, D): a view, or one gather per plane.

        scratch: gather into buffers the cache keeps (valid until the next call). A fresh
        multi-MiB tensor per tile costs page faults on every first write: measured 3 ms
        instead of 0.6 ms for a 12 MiB gather.
        """
        n = seg.k1 - seg.k0
        out = []
        for which, planes in enumerate((self._k, self._v)):
            parts = []
            for i, p in enumerate(planes):
                src = p[layer]  # (Hkv, NB, bs, D|1)
                if seg.index is None:
                    parts.append(src[:, seg.first : seg.first + seg.count])
                    continue
                shape = (src.shape[0], seg.index.numel(), *src.shape[2:])  # (Hkv, B*count, bs, D|1)
                buf = self._scratch_for((which, i), shape, src.dtype) if scratch else None
                parts.append(
                    torch.index_select(src, 1, seg.index, out=buf)
                    if buf is not None
                    else src.index_select(1, seg.index)
                )
            if self.kv_dtype == "int8":
                x = dequantize_int8(parts[0], parts[1], dtype)
            elif parts[0].dtype != dtype and scratch:  # 16-bit: converted into a reused buffer
                x = self._scratch_for((which, "wide"), parts[0].shape, dtype).copy_(parts[0])
            else:
                x = parts[0].to(dtype)
            x = x.reshape(self.num_kv_heads, B, seg.count * self.block_size, self.head_dim)
            out.append(x.transpose(0, 1)[:, :, :n])
        return out[0], out[1]

    def _scratch_for(self, key, shape, dtype) -> Tensor:
        numel = math.prod(shape)
        buf = self._scratch.get(key)
        # An inference-mode tensor cannot be written outside inference mode (nor the reverse
        # be relied on), so a buffer made in the other mode is replaced.
        if buf is None or buf.numel() < numel or buf.is_inference() != torch.is_inference_mode_enabled():
            buf = self._scratch[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def read_sequence(self, seq_id: Hashable, layer: int = 0) -> tuple[Tensor, Tensor]:
        """A copy of one sequence's K and V in `layer`, each (Hkv, length, D) in the compute
        dtype: for tests, debugging and moving a sequence elsewhere, not for attention."""
        seq = self._seq(seq_id)
        if not seq.blocks:
            empty = torch.zeros(self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        idx = torch.tensor(seq.blocks, device=self.device)
        k, v = self._tile(layer, Tile(0, seq.length, 0, len(seq.blocks), idx), 1, self.dtype, scratch=False)
        return k[0], v[0]
