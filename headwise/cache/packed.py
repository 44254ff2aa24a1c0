"""A packed (varlen) step over the paged cache: every sequence's new tokens on one axis, no padding.

`PagedKVCache.batch` right-pads a ragged step to T = max(num_new), so a decode (1
token) batched with a 256-token prefill chunk would cost 256 rows. A packed step
instead lays the step's tokens end to end, as FlashAttention's varlen API and vLLM do:

    step = cache.packed(["a", "b", "c"], num_new=[1, 1, 200], token_ids=...)
    logits = model(input_ids, step)                # input_ids (1, 202): a's, b's, then c's tokens

Each layer projects (1, N, C) in one matmul, then `step.layer(i)` writes every token's
K/V to its own slot. The step is also the description (`PackedReads`) that the `paged`
attention backend (attention/backends/paged.py) reads, part by part:
- decodes (one new token) of sequences that each start a region of the pool and fit in
  it (`region_blocks`): all at once, one fused-kernel call on one strided view ("regions");
- other decodes whose sequence's blocks are one consecutive run: in place, one call per
  sequence on a view of the pool, no gather, no mask ("runs"; `spread=True` placement
  keeps sequences that grow side by side consecutive);
- remaining decodes together: in place through their block tables, one kernel call
  (`decode_tables`; 16-bit pools too, and every decode of one goes here, the kernel reading
  them as stored), or where that cannot run (int8, no kernel) a batched `PagedStep` read plan
  (tiles, gathers);
- each longer chunk (a prefill) alone against its own blocks, bottom-right causal.
Read plans, masks and views are built once per step and shared by all layers.

Measured here (SmolLM2-135M fp32, 2 threads, prompts of 112-144 tokens, decode-only
steps, min of 20 interleaved): a whole engine step with "regions" vs "runs" 79 vs 87 ms
at 16 sequences, 204 vs 250 ms at 64. Decode attention alone, 30 layers, 16 sequences
of 112-300 tokens (1 thread): runs 33 ms, through the tiled read plan 75 ms. What remains
is reading K/V: a 256-token SmolLM2 sequence holds 12 MB of fp32 K/V over 30 layers, so
at 64 sequences a step reads more K/V than weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention.backends.paged import in_place_ok
from ..attention.kv import PackedPart, PackedReads, RegionGrid
from ..attention.step import Step
from .base import StackParts
from .paged_step import PagedRead

# The in-place read of decodes needs PyTorch's CPU flash kernel (it takes strided K/V views).
RUNS_OK = in_place_ok()


class PackedStep(PackedReads, Step):
    """One model step over sequences packed along a single token axis (batch of one). As a
    `PackedReads` it is the description of the step's K/V that the `paged` backend reads.

    Sequence b contributes num_new[b] tokens at pack offsets [offsets[b], offsets[b+1]),
    at positions starts[b] .. starts[b] + num_new[b] - 1. Built by `PagedKVCache.packed`.
    """

    def __init__(
        self,
        cache,
        seq_ids,
        tables,
        starts,
        counts,
        pending,
        *,
        defer_prefix: bool = False,
        logits_indices: Tensor | None = None,
        as_rows: bool = False,
    ):
        dev, bs = cache.device, cache.block_size
        # as_rows: every token may run as a decode row of its sequence (decode_rows): a decode with
        # a few draft tokens (runtime/predict.py), which the decode stack reads as rows at positions
        # start, start + 1, ... of one block table; the prefill route's kernels cost far more there
        self.as_rows = as_rows
        self.cache, self.seq_ids, self.num_new, self.starts = cache, list(seq_ids), list(counts), list(starts)
        self.B, self.N = len(seq_ids), sum(counts)
        self.offsets = [0]
        for n in counts:
            self.offsets.append(self.offsets[-1] + n)
        positions = [p for L, n in zip(starts, counts) for p in range(L, L + n)]
        slots = [t[p // bs] * bs + p % bs for t, L, n in zip(tables, starts, counts) for p in range(L, L + n)]
        self._positions = torch.tensor(positions, dtype=torch.long, device=dev)[None]  # (1, N)
        self.max_position = max(positions, default=None)  # Step's: RoPE rows from a table
        self._slots = torch.tensor(slots, dtype=torch.long, device=dev)  # (N,)
        self._pending, self._written, self.defer_prefix = pending, set(), defer_prefix
        self.num_kv_heads, self.head_dim, self.dtype, self.device = cache.num_kv_heads, cache.head_dim, cache.dtype, dev
        self._tables = [list(t) for t in tables]  # as of this step
        self.parts = self._plan(self._tables)
        self._views: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self.mask_memo: dict[tuple, Tensor] = {}
        self._decode_rows: tuple | None = None  # decode_rows()'s claim, built once per step
        self.logits_indices = logits_indices  # (R,) pack rows or None: see Step

    @property
    def input_positions(self) -> Tensor:
        """(1, N) positions of the packed tokens, each in its own sequence (Step's field)."""
        return self._positions

    def _plan(self, tables) -> list[PackedPart]:
        cache, bs, R = self.cache, self.cache.block_size, self.cache.region_blocks
        parts, dec, runs, grid = [], [], [], []
        for b, n in enumerate(self.num_new):
            if n != 1:
                continue
            S, t = self.starts[b] + 1, tables[b]
            nb = -(-S // bs)
            # A windowed cache's decodes go through its read plan, which starts at the window
            # (a view or the kernel from key 0 would read the null block's entries)
            if (
                RUNS_OK
                and not cache.kv_dtype
                and cache.window is None
                and all(t[i + 1] == t[i] + 1 for i in range(nb - 1))
            ):
                if R and t[0] % R == 0 and nb <= R:
                    grid.append((b, t[0] // R, S))
                else:
                    runs.append((b, (t[0] * bs, S)))
            else:
                dec.append(b)
        if grid:
            r0, r1 = min(r for _, r, _ in grid), max(r for _, r, _ in grid)
            if len(grid) >= 2 and r1 - r0 + 1 <= 2 * len(grid):  # few empty regions in between
                slot = [r - r0 for _, r, _ in grid]
                dense = slot == list(range(len(grid))) and r1 - r0 + 1 == len(grid)
                gather = None if dense else torch.tensor(slot, dtype=torch.long, device=cache.device)
                g = RegionGrid(r0, r1 - r0 + 1, max(S for _, _, S in grid), slot, [S for _, _, S in grid], gather)
                parts.append(self._rows_part("regions", [b for b, _, _ in grid], None, None)._replace(grid=g))
            else:
                runs += [(b, (r * R * bs, S)) for b, r, S in grid]
                runs.sort()
        if runs:
            parts.append(self._rows_part("runs", [b for b, _ in runs], None, [span for _, span in runs]))
        if dec:
            sub = cache._read_plan(
                [self.seq_ids[b] for b in dec], [tables[b] for b in dec], [self.starts[b] for b in dec], [1] * len(dec)
            )
            parts.append(self._rows_part("decodes", dec, sub, None))
        for b, n in enumerate(self.num_new):
            if n > 1:
                sub = cache._read_plan([self.seq_ids[b]], [tables[b]], [self.starts[b]], [n])
                parts.append(PackedPart("chunk", self.offsets[b], self.offsets[b + 1], None, sub, None))
        return parts

    def _rows_part(self, kind, seqs, sub, spans) -> PackedPart:
        rows = [self.offsets[b] for b in seqs]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        index = None if contiguous else torch.tensor(rows, dtype=torch.long, device=self.cache.device)
        return PackedPart(kind, rows[0], rows[-1] + 1, index, sub, spans)

    def run_views(self, i: int) -> list[tuple[Tensor, Tensor]]:
        """Per sequence of "runs" part i: K and V of its keys in every layer, (L, 1, Hkv, n, D)
        views of the pool, made once per step so that a layer only indexes them."""
        views = self._views.get(i)
        if views is None:
            cache = self.cache
            L, Hkv, D = cache.num_layers, cache.num_kv_heads, cache.head_dim
            K = cache._k[0].view(L, 1, Hkv, -1, D)  # (L, 1, Hkv, NB * bs, D)
            V = cache._v[0].view(L, 1, Hkv, -1, D)
            views = self._views[i] = [
                (K[:, :, :, s0 : s0 + n], V[:, :, :, s0 : s0 + n]) for s0, n in self.parts[i].spans
            ]
        return views

    def region_views(self, layer: int, i: int) -> tuple[Tensor, Tensor]:
        """K and V of "regions" part i in `layer`: region r's keys are slots [r * R * bs, r * R * bs
        + width) of the pool, a fixed stride apart, so one as_strided view (count, Hkv, width, D)
        of each plane holds them all."""
        cache, grid = self.cache, self.parts[i].grid
        Hkv, bs, R, NB, D = cache.num_kv_heads, cache.block_size, cache.region_blocks, cache.num_blocks, cache.head_dim
        size, stride = (grid.count, Hkv, grid.width, D), (R * bs * D, NB * bs * D, D, 1)
        kv = []
        for planes in (cache._k, cache._v):
            plane = planes[0][layer]  # (Hkv, NB, bs, D)
            kv.append(plane.as_strided(size, stride, plane.storage_offset() + grid.r0 * R * bs * D))
        return kv[0], kv[1]

    def fallback(self, i: int):
        """A PagedStep read plan for a "runs" or "regions" part, when a layer's call cannot take
        the in-place path."""
        part = self.parts[i]
        if part.reads is None:
            seqs = self._part_seqs(i)
            sub = self.cache._read_plan(
                [self.seq_ids[b] for b in seqs],
                [self._tables[b] for b in seqs],
                [self.starts[b] for b in seqs],
                [1] * len(seqs),
            )
            part = self.parts[i] = part._replace(reads=sub)
        return part.reads

    def _block_tables(self, seqs: list[int]) -> tuple[list[list[int]], Tensor]:
        """Sequences `seqs` (indices into this step): each one's blocks holding keys 0 .. its last new
        one, and those tables padded into one (len(seqs), width) int64 tensor (padding: block 0,
        never read)."""
        bs = self.cache.block_size
        used = [self._tables[b][: (self.starts[b] + self.num_new[b] - 1) // bs + 1] for b in seqs]
        width = max(len(t) for t in used)
        return used, torch.tensor([t + [0] * (width - len(t)) for t in used], dtype=torch.int64)

    def _part_seqs(self, i: int) -> list[int]:
        """The sequences (indices into this step) whose rows part i holds, in the part's order."""
        part = self.parts[i]
        rows = part.index.tolist() if part.index is not None else list(range(part.start, part.stop))
        return [self.offsets.index(r) for r in rows]

    def decode_tables(self, layer: int, i: int):
        """PackedReads.decode_tables: "decodes" part i's block tables and key counts (made once per
        step, shared by the layers) beside this layer's pool planes (fp32, or 16-bit: the kernel reads
        them as stored); None for an int8 pool."""
        cache = self.cache
        if cache.kv_dtype == "int8" or cache.window is not None:  # a window: the read plan (it starts at the window)
            return None
        key = ("decode tables", i)
        memo = self.mask_memo.get(key)
        if memo is None:
            seqs = self._part_seqs(i)
            tables = self._block_tables(seqs)[1]
            memo = self.mask_memo[key] = (tables, torch.tensor([self.starts[b] + 1 for b in seqs], dtype=torch.int64))
        Hkv, D = cache.num_kv_heads, cache.head_dim
        k, v = (x.view(Hkv, -1, D) for x in cache._layer_kv[layer])  # (Hkv, num_blocks * block_size, D)
        return k, v, memo[0], memo[1], cache.block_size

    # ------------------------------------------------------------------ layers
    def layer(self, i: int) -> "PackedLayerStep":
        if not 0 <= i < self.cache.num_layers:
            raise IndexError(f"layer {i} out of range: this cache has num_layers={self.cache.num_layers}")
        return PackedLayerStep(self, i)

    def positions(self, num_new: int) -> Tensor:  # single-layer caches: the step is the layer
        return self._only().positions(num_new)

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None) -> PagedRead:
        return self._only().update(k, v, num_new)

    def _only(self) -> "PackedLayerStep":
        if self.cache.num_layers != 1:
            raise TypeError(f"this cache has num_layers={self.cache.num_layers}; pass step.layer(i) to layer i")
        return self.layer(0)

    def claim_stack(self, rows: int, num_layers: int) -> tuple | None:
        """PackedLayerStep.claim_decode for every layer at once (a decode step's layers in one
        kernel call, models/layer_step.py): (parts, rows) with parts.layers per layer (K, V, head
        stride, key stride), the same object step after step, and rows (run starts, new keys) or
        (None, new keys, block tables, block size), the same for every layer. None where a
        layer's claim_decode would refuse, or the model's layers are not the cache's."""
        cache = self.cache
        claim = self.decode_rows(rows)
        if claim is None or num_layers != cache.num_layers:
            return None
        parts = cache.stack_memo
        if parts is None or parts.cache_layers is not cache._layer_kv:
            entries = [
                (*planes, k.stride(0), k.stride(2)) for planes, (k, _) in zip(cache._layer_planes, cache._layer_kv)
            ]
            parts = cache.stack_memo = StackParts(None, cache._layer_kv, entries)
        self._written.update(range(num_layers))
        if not self.defer_prefix:
            self.commit()
        return parts, claim

    def decode_rows(self, rows: int) -> tuple | None:
        """For a step in which every sequence adds one token to an fp32 (or int8) cache (rows of
        them), or an `as_rows` step (each token a row of its sequence), what every layer's one-call
        decode reads, built once per step: (run starts in elements, new keys) per row where every
        table is one run, else (None, new keys, tables (rows, width) int64, block size). None
        otherwise (prefill chunks, not fp32)."""
        cache = self.cache
        if rows != self.N or cache.dtype is not torch.float32 or (self.N != self.B and not self.as_rows):
            return None
        # A windowed group's tables hold the null block before the window: the decode stack reads
        # a windowed layer's keys from pos - W + 1 on (the layer's plan carries its window)
        claim = self._decode_rows
        if claim is None:
            bs, pos = cache.block_size, self._positions[0].to("cpu", torch.int64)  # (N,) each row's new key
            used, table = self._block_tables(list(range(self.B)))
            per_row = torch.tensor(self.num_new) if self.N != self.B else None  # a sequence's rows share its table
            if all(t[i + 1] == t[i] + 1 for t in used for i in range(len(t) - 1)):
                runs = torch.tensor([t[0] * bs for t in used], dtype=torch.int64) * cache.head_dim
                claim = (runs if per_row is None else runs.repeat_interleave(per_row)), pos
            else:
                claim = None, pos, (table if per_row is None else table.repeat_interleave(per_row, dim=0)), bs
            self._decode_rows = claim
        return claim

    def _mark_written(self, layer: int) -> None:
        self._written.add(layer)
        if not self.defer_prefix:
            self.commit()

    def commit(self) -> int:
        """Make the full blocks this step wrote findable by prefix, once every layer has written
        (a step abandoned half way registers nothing). Blocks freed meanwhile (an aborted
        sequence) are skipped. Returns how many blocks were registered."""
        if self.cache.journal is not None:
            self.cache.journal("commit")
        if len(self._written) < self.cache.num_layers or not self._pending:
            return 0
        pool, done = self.cache.pool, 0
        for block, key in self._pending:
            if pool.refcount(block) > 0:
                done += pool.register(block, key)
        self._pending = []
        return done


class PackedLayerStep:
    """Layer i's view of a packed step; implements `LayerKVCache` with B = 1, T = N."""

    def __init__(self, step: PackedStep, layer: int):
        self.step, self.layer_index = step, layer

    def positions(self, num_new: int) -> Tensor:
        """(1, N) absolute positions of the packed tokens, each in its own sequence."""
        if num_new != self.step.N:
            raise ValueError(
                f"positions({num_new}) but this packed step holds N={self.step.N} tokens "
                f"(num_new={self.step.num_new} for {self.step.seq_ids})"
            )
        return self.step._positions

    def update(self, k: Tensor, v: Tensor, num_new: Tensor | None = None) -> PagedRead:
        """Write k, v (1, Hkv, N, D) into each token's reserved slot; return the read."""
        step, cache = self.step, self.step.cache
        want = (1, cache.num_kv_heads, step.N, cache.head_dim)
        if num_new is not None:
            raise ValueError(
                "a packed step has no padding: call the model without attention_mask "
                "(each sequence's tokens are delimited by the step itself)"
            )
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or tuple(x.shape) != want:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(
                    f"{name} must be (1, Hkv, N, D) = {want} for this packed step of "
                    f"{step.B} sequences (num_new={step.num_new}), got {got}"
                )
            if x.dtype != cache.dtype:
                raise TypeError(
                    f"{name} has dtype {x.dtype} but this cache holds {cache.dtype}; "
                    f"build the cache with dtype={x.dtype} or cast the model"
                )
        cache._write(self.layer_index, step._slots, None, k, v)
        step._mark_written(self.layer_index)
        return PagedRead(step, self.layer_index)

    def claim_decode(self, rows: int):
        """contiguous.ContiguousLayerCache.claim_decode for a step in which every sequence adds one
        token: K, V of this layer (Hkv, num_blocks, block_size, D) and, where every sequence holds
        its blocks as one run (a sequence decoded alone always does: the pool hands it the next
        block), each row's run start and new key; else each row's block table (blocks wherever
        they lie: a pool fragmented by finished requests, prefix blocks shared with another
        sequence). The kernel writes each new key into the slot this step reserved (the table's,
        as the general route's `_slots`). An int8 pool's K and V are (int8, scales) pairs. None
        otherwise (prefill chunks, not fp32)."""
        step = self.step
        claim = step.decode_rows(rows)  # the same for every layer of the step
        if claim is None:
            return None
        k = step.cache._layer_kv[self.layer_index][0]  # (Hkv, NB, bs, D)
        planes = step.cache._layer_planes[self.layer_index]
        step._mark_written(self.layer_index)
        return (*planes, (*claim[:2], k.stride(0), k.stride(2), *claim[2:]))
