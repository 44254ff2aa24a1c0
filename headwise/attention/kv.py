"""What attention needs from a KV cache, and how a cache describes where its K/V live.

A model hands each attention layer a `LayerKVCache`. The layer asks it where the new
tokens sit (for RoPE), writes the new keys/values, and attends through what `update`
returns:

    pos = cache.positions(T)                 # (B, T) absolute positions
    read = cache.update(k, v, num_new)       # k, v: (B, Hkv, T, D)
    out = read.attend(q, **attend_kwargs)    # (B, H, T, D)

A cache whose keys are one tensor per layer hands `attend` those tensors. A paged cache
instead describes, once per step, where each sequence's keys are in its block pool
(`BlockReads`, `PackedReads`), and the `paged` backend (backends/paged.py) reads them
in place. Caches store and describe; they do not attend.

Also here: the GQA fold, written once. The G = H // Hkv query heads that share a KV head
become G*T rows against that one head, so K/V are never copied per query head:

    fold_heads(q, Hkv)      (B, H, T, D)      -> (B, Hkv, G*T, D)    head h = kv * G + g
    unfold_heads(o, H)      (B, Hkv, G*T, D)  -> (B, H, T, D)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor


# ------------------------------------------------------------------ the GQA fold
def fold_heads(x: Tensor, Hkv: int) -> Tensor:
    """(B, H, T, X) -> (B, Hkv, G*T, X): the G query heads of KV head j are rows j*G .. j*G+G-1
    of the head axis, so they become G*T rows (g-major) against that head. A view when x allows."""
    B, H, T, X = x.shape
    return x.reshape(B, Hkv, (H // Hkv) * T, X)


def unfold_heads(x: Tensor, H: int) -> Tensor:
    """(B, Hkv, G*T, X) -> (B, H, T, X), the inverse of `fold_heads`."""
    B, Hkv, GT, X = x.shape
    return x.reshape(B, H, GT // (H // Hkv), X)


def fold_mask(m: Tensor, Hkv: int, G: int) -> Tensor:
    """A (B|1, 1|H, T, n) mask -> (B|1, 1|Hkv, G*T, n), rows in the order of `fold_heads`."""
    Bm, Hm, T, n = m.shape
    if Hm == 1:
        return m if G == 1 else m[:, :, None].expand(Bm, 1, G, T, n).reshape(Bm, 1, G * T, n)
    return m.reshape(Bm, Hkv, G * T, n)


# ------------------------------------------------------------------ the cache protocol
@runtime_checkable
class LayerKVCache(Protocol):
    def positions(self, num_new: int) -> Tensor:
        """Absolute positions, (B, T) long, that the next `num_new` tokens get."""
        ...

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None):
        """Append new keys/values (B, Hkv, T, D) and return a read with `.attend(q, ...)`.

        num_new: (B,) long, how many of the T tokens are real per sequence (the rest
        are right padding and are not kept); None = all T.
        """
        ...


# ------------------------------------------------------------------ block-table descriptions
class Tile(NamedTuple):
    """A tile of the key axis: positions [k0, k1), from blocks [first, first + count) of
    the pool (a view; batch of one) or gathered by `index` ((B * count,) block ids)."""

    k0: int
    k1: int
    first: int
    count: int
    index: Tensor | None


class TileGroup(NamedTuple):
    """Batch rows that read the same tiles (all of them, or one sequence)."""

    rows: slice
    segments: list[Tile]


class BlockReads:
    """Where one step's K/V live in a block pool, as the paged backend reads them.

    A paged cache's step (cache/paged.py `PagedStep`) sets these once per step; every
    layer reads through them. Row b of the batch has T = max(num_new) query rows at
    positions starts[b] + t and sees keys [0, ends[b]); S = max(ends) is the padded key axis.

        B, T, S                 ints
        starts, ends            list[int] (B,)
        groups                  list[TileGroup]: which rows read which tiles
        tables                  list[list[int]]: each row's block table (for the gathering reference)
        block_size, num_kv_heads, head_dim, dtype, device: the pool's geometry
        kv_dtype                None or "int8" (tiles are dequantized when read)
        mask_memo               dict the backend fills with per-step tile masks
    """

    B: int
    T: int
    S: int
    starts: list[int]
    ends: list[int]
    groups: list[TileGroup]
    tables: list[list[int]]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_dtype: str | None
    mask_memo: dict

    def read_tile(
        self, layer: int, tile: Tile, B: int, dtype: torch.dtype, scratch: bool = True
    ) -> tuple[Tensor, Tensor]:
        """K and V of one tile in `layer`, (B, Hkv, k1 - k0, D): a view, or one gather per plane
        (scratch: into buffers the cache reuses, valid until the next call)."""
        raise NotImplementedError

    @functools.cached_property
    def query_positions(self) -> Tensor:
        """(B, T) long: position of each query row (rope, causal masks); built on first use."""
        return torch.tensor(self.starts, device=self.device)[:, None] + torch.arange(self.T, device=self.device)

    @functools.cached_property
    def ends_t(self) -> Tensor:
        return torch.tensor(self.ends, device=self.device)  # (B,) keys per sequence


class RegionGrid(NamedTuple):
    """Regions r0 .. r0 + count - 1 of the pool seen as a batch of `count` sequences of `width`
    keys; row j of the part is region r0 + slot[j], with lengths[j] keys."""

    r0: int
    count: int
    width: int
    slot: list[int]
    lengths: list[int]
    gather: Tensor | None  # (rows,) region slot of each row; None when row j is slot j


class PackedPart(NamedTuple):
    """Pack rows [start, stop) (or the `index` rows) and how they are read:
    "chunk": one sequence's T = stop - start query rows, through `reads` (a BlockReads);
    "decodes": one row per sequence, in place through `PackedReads.decode_tables` or through
        `reads`, a batched read plan (tiles, gathers);
    "runs": one row per sequence whose keys are one consecutive run of blocks: `spans` holds
        each one's (first slot, number of keys), read in place as views of the pool;
    "regions": one row per sequence that starts a region of the pool and fits in it: all
        read by one kernel call on one strided view (`grid`)."""

    kind: str
    start: int
    stop: int
    index: Tensor | None  # rows that are not contiguous in the pack: their (n,) positions
    reads: BlockReads | None
    spans: list[tuple[int, int]] | None
    grid: RegionGrid | None = None


class PackedReads:
    """Where a packed step's K/V live: sequences' new tokens end to end on one axis (batch of
    one, N tokens), split into `parts` that are read differently. Set by cache/packed.py.

        N                       tokens in the pack
        parts                   list[PackedPart]
        num_kv_heads, head_dim, dtype, device: the pool's geometry
        mask_memo               dict the backend fills with per-step masks
    (int8 pools plan no "runs"/"regions": their tiles must be dequantized, not viewed)
    """

    N: int
    parts: list[PackedPart]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    mask_memo: dict

    def run_views(self, i: int) -> list[tuple[Tensor, Tensor]]:
        """Per sequence of "runs" part i: its K and V in every layer, (L, 1, Hkv, n, D) views."""
        raise NotImplementedError

    def region_views(self, layer: int, i: int) -> tuple[Tensor, Tensor]:
        """K and V of "regions" part i in `layer`: strided views (count, Hkv, width, D) of the pool."""
        raise NotImplementedError

    def fallback(self, i: int) -> BlockReads:
        """A read plan for "runs"/"regions" part i, for a call that cannot read it in place."""
        raise NotImplementedError

    def decode_tables(self, layer: int, i: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int] | None:
        """For "decodes" part i, read in place through block tables: (K, V of `layer` as (Hkv,
        slots, D) planes of the pool, tables (Bd, width) int64, lengths (Bd,) int64, block size),
        or None where the pool cannot be read as it is stored (int8)."""
        return None


class LayerKV(NamedTuple):
    """One layer's K/V as a cache describes them: what `attend_kv` and the paged backend take."""

    reads: BlockReads | PackedReads
    layer: int
