"""A step over the paged cache: the batch's block tables as `BlockReads` for the `paged` backend.

`PagedKVCache.batch(...)` returns a `PagedStep`: positions, slots and a read plan (which rows
read which tiles of the pool), made once and shared by every layer. `step.layer(i)` is what
attention layer i writes through (`PagedLayerStep.update`) and reads through (`PagedRead`).
Consecutive blocks are read as views of the pool; scattered ones are gathered a tile at a
time into a reused buffer, and tiles merge by log-sum-exp (the `paged` backend).

Measured here (2 shared cores, fp32, one thread, min of 40 decode steps at N=8192, B=1):

    H/Hkv/D    contiguous   paged, one run        paged, every other block (gathered)
    12/12/64   3.2-3.5 ms   3.7-4.0 ms (1.1x)     6.8-7.5 ms (2.0-2.3x)
    32/8/128   18-21 ms     10-15 ms (0.5-0.7x)   11.6-16 ms (0.6-0.8x)

GQA reads beat the contiguous cache because they fold the G query heads of a group into
G*T rows against their one KV head, which on CPU is faster than SDPA's enable_gqa.
flex_attention over the whole pool with a page-table mask_mod (compiled, 7-14 s) took
10.2 ms (128-key KV blocks) and 13.3 ms (16-key blocks) against SDPA's 2.6-3.0 ms on
the same keys, so it is not used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..attention.functional import attend_kv
from ..attention.kv import BlockReads, LayerKV, Tile, TileGroup
from ..attention.step import Step

if TYPE_CHECKING:  # the storage PagedKVCache (paged.py, which imports this file) is built on
    from .paged_store import PagedStorage

# A run of at least this many consecutive blocks is read as a view rather than gathered.
MIN_VIEW_BLOCKS = 8
# One more kernel call (plus its log-sum-exp merge) costs about as much as reading this many
# more keys: ~40 us against ~0.4 us per key at Hkv * D = 768 (measured here, B=64 x 20-60
# tokens: 6.6 ms read together vs 18.7 ms one by one; B=16 x 50-500: 7.3 vs 4.6 ms).
CALL_COST_KEYS = 100


class PagedStep(BlockReads, Step):
    """One model step over a batch of sequences: positions, slots and read tiles, shared by
    every layer. `step.layer(i)` is what attention layer i gets as its cache. As a
    `BlockReads` it is the description of the step's K/V that the `paged` backend reads.

    Row b of the batch is seq_ids[b]; its T = max(num_new) query rows are positions
    starts[b] + t, of which the first num_new[b] are real (the rest right padding).
    """

    def __init__(
        self,
        cache: "PagedStorage",  # a PagedKVCache
        seq_ids,
        tables,
        starts,
        counts,
        pending,
        *,
        write: bool = True,
        logits_indices: Tensor | None = None,
    ):
        """write=False: a read plan only (a part of a packed step, which writes for it)."""
        dev, bs = cache.device, cache.block_size
        self.cache, self.seq_ids, self.num_new, self.starts = cache, seq_ids, counts, starts
        B, T = len(seq_ids), max(counts)
        self.B, self.T = B, T
        self.ends = [L + n for L, n in zip(starts, counts)]  # keys per sequence after the step
        self.S = max(self.ends)  # padded key axis
        self._pending, self._written = pending, set()
        if write:
            slots = [t[p // bs] * bs + p % bs for t, L, n in zip(tables, starts, counts) for p in range(L, L + n)]
            self._slots = torch.tensor(slots, dtype=torch.long, device=dev)
            ragged = any(n != T for n in counts)
            self._src_index = (
                torch.tensor([b * T + t for b, n in enumerate(counts) for t in range(n)], dtype=torch.long, device=dev)
                if ragged
                else None
            )
        self.block_size, self.num_kv_heads, self.head_dim = bs, cache.num_kv_heads, cache.head_dim
        self.dtype, self.device, self.kv_dtype = cache.dtype, dev, cache.kv_dtype
        self.tables = [list(t) for t in tables]  # as of this step
        # A windowed cache's rows read from the first block any of their queries can see: the
        # blocks before it are back in the pool (their entries are the null block)
        W = cache.window
        self.first_blocks = [0] * B if W is None else [max(0, L - W + 1) // bs for L in starts]
        self.groups = self._plan(self.tables)
        # Tile masks that depend on the step alone (validity, causality), built by the first
        # layer and reused by the others: (k0, k1, rows, G, causal, dtype) -> (mask, dead rows).
        self.mask_memo: dict[tuple, tuple[Tensor | None, Tensor | None]] = {}
        self.logits_indices = logits_indices  # (R,) or None: see Step

    @property
    def input_positions(self) -> Tensor:
        """(B, T) positions of the step's query rows (Step's field)."""
        return self.query_positions

    def _plan(self, tables) -> list[TileGroup]:
        """Which rows read which tiles: every sequence alone, over exactly its own blocks
        (views where they are consecutive, no padding, no validity mask), or, for a batch
        of short sequences, all rows at once from padded gathers of ~tile_tokens keys in
        all, which saves a kernel call per sequence. Chosen by a cost in keys read."""
        bs, tile_blocks = self.cache.block_size, self.cache.tile_blocks
        if self.B > 1 and self.S <= tile_blocks * bs:
            width = max(1, tile_blocks // self.B)
            nb = -(-self.S // bs)
            together = self.B * self.S + -(-nb // width) * CALL_COST_KEYS
            alone = sum(self.ends) + self.B * CALL_COST_KEYS
            if together <= alone:
                lo = min(self.first_blocks)
                return [TileGroup(slice(0, self.B), self._gathers(tables, lo, nb, self.S, width))]
        return [
            TileGroup(slice(b, b + 1), self._one(t, S, lo))
            for b, (t, S, lo) in enumerate(zip(tables, self.ends, self.first_blocks))
        ]

    def _gathers(self, tables, i: int, j: int, S: int, width: int | None = None) -> list[Tile]:
        """Tiles of `width` blocks over blocks [i, j) of every table (right-padded with block 0,
        masked), keys < S."""
        cache, bs = self.cache, self.cache.block_size
        tile = width or cache.tile_blocks
        segs = []
        for a in range(i, j, tile):
            b = min(a + tile, j)
            rows = [(t[a:b] + [0] * (b - a))[: b - a] for t in tables]
            idx = torch.tensor([x for r in rows for x in r], dtype=torch.long, device=cache.device)
            segs.append(Tile(a * bs, min(b * bs, S), 0, b - a, idx))
        return segs

    def _one(self, table: list[int], S: int, first: int = 0) -> list[Tile]:
        """Tiles of one sequence of S keys, from block `first`: runs of >= MIN_VIEW_BLOCKS
        consecutive blocks are views (for a decode step of a float cache, one kernel call over
        the whole run); the scattered blocks between them are gathered tile_blocks at a time."""
        cache, bs, tile = self.cache, self.cache.block_size, self.cache.tile_blocks
        nb = -(-S // bs)
        cap = nb if self.T == 1 and not cache.kv_dtype else tile
        segs: list[Tile] = []
        pend, i = None, first  # pend: first of the scattered blocks not yet emitted
        while i < nb:
            j = i + 1
            while j < nb and table[j] == table[j - 1] + 1:
                j += 1
            if j - i >= MIN_VIEW_BLOCKS:
                if pend is not None:
                    segs += self._gathers([table], pend, i, S)
                    pend = None
                for a in range(i, j, cap):
                    c = min(cap, j - a)
                    segs.append(Tile(a * bs, min((a + c) * bs, S), table[a], c, None))
            elif pend is None:
                pend = i
            i = j
        if pend is not None:
            segs += self._gathers([table], pend, nb, S)
        return segs

    def read_tile(
        self, layer: int, tile: Tile, B: int, dtype: torch.dtype, scratch: bool = True
    ) -> tuple[Tensor, Tensor]:
        return self.cache._tile(layer, tile, B, dtype, scratch)

    # ------------------------------------------------------------------ layers
    def layer(self, i: int) -> "PagedLayerStep":
        if not 0 <= i < self.cache.num_layers:
            raise IndexError(f"layer {i} out of range: this cache has num_layers={self.cache.num_layers}")
        return PagedLayerStep(self, i)

    def positions(self, num_new: int) -> Tensor:  # single-layer caches: the step is the layer
        return self._only().positions(num_new)

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None) -> "PagedRead":
        return self._only().update(k, v, num_new)

    def _only(self) -> "PagedLayerStep":
        if self.cache.num_layers != 1:
            raise TypeError(f"this cache has num_layers={self.cache.num_layers}; pass step.layer(i) to layer i")
        return self.layer(0)

    def _mark_written(self, layer: int) -> None:
        """Once every layer holds the step's K/V, its full blocks become findable by prefix."""
        self._written.add(layer)
        if len(self._written) == self.cache.num_layers and self._pending:
            pool = self.cache.pool
            for block, key in self._pending:
                if pool.refcount(block) > 0:
                    pool.register(block, key)
            self._pending = []


