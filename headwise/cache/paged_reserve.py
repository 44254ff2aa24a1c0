"""How a paged cache reserves a step's slots: blocks needed, copy-on-write, prefix hashes, and
for a windowed cache (`window` W) the blocks that fell out of the window going back to the pool.

A base class of `PagedKVCache` (paged.py), which owns the sequences (`_Seq`: block table,
length, prefix hashes) and the pool.

Windowed layers (Mistral's sliding window, Gemma's local layers) read only the W keys ending at
each query, so once every query to come sits at position >= L (a sequence of length L), the
blocks wholly before L - W + 1 are never read again: they are released (a block some other
table shares stays with it) and their table entries point at `null_block`, a block the hybrid
cache holds forever and never writes, so that a table still maps position p to entry p // bs
(vLLM's hybrid KV cache manager does the same with its null block). Read plans start at the
window (paged_step.py), so the null block is read only as padding that the window masks.
"""

from __future__ import annotations

from .block_pool import CacheFull, prefix_key


class Reservations:
    """The reservation half of `PagedKVCache`: see the module docstring."""

    window: int | None = None  # keys each query of this cache's layers sees; None = every key
    null_block: int | None = None  # what a dropped table entry holds (a windowed cache's)
    prefix_root = None  # the parent of a chain's first block: None, or a hybrid cache group's own

    # ------------------------------------------------------------------ the window
    def _droppable(self, seq, L: int) -> range:
        """Table entries of `seq` that no query at a position >= L reads (empty when not windowed)."""
        if self.window is None:
            return range(0)
        upto = min(max(0, L - self.window + 1) // self.block_size, len(seq.blocks))
        return range(seq.dropped, upto)

    def _drop(self, seq, L: int) -> None:
        """Release the blocks of `seq` out of every window at positions >= L."""
        gone = self._droppable(seq, L)
        for j in gone:
            self.pool.release(seq.blocks[j])
            seq.blocks[j] = self.null_block
        if gone:
            seq.dropped = gone.stop

    def drop_out_of_window(self, seq_ids) -> None:
        """After a step: release what the sequences' next queries cannot see (unknown ids skipped:
        a sequence freed meanwhile)."""
        if self.window is None:
            return
        for s in seq_ids:
            seq = self._seqs.get(s)
            if seq is not None:
                self._drop(seq, seq.length)

    def held_blocks(self, seq_id) -> list[int]:
        """The blocks `seq_id` holds (its table without the dropped entries)."""
        seq = self._seq(seq_id)
        return seq.blocks[seq.dropped :]

    # ------------------------------------------------------------------ counting
    def _needed(self, seqs, counts: list[int]) -> int:
        """Blocks a batch takes: new blocks past each table, plus one copy per shared partial
        last block that gets written (counted once per writer but the last, as they resolve),
        less, per sequence, the blocks its step drops out of the window that become free."""
        bs, extra, needed = self.block_size, {}, 0
        for seq, n in zip(seqs, counts):
            if n == 0:
                continue
            need = max(0, -(-(seq.length + n) // bs) - len(seq.blocks))
            if seq.length % bs:
                last = seq.blocks[-1]
                refs = self.pool.refcount(last) + extra.get(last, 0)
                if refs > 1:
                    need += 1
                    extra[last] = extra.get(last, 0) - 1
            if self.window is not None:
                need -= sum(self.pool.refcount(seq.blocks[j]) == 1 for j in self._droppable(seq, seq.length))
            needed += max(0, need)
        return needed

    # ------------------------------------------------------------------ a step's reservation
    def _reserve(self, seq_ids, num_new, token_ids, what: str):
        """Check a step, then reserve its slots (all or nothing) and advance the lengths.
        -> (seq_ids, block tables, starts, counts, pending prefix registrations)."""
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise ValueError(f"{what} needs at least one sequence id")
        if len(set(seq_ids)) != len(seq_ids):
            dup = sorted({repr(s) for s in seq_ids if seq_ids.count(s) > 1})
            raise ValueError(f"sequence ids must be distinct within a batch; repeated: {', '.join(dup)}")
        seqs = [self._seq(s) for s in seq_ids]
        B = len(seqs)
        counts = [num_new] * B if isinstance(num_new, int) else list(num_new)
        if len(counts) != B:
            raise ValueError(f"num_new has {len(counts)} entries for {B} sequences")
        counts = [self._count(n, s) for n, s in zip(counts, seq_ids)]
        if max(counts) == 0:
            raise ValueError("num_new is 0 for every sequence: nothing to compute")
        if what == "packed" and min(counts) == 0:
            idle = [s for s, n in zip(seq_ids, counts) if n == 0]
            raise ValueError(
                f"a packed step computes at least one token per sequence; num_new is 0 for {idle}: "
                f"leave those sequences out"
            )
        if token_ids is not None:
            token_ids = list(token_ids)
            if len(token_ids) != B:
                raise ValueError(f"token_ids has {len(token_ids)} entries for {B} sequences")
            for s, n, toks in zip(seq_ids, counts, token_ids):
                if toks is not None and len(toks) != n:
                    raise ValueError(f"token_ids for sequence {s!r} has {len(toks)} ids but num_new is {n}")
        needed = self._needed(seqs, counts)
        if needed > self.pool.num_free:
            raise CacheFull(
                needed,
                self.pool.num_free,
                f"appending {counts} tokens to {seq_ids}",
                self.block_size,
                self.pool.num_blocks,
            )

        # Past this point nothing can fail. Blocks out of the window go back first (what the
        # count above took off), then reserve blocks, copy shared partial blocks, advance.
        if self.window is not None:
            for seq, n in zip(seqs, counts):
                if n:
                    self._drop(seq, seq.length)
        bs, starts, pending = self.block_size, [], []
        for b, (seq, n) in enumerate(zip(seqs, counts)):
            starts.append(seq.length)
            if n == 0:
                continue
            if seq.length % bs and self.pool.refcount(seq.blocks[-1]) > 1:  # copy-on-write
                old = seq.blocks[-1]
                new = self.pool.allocate(1, prefer=seq.blocks[-2] if len(seq.blocks) > 1 else None, spread=self.spread)[
                    0
                ]
                for plane in (*self._k, *self._v):
                    plane[:, :, new].copy_(plane[:, :, old])
                self.pool.release(old)
                seq.blocks[-1] = new
            grow = -(-(seq.length + n) // bs) - len(seq.blocks)
            if grow > 0:
                seq.blocks += self.pool.allocate(
                    grow, prefer=seq.blocks[-1] if seq.blocks else None, spread=self.spread, region=self.region_blocks
                )
            seq.length += n
            toks = token_ids[b] if token_ids is not None else None
            if toks is None or not seq.hashable:
                seq.hashable, seq.partial = False, []
                continue
            seq.partial += [int(t) for t in toks]
            while len(seq.partial) >= bs:
                i = len(seq.hashes)
                key = prefix_key(seq.hashes[-1] if seq.hashes else self.prefix_root, seq.partial[:bs])
                pending.append((seq.blocks[i], key))
                seq.hashes.append(hash(key))
                seq.partial = seq.partial[bs:]
        return seq_ids, [s.blocks for s in seqs], starts, counts, pending
