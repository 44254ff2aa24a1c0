"""BlockPool bookkeeping, and the paged cache's block invariants under random use.

The stateful test drives `PagedKVCache` with random add / append / fork / free
sequences and checks, after every step, against its own model of what each
sequence holds: the K/V stored for every token is a function of the token
prefix up to it, so a block wrongly shared, overwritten or reused shows up as
a wrong value, and a prefix hit must read exactly what recomputing would write.
"""

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from headwise.cache.block_pool import BlockPool, CacheFull, prefix_key
from headwise.cache.paged import PagedKVCache


# ------------------------------------------------------------------ BlockPool alone
def test_allocate_release_and_counts():
    pool = BlockPool(6, block_size=4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 3 and pool.num_used == 3
    assert [pool.refcount(b) for b in a] == [1, 1, 1]
    pool.share(1)
    assert pool.refcount(1) == 2
    pool.release(1)
    pool.release(1)
    assert pool.is_free(1) and pool.num_free == 4
    with pytest.raises(ValueError, match="block 1 is already free"):
        pool.release(1)
    with pytest.raises(ValueError, match="block id 9 is out of range.*num_blocks=6"):
        pool.refcount(9)


def test_allocation_fails_cleanly_naming_the_numbers():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(CacheFull, match=r"needs 2 new blocks but only 1 are free") as e:
        pool.allocate(2)
    assert (e.value.needed, e.value.free) == (2, 1)
    assert pool.num_free == 1  # nothing was taken


def test_prefer_continues_a_run():
    pool = BlockPool(8)
    pool.allocate(1)  # 0
    other = pool.allocate(1)  # 1
    assert pool.allocate(2, prefer=other[0]) == [2, 3]
    pool.release(2)
    assert pool.allocate(1, prefer=1) == [2]  # the block after 1 is free again


def test_prefix_blocks_stay_cached_after_free_and_are_evicted_last():
    pool = BlockPool(3, block_size=2)
    b = pool.allocate(1)[0]
    key = prefix_key(None, [7, 8])
    assert pool.register(b, key) and pool.lookup(key) == b
    assert not pool.register(pool.allocate(1)[0], key)  # same prefix computed twice: first one kept
    pool.release(b)
    assert pool.lookup(key) == b and pool.num_cached_free == 1 and pool.num_free == 2
    pool.share(b)  # a prefix hit revives it
    assert pool.refcount(b) == 1 and pool.num_free == 1
    pool.release(b)
    plain = pool.allocate(1)[0]  # plain free blocks go first...
    assert plain != b and pool.lookup(key) == b
    assert pool.allocate(1) == [b]  # ...then the cached one, losing its key
    assert pool.lookup(key) is None and pool.key_of(b) is None


def test_register_needs_a_held_block():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 0 is free"):
        pool.register(0, prefix_key(None, [1]))
    with pytest.raises(ValueError, match="holds no cached prefix"):
        pool.share(1)


# ------------------------------------------------------------------ the stateful test
BS, NUM_BLOCKS = 4, 12
VOCAB = st.integers(0, 1)  # two tokens: prefixes repeat often
SYSTEM = [[], [0, 1, 1, 0, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0]]  # shared prompt starts: prefix hits
PROMPTS = st.builds(lambda head, tail: head + tail, st.sampled_from(SYSTEM), st.lists(VOCAB, max_size=6))


def kv_of(tokens, p):
    """What the 'model' writes for position p of a sequence: a function of tokens[:p+1]."""
    h = float(hash(tuple(tokens[: p + 1])) % 100003)
    return [h, float(p)], [h + 0.5, -float(p)]


class PagedCacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(1, 1, 2, NUM_BLOCKS, block_size=BS)
        self.tokens = {}  # seq id -> every token it holds (the model)
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _snapshot(self):
        return (
            {s: self.cache.block_table(s) for s in self.tokens},
            self.cache.num_free_blocks,
            {s: self.cache.read_sequence(s) for s in self.tokens},
        )

    def _append(self, ids, new_tokens, with_ids):
        """One step: reserve, then write K/V computed from the model. Returns False on CacheFull."""
        counts = [len(t) for t in new_tokens]
        before = self._snapshot()
        try:
            step = self.cache.batch(ids, counts, [list(t) for t in new_tokens] if with_ids else None)
        except CacheFull as e:
            event("CacheFull")
            assert e.needed > e.free == self.cache.num_free_blocks
            after = self._snapshot()
            assert after[:2] == before[:2]
            assert all(torch.equal(a, b) for s in before[2] for a, b in zip(before[2][s], after[2][s]))
            return False
        if any(a != b for s in ids for a, b in zip(before[0][s], self.cache.block_table(s))):
            event("copy-on-write")
        T = max(counts)
        k = torch.zeros(len(ids), 1, T, 2)
        v = torch.zeros(len(ids), 1, T, 2)
        for b, (s, new) in enumerate(zip(ids, new_tokens)):
            full = self.tokens[s] + list(new)
            for t in range(len(new)):
                kk, vv = kv_of(full, len(self.tokens[s]) + t)
                k[b, 0, t], v[b, 0, t] = torch.tensor(kk), torch.tensor(vv)
        step.update(k, v, torch.tensor(counts))
        for s, new in zip(ids, new_tokens):
            self.tokens[s] = self.tokens[s] + list(new)
        return True

    @initialize(target=seqs, prompt=PROMPTS)
    def first(self, prompt):
        return self.add(prompt, True)

    @rule(target=seqs, prompt=PROMPTS, use_prefix=st.booleans())
    def add(self, prompt, use_prefix):
        s = self._new_id()
        n = self.cache.add_sequence(s, prompt if use_prefix else None)
        assert n % BS == 0 and (n == 0 or n <= len(prompt) - 1)
        assert n == 0 or use_prefix
        if n:
            event("prefix hit")
        self.tokens[s] = list(prompt[:n])
        if len(prompt) > n:
            self._append([s], [prompt[n:]], with_ids=True)
        return s

    @rule(data=st.data())
    def append(self, data):
        live = sorted(self.tokens)
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        new = [data.draw(st.lists(VOCAB, max_size=6)) for _ in ids]
        if not any(new):
            new[0] = [0]
        self._append(ids, new, with_ids=data.draw(st.booleans()))

    @rule(target=seqs, src=seqs)
    def fork(self, src):
        if src not in self.tokens:
            return src
        s = self._new_id()
        self.cache.fork(src, s)
        self.tokens[s] = list(self.tokens[src])
        return s

    @rule(target=seqs, src=seqs, data=st.data())
    def fork_then_append(self, src, data):
        """Parallel sampling: the fork and its parent each take different tokens next."""
        s = self.fork(src)
        if s != src:
            who = data.draw(st.sampled_from([[s], [src], [s, src]]))
            self._append(
                who,
                [data.draw(st.lists(VOCAB, min_size=1, max_size=5)) for _ in who],
                with_ids=data.draw(st.booleans()),
            )
        return s

    @rule(s=consumes(seqs))
    def free(self, s):
        if s in self.tokens:
            self.cache.free(s)
            del self.tokens[s]

    @invariant()
    def blocks_are_accounted_for(self):
        pool, tables = self.cache.pool, {s: self.cache.block_table(s) for s in self.tokens}
        held = {}
        for t in tables.values():
            assert len(set(t)) == len(t)
            for b in t:
                held[b] = held.get(b, 0) + 1
        for b in range(NUM_BLOCKS):
            assert pool.refcount(b) == held.get(b, 0), f"block {b}"  # refcount == tables holding it
        assert self.cache.num_free_blocks + len(held) == NUM_BLOCKS  # no block leaked
        for s, t in tables.items():
            assert self.cache.length(s) == len(self.tokens[s])
            assert len(t) == -(-len(self.tokens[s]) // BS)

    @invariant()
    def every_sequence_reads_what_it_wrote(self):
        # A block shared by two sequences is legitimate only if both read the right values
        # from it (copy-on-write kept them apart); a prefix hit must equal recomputation.
        for s, toks in self.tokens.items():
            k, v = self.cache.read_sequence(s)
            want = [kv_of(toks, p) for p in range(len(toks))]
            assert k.shape == (1, len(toks), 2)
            assert k[0].tolist() == [w[0] for w in want], f"sequence {s} keys"
            assert v[0].tolist() == [w[1] for w in want], f"sequence {s} values"


PagedCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestPagedCacheMachine = PagedCacheMachine.TestCase