class PagedLayerStep:
    """Layer i's view of a step; implements `LayerKVCache` (positions, update)."""

    def __init__(self, step: PagedStep, layer: int):
        self.step, self.layer_index = step, layer

    def positions(self, num_new: int) -> Tensor:
        """(B, T) absolute positions of this step's tokens."""
        if num_new != self.step.T:
            raise ValueError(
                f"positions({num_new}) but this step holds T={self.step.T} tokens per sequence "
                f"(max of num_new={self.step.num_new})"
            )
        return self.step.query_positions

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None) -> "PagedRead":
        """Write this step's k, v (B, Hkv, T, D) into their reserved slots; return the read."""
        step, cache = self.step, self.step.cache
        want = (step.B, cache.num_kv_heads, step.T, cache.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 4:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name} must be (B, Hkv, T, D) = {want}, got {got}")
            if x.shape[1] != cache.num_kv_heads:
                raise ValueError(
                    f"{name} has {x.shape[1]} KV heads but this cache holds "
                    f"num_kv_heads={cache.num_kv_heads} ({name} shape {tuple(x.shape)})"
                )
            if x.shape[3] != cache.head_dim:
                raise ValueError(f"{name} has head dim {x.shape[3]} but this cache holds head_dim={cache.head_dim}")
            if tuple(x.shape) != want:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)} but this step is (B, Hkv, T, D) = {want}: "
                    f"{step.B} sequences {step.seq_ids}, T = max(num_new={step.num_new})"
                )
            if x.dtype != cache.dtype:
                raise TypeError(
                    f"{name} has dtype {x.dtype} but this cache holds {cache.dtype}; "
                    f"build the cache with dtype={x.dtype} or cast the model"
                )
            if x.device != cache.device:
                raise ValueError(f"{name} is on {x.device} but this cache lives on {cache.device}")
        if num_new is not None:
            got = torch.as_tensor(num_new).reshape(-1).tolist()
            if got != step.num_new:
                raise ValueError(
                    f"num_new={got} (from the padding mask) but this step reserved "
                    f"num_new={step.num_new} for {step.seq_ids}"
                )
        cache._write(self.layer_index, step._slots, step._src_index, k, v)
        step._mark_written(self.layer_index)
        return PagedRead(step, self.layer_index)


