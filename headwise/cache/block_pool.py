"""The bookkeeping under a paged KV cache: a free list, reference counts and a prefix table.

A pool hands out block ids; what a block holds (K/V for every layer) lives in
`PagedKVCache`. One pool serves all layers: a sequence's block table is the same
in each layer (vLLM, Kwon et al. 2023, "PagedAttention").

- Reference counts: a block's count is the number of block tables that contain it.
  Forks (parallel sampling, beam search) and prefix hits share blocks by raising
  the count; a block is written only while its count is 1 (copy-on-write).
- Prefix table: a *full* block is registered under the key
  (hash of the previous block's key, tuple of its token ids), so the hash of block i
  chains over every token before it: h_i = hash((h_{i-1}, tuple(tokens_i))). The
  dict compares whole keys, so two blocks collide only if their parents' 64-bit
  chain hashes do.
- Cached blocks survive freeing: a block whose count drops to 0 but that carries
  a key stays findable in the prefix table (vLLM's approach) until the pool needs
  it for something else. Plain free blocks are handed out first and cached ones
  least-recently-freed first, so a popular prompt stays cached as long as
  possible. Either kind counts as free: free + referenced == total, always.
- Lowest ids first: a new run takes the lowest plain free block, so blocks that were used
  before are reused before untouched ones (the cache's storage becomes resident as blocks are
  first written: paged_store.py), and `on_first_use` hears of each block handed out for the
  first time.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Iterable

PrefixKey = tuple  # (parent chain hash | None, tuple of block_size token ids)


class CacheFull(RuntimeError):
    """Not enough free blocks for a request; nothing was changed.

    Attributes: needed, free (blocks), and what asked (a short description).
    """

    def __init__(
        self,
        needed: int,
        free: int,
        what: str = "the request",
        block_size: int | None = None,
        num_blocks: int | None = None,
    ):
        self.needed, self.free, self.what = needed, free, what
        pool = f" (pool of {num_blocks} blocks x {block_size} tokens)" if num_blocks is not None else ""
        super().__init__(
            f"KV cache full: {what} needs {needed} new blocks but only {free} are free{pool}; "
            f"free or preempt a sequence, or build the cache with more num_blocks"
        )


def prefix_key(parent_hash: int | None, tokens: Iterable[int]) -> PrefixKey:
    """The prefix-table key of a full block; hash(key) is the chain hash its children use."""
    return (parent_hash, tuple(int(t) for t in tokens))


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens: free lists, ref counts, prefix table."""

    def __init__(self, num_blocks: int, block_size: int = 16):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._ref = [0] * num_blocks
        # Two free lists, both insertion-ordered (popped from the front): blocks with no
        # prefix key, handed out first, and blocks still findable by prefix (LRU order).
        self._free_plain: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, PrefixKey] = {}  # block -> its prefix key (live or cached)
        self._block_of: dict[PrefixKey, int] = {}  # prefix key -> block
        self._lowest = list(range(num_blocks))  # a heap of plain free ids (entries may be stale: checked on pop)
        self._seen = bytearray(num_blocks)  # 1: handed out at least once
        # called with the blocks an allocate hands out for the first time (the storage zeroes them)
        self.on_first_use: Callable[[list[int]], None] | None = None

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (plain free + cached free)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a findable prefix."""
        return len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def is_free(self, block: int) -> bool:
        self._check_id(block)
        return self._ref[block] == 0

    def free_blocks(self) -> list[int]:
        return [*self._free_plain, *self._free_cached]

    # ------------------------------------------------------------------ allocate / share / release
    def allocate(
        self,
        n: int = 1,
        prefer: int | None = None,
        what: str = "the request",
        spread: bool = False,
        region: int | None = None,
    ) -> list[int]:
        """Take `n` blocks (count 1 each), or raise `CacheFull` having taken none.

        prefer: try to continue a run after this block id (prefer+1, prefer+2, ...)
        so that a growing sequence gets consecutive blocks, which the paged read
        can use as one view instead of gathering them.
        spread: a run that cannot continue (or a new one) starts in the middle of the
        largest stretch of plain free blocks (at its start if nothing precedes it), not
        at the first free block: sequences placed so, then growing a block at a time,
        keep room behind them and stay consecutive while the pool has space.
        region: a new run (prefer None) starts at block r * region of the lowest-numbered
        region [r * region, (r + 1) * region) that is wholly plain free, if there is one:
        sequences then sit at a fixed stride, and a read can see many as one strided view.
        """
        if n > self.num_free:
            raise CacheFull(n, self.num_free, what, self.block_size, self.num_blocks)
        out = []
        start = self._free_region(region) if region and prefer is None else None
        if start is not None:
            prefer = start - 1
        for _ in range(n):
            b = self._take(None if prefer is None else prefer + 1, spread)
            self._ref[b] = 1
            out.append(b)
            prefer = b
        first = [b for b in out if not self._seen[b]]
        if first:
            for b in first:
                self._seen[b] = 1
            if self.on_first_use is not None:
                self.on_first_use(first)
        return out

    def _take(self, want: int | None, spread: bool = False) -> int:
        if want is not None and want in self._free_plain:
            del self._free_plain[want]
            return want
        if spread and self._free_plain:
            b = self._middle_of_largest_gap()
            del self._free_plain[b]
            return b
        if self._free_plain:
            while self._lowest[0] not in self._free_plain:  # a stale entry: taken another way
                heapq.heappop(self._lowest)
            b = heapq.heappop(self._lowest)
            del self._free_plain[b]
            return b
        b = self._free_cached.popitem(last=False)[0]  # evict the least recently freed prefix
        del self._block_of[self._key_of.pop(b)]
        return b

    def _free_region(self, size: int) -> int | None:
        """First block of the lowest region of `size` blocks that is wholly plain free. O(num_blocks),
        once per new sequence."""
        free = self._free_plain
        for r in range(self.num_blocks // size):
            if all(b in free for b in range(r * size, (r + 1) * size)):
                return r * size
        return None

    def _middle_of_largest_gap(self) -> int:
        """O(free log free): called only when a run starts, not per block of a growing run."""
        free = sorted(self._free_plain)
        best, best_len, start = free[0], 0, free[0]
        for prev, cur in zip(free, free[1:] + [None]):
            if cur != prev + 1:  # a stretch [start, prev] ends here
                if prev - start + 1 > best_len:
                    best, best_len = start, prev - start + 1
                start = cur
        return best if best == 0 else best + best_len // 2

    def share(self, block: int) -> None:
        """One more block table holds `block` (fork or prefix hit); revives a cached free block."""
        self._check_id(block)
        if self._ref[block] == 0:
            if block not in self._free_cached:
                raise ValueError(f"block {block} is free and holds no cached prefix; allocate it instead")
            del self._free_cached[block]
        self._ref[block] += 1

    def release(self, block: int) -> None:
        """One block table let go of `block`; at count 0 it becomes free (cached if it has a key)."""
        self._check_id(block)
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is already free (double free)")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._key_of:
                self._free_cached[block] = None
            else:
                self._plain_free(block)

    def _plain_free(self, block: int) -> None:
        self._free_plain[block] = None
        if len(self._lowest) > 4 * self.num_blocks:  # mostly stale entries: rebuild
            self._lowest = list(self._free_plain)
            heapq.heapify(self._lowest)
        else:
            heapq.heappush(self._lowest, block)

    # ------------------------------------------------------------------ prefix table
    def lookup(self, key: PrefixKey) -> int | None:
        """The block registered under `key`, live or cached-free, or None."""
        return self._block_of.get(key)

    def register(self, block: int, key: PrefixKey) -> bool:
        """Make full, written `block` findable under `key`. False (and no change) when the
        key already has a block (the same prefix computed twice) or the block has a key."""
        self._check_id(block)
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is free; only blocks a sequence holds can be registered")
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def forget(self, block: int) -> None:
        """Make `block` unfindable by prefix (its holder is about to overwrite it); no-op without a key."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            if block in self._free_cached:
                del self._free_cached[block]
                self._plain_free(block)

    def key_of(self, block: int) -> PrefixKey | None:
        return self._key_of.get(block)

    def clear_prefix_cache(self) -> None:
        """Forget every cached-free prefix (their blocks become plain free); live keys stay."""
        for b in list(self._free_cached):
            del self._block_of[self._key_of.pop(b)]
            self._plain_free(b)
        self._free_cached.clear()

    # ------------------------------------------------------------------ checks
    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is out of range: this pool has num_blocks={self.num_blocks}")

    def check(self, tables: Iterable[list[int]] | None = None) -> None:
        """Assert the pool's invariants (for tests and debugging); with `tables`, also that
        each block's count equals the number of tables holding it."""
        free = set(self._free_plain) | set(self._free_cached)
        assert not set(self._free_plain) & set(self._free_cached), "a block is in both free lists"
        for b in range(self.num_blocks):
            assert (self._ref[b] == 0) == (b in free), f"block {b}: refcount {self._ref[b]}, free={b in free}"
        assert all(b in self._key_of for b in self._free_cached), "a cached free block has no key"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "prefix table out of sync"
        assert len(self._block_of) == len(self._key_of)
        if tables is not None:
            held = [0] * self.num_blocks
            for t in tables:
                assert len(set(t)) == len(t), f"a block table holds a block twice: {t}"
                for b in t:
                    held[b] += 1
            assert held == self._ref, "refcounts differ from the number of tables holding each block"

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, free={self.num_free}, "
            f"cached_free={self.num_cached_free})"
        )
