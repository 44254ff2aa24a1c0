"""A paged KV cache for models whose layers differ in window (Gemma 2/3's local and global
layers): one block pool, one block table per group of layers (vLLM's hybrid KV cache manager).

    cache = HybridPagedKVCache(num_layers, Hkv, D, num_blocks, windows=cfg.windows)
    step = cache.packed(["a"], [len(prompt)], [prompt])       # as PagedKVCache
    logits = model(input_ids, step)                            # layer i gets its group's table

The layers are split into groups of g layers that share a window, g = the gcd of the counts of
layers per window (Gemma 3 270M: 3 global and 15 local layers, so 6 groups of 3: one global,
five local). Every group is a `PagedKVCache` of g layers over the same pool and the same K/V
planes, (g, Hkv, num_blocks, block_size, D): a block belongs to one group's table at a time,
and holds that group's g layers for block_size tokens. A global group's tables grow with the
sequence; a windowed group's release the blocks that fall out of its window (paged_reserve.py),
so Gemma 3's local layers hold <= 512 tokens + one block each whatever the context, and the
pool, sized in blocks of g layers, holds ~L / (global layers) more tokens of context.

Counting: `blocks_needed` and `CacheFull` are over all groups (a decode at a block boundary of
a windowed group frees one block and takes one), so the scheduler's arithmetic is unchanged.

Prefix caching: each group registers its full blocks under its own chain (a root per group), so
a prompt seen before shares a group's blocks while that group still holds or caches them; the
hit is the shortest over the groups. A windowed group releases its old blocks to the pool's
cached list, findable until the pool reuses them; once one is reused, that group's chain (and
so the hit) stops there, and the tokens after it are recomputed: never wrong, less reuse.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import torch

from ..attention.step import Step
from .block_pool import BlockPool, CacheFull
from .paged import PagedKVCache
from .store import check_windows


def layer_groups(windows: Sequence[int | None]) -> list[tuple[int | None, list[int]]]:
    """Layers split into groups of equal size that share a window: [(window, layer ids)], the
    group size being the gcd of the number of layers per window, layers in order within each."""
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    g = math.gcd(*(len(ids) for ids in by_window.values()))
    return [(w, ids[a : a + g]) for w, ids in by_window.items() for a in range(0, len(ids), g)]


class HybridPagedKVCache:
    """K/V for layers of different windows over one pool of `num_blocks` blocks; see the module
    docstring. The PagedKVCache arguments mean what they mean there; `windows` gives each layer's
    window (None = global)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device=None,
        kv_dtype=None,
        *,
        windows: Sequence[int | None],
        **kwargs,
    ):
        self.windows = check_windows(windows, num_layers)
        groups = layer_groups(self.windows)
        g = len(groups[0][1])
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 for a hybrid cache (one is its null block), got {num_blocks}")
        self.pool = BlockPool(num_blocks, block_size)
        self.null_block = self.pool.allocate(1)[0]  # held forever, never written: dropped entries point here
        self.groups: list[PagedKVCache] = []
        for k, (w, _) in enumerate(groups):
            storage = self.groups[0] if self.groups else None
            # a windowed group's tables drop blocks at once: no fixed-stride regions for them
            kw = kwargs if w is None else {**kwargs, "region_blocks": None}
            cache = PagedKVCache(
                g, num_kv_heads, head_dim, num_blocks, block_size, dtype, device, kv_dtype, pool=self.pool,
                storage=storage, window=w, **kw,
            )  # fmt: skip
            cache.null_block = self.null_block
            cache.prefix_root = None if k == 0 else hash(("hybrid group", k))  # each group its own chain
            self.groups.append(cache)
        self.group_layers = [ids for _, ids in groups]
        self.where = [(0, 0)] * num_layers  # layer i -> (group, its index in the group's planes)
        for k, ids in enumerate(self.group_layers):
            for j, i in enumerate(ids):
                self.where[i] = (k, j)
        first = self.groups[0]
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device, self.kv_dtype = block_size, first.dtype, first.device, first.kv_dtype

    @property
    def journal(self):
        return None

    @journal.setter
    def journal(self, value) -> None:  # tensor parallelism's followers replay a PagedKVCache's calls
        if value is not None:
            raise NotImplementedError(
                "tensor parallelism over a hybrid pool (layers of different windows) is not supported yet: "
                "its followers replay one PagedKVCache's calls"
            )

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> int:
        """PagedKVCache.add_sequence in every group; the prefix hit is the shortest of theirs (the
        groups that found more give the rest back)."""
        if seq_id in self:
            raise ValueError(f"sequence {seq_id!r} already exists; free it first or pick a new id")
        hits = [c.add_sequence(seq_id, token_ids) for c in self.groups]
        hit = min(hits)
        for c, h in zip(self.groups, hits):
            if h > hit:
                seq, keep = c._seq(seq_id), hit // self.block_size
                for b in reversed(seq.blocks[keep:]):
                    c.pool.release(b)
                seq.blocks, seq.hashes, seq.length = seq.blocks[:keep], seq.hashes[:keep], hit
        return hit

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> None:
        if new_seq_id in self:
            raise ValueError(f"cannot fork {seq_id!r} into {new_seq_id!r}: that sequence already exists")
        for c in self.groups:
            c.fork(seq_id, new_seq_id)

    def free(self, seq_id: Hashable) -> None:
        for c in self.groups:
            c.free(seq_id)

    def blocks_needed(self, seq_id: Hashable, num_new: int) -> int:
        """Free blocks that appending `num_new` tokens takes, over every group."""
        return sum(c.blocks_needed(seq_id, num_new) for c in self.groups)

    def can_allocate(self, seq_id: Hashable, num_new: int) -> bool:
        return self.blocks_needed(seq_id, num_new) <= self.pool.num_free

    def length(self, seq_id: Hashable) -> int:
        return self.groups[0].length(seq_id)

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Group `group`'s table of the sequence (a windowed group's dropped entries: the null block)."""
        return self.groups[group].block_table(seq_id)

    def held_blocks(self, seq_id: Hashable, group: int = 0) -> list[int]:
        return self.groups[group].held_blocks(seq_id)

    def seq_ids(self) -> list[Hashable]:
        return self.groups[0].seq_ids()

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.groups[0]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def memory_bytes(self) -> int:
        """Bytes of K/V storage (one set of planes, shared by the groups)."""
        return self.groups[0].memory_bytes()

    def read_sequence(self, seq_id: Hashable, layer: int = 0):
        """PagedKVCache.read_sequence of layer `layer` (a windowed layer's dropped keys read as zeros)."""
        k, j = self.where[layer]
        return self.groups[k].read_sequence(seq_id, j)

    def check(self) -> None:
        """The pool's invariants, with every group's tables (their held blocks) and the null block."""
        tables = [c.held_blocks(s) for c in self.groups for s in c.seq_ids()] + [[self.null_block]]
        self.pool.check(tables)

    # ------------------------------------------------------------------ a step
    def _check_fits(self, seq_ids, num_new) -> None:
        ids = list(seq_ids)
        counts = [num_new] * len(ids) if isinstance(num_new, int) else list(num_new)
        if (
            len(counts) != len(ids)
            or any(s not in self for s in ids)
            or any(type(n) is not int or n < 0 for n in counts)
        ):
            return  # the first group's reservation names the problem
        needed = sum(c._needed([c._seq(s) for s in ids], counts) for c in self.groups)
        if needed > self.pool.num_free:
            raise CacheFull(
                needed, self.pool.num_free, f"appending {counts} tokens to {ids}", self.block_size, self.num_blocks
            )

    def batch(self, seq_ids, num_new=1, token_ids=None, *, logits_indices=None) -> "HybridStep":
        """PagedKVCache.batch over every group (all or nothing: CacheFull before any change)."""
        self._check_fits(seq_ids, num_new)
        steps = [c.batch(seq_ids, num_new, token_ids, logits_indices=logits_indices) for c in self.groups]
        return HybridStep(self, steps)

    def packed(
        self, seq_ids, num_new, token_ids=None, *, defer_prefix=False, logits_indices=None, as_rows=False
    ) -> "HybridStep":
        """PagedKVCache.packed over every group (all or nothing: CacheFull before any change)."""
        self._check_fits(seq_ids, num_new)
        kw = dict(defer_prefix=defer_prefix, logits_indices=logits_indices, as_rows=as_rows)
        steps = [c.packed(seq_ids, num_new, token_ids, **kw) for c in self.groups]
        return HybridStep(self, steps)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{len(ids)} layers {'global' if w is None else f'window {w}'}" for w, ids in self._kinds())
        return (
            f"HybridPagedKVCache(num_layers={self.num_layers}, groups={len(self.groups)} ({kinds}), "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, dtype={self.dtype}, kv_dtype={self.kv_dtype}, "
            f"free_blocks={self.num_free_blocks})"
        )

    def _kinds(self):
        out: dict = {}
        for c, ids in zip(self.groups, self.group_layers):
            out.setdefault(c.window, []).extend(ids)
        return out.items()


class HybridStep(Step):
    """One model step over a hybrid cache: each group's step (a PagedStep or PackedStep over its
    tables), and `layer(i)` the one of layer i's group. Positions, logits_indices and the RoPE
    rows are the first group's (every group's step is over the same tokens)."""

    def __init__(self, cache: HybridPagedKVCache, steps: list):
        self.cache, self.steps = cache, steps
        first = steps[0]
        self.seq_ids = first.seq_ids
        self.logits_indices, self.max_position = first.logits_indices, getattr(first, "max_position", None)
        self.num_real = getattr(first, "num_real", None)

    @property
    def input_positions(self):
        return self.steps[0].input_positions

    def layer(self, i: int):
        if not 0 <= i < self.cache.num_layers:
            raise IndexError(f"layer {i} out of range: this cache has num_layers={self.cache.num_layers}")
        k, j = self.cache.where[i]
        return self.steps[k].layer(j)

    def commit(self) -> int:
        """Every group's commit (packed steps: the prefix registrations), then each windowed group
        releases the blocks its sequences' next queries cannot see."""
        done = sum(s.commit() for s in self.steps if hasattr(s, "commit"))
        for c in self.cache.groups:
            c.drop_out_of_window(self.seq_ids)
        return done