class PagedRead:
    """One layer's read of a paged step (`PagedStep`) or a packed one (`cache/packed.py`
    `PackedStep`): hands the `paged` backend where the K/V live (see `attend`)."""

    def __init__(self, step, layer: int):  # a PagedStep or a packed.PackedStep
        self.step, self.layer = step, layer

    @property
    def kv(self) -> LayerKV:
        """This read's K/V as the backends see them (`headwise.attention.explain(q, read.kv)`)."""
        return LayerKV(self.step, self.layer)

    def attend(
        self,
        q: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_map: Tensor | None = None,
        alibi_slopes: Tensor | None = None,
        scale: float | None = None,
        dropout_p: float = 0.0,
        backend: str = "auto",
        need_weights: bool = False,
        return_lse: bool = False,
        window=None,
    ):
        """q (B, H, T, D) -> (B, H, T, D), or AttentionOutput(out, lse, weights) with return_lse /
        need_weights, as `headwise.attend`.

        Query row t of sequence b sits at position starts[b] + t; is_causal lets it see keys
        at positions <= its own, and a sequence never sees past its own length. attn_mask
        (broadcastable to (B, H, T, S)) and key_padding_mask (B, S) are over the padded key
        axis S = max over the batch of (length after this step). ALiBi uses each row's
        true position. backend="math" gathers the sequences into one tensor and runs the
        reference (weights, dropout); "auto", "paged" and every other registered name run
        the in-place tiled read (a layer's backend choice does not apply to blocks).

        Over a packed step, q is (1, H, N, D): each token attends to its own sequence only, to
        every cached key and, with is_causal, to its chunk's keys up to its own position; masks
        over the packed axis are not supported (a per-sequence mask belongs to a padded
        `PagedKVCache.batch` step), and backend="math" runs the gathering reference per part.
        """
        return attend_kv(
            q,
            self.kv,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            kv_map=kv_map,
            alibi_slopes=alibi_slopes,
            scale=scale,
            dropout_p=dropout_p,
            backend=backend,
            need_weights=need_weights,
            return_lse=return_lse,
            window=window,
        )
