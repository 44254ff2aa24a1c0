"""The paged cache with per-layer windows (HybridPagedKVCache): one pool, one block table per
group of layers, windowed groups giving back the blocks that fall out of their window.

Reads are checked against `attend(..., backend="math", is_causal=True, window=W)` over each
layer's whole K/V kept here; the bookkeeping against the pool's own invariants (`check`) and
the block counts the windows allow.
"""

import pytest
import torch

from headwise import attend
from headwise.cache import CacheFull, HybridPagedKVCache
from headwise.cache.hybrid import layer_groups

H, Hkv, D, BS = 4, 2, 8, 4
WINDOWS = [None, 6, 6, None, 6, 6]  # 2 global, 4 windowed: 3 groups of 2


def test_layer_groups_have_one_size_and_window():
    assert layer_groups(WINDOWS) == [(None, [0, 3]), (6, [1, 2]), (6, [4, 5])]
    gemma3 = ((512,) * 5 + (None,)) * 3
    groups = layer_groups(gemma3)
    assert [len(ids) for _, ids in groups] == [3] * 6
    assert [w for w, _ in groups].count(None) == 1
    assert layer_groups([None] * 4) == [(None, [0, 1, 2, 3])]


class Driver:
    """Random K/V per layer and token, fed through a cache's steps; keeps every layer's whole
    K/V per sequence for the oracle."""

    def __init__(self, cache, windows, seed=0):
        self.cache, self.windows = cache, windows
        self.g = torch.Generator().manual_seed(seed)
        self.full: dict = {}

    def step(self, seq_ids, counts, packed=True, token_ids=None):
        cache, g = self.cache, self.g
        if packed:
            step = cache.packed(seq_ids, counts, token_ids)
            N = sum(counts)
            q = torch.randn(1, H, N, D, generator=g)
        else:
            step = cache.batch(seq_ids, counts, token_ids)
            T = max(counts)
            q = torch.randn(len(seq_ids), H, T, D, generator=g)
        worst = 0.0
        for i, W in enumerate(self.windows):
            shape = (1, Hkv, sum(counts), D) if packed else (len(seq_ids), Hkv, max(counts), D)
            k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
            out = step.layer(i).update(k, v).attend(q, is_causal=True, window=W)
            off = 0
            for b, (s, n) in enumerate(zip(seq_ids, counts)):
                if packed:
                    kn, vn, qn, on = (x[:, :, off : off + n] for x in (k, v, q, out))
                else:
                    kn, vn, qn, on = (x[b : b + 1, :, :n] for x in (k, v, q, out))
                off += n
                K, V = self.full.get((s, i), (kn[:, :, :0], vn[:, :, :0]))
                K, V = torch.cat([K, kn], 2), torch.cat([V, vn], 2)
                self.full[s, i] = (K, V)
                ref = attend(qn, K, V, is_causal=True, window=W, backend="math")
                worst = max(worst, (on - ref).abs().max().item())
        if hasattr(step, "commit"):
            step.commit()
        return worst


def held(cache, s):
    return [len(cache.held_blocks(s, k)) for k in range(len(cache.groups))]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "batch"])
def test_reads_match_the_math_backend_and_windows_hold_few_blocks(packed):
    cache = HybridPagedKVCache(len(WINDOWS), Hkv, D, 64, BS, windows=WINDOWS)
    drv = Driver(cache, WINDOWS)
    cache.add_sequence("a")
    cache.add_sequence("b")
    assert drv.step(["a", "b"], [9, 3], packed) <= 1e-5  # a chunk longer than the window
    for t in range(30):
        assert drv.step(["a", "b"], [1, 2 if t % 7 == 0 else 1], packed) <= 1e-5
        cache.check()
        for s in ("a", "b"):
            L = cache.length(s)
            # a global group holds every block; a windowed one only the blocks its next
            # queries see: positions [L - W + 1, L), at most ceil((W - 1) / BS) + 1 blocks
            assert held(cache, s)[0] == -(-L // BS)
            assert max(held(cache, s)[1:]) <= -(-(6 - 1) // BS) + 1
    free = cache.num_free_blocks
    cache.free("a")
    cache.free("b")
    cache.check()
    assert cache.num_free_blocks == cache.num_blocks - 1 > free  # all back but the null block


def test_a_windowed_sequence_decodes_forever_in_a_pool_of_its_window():
    """A window of 4 keys in blocks of 4: a sequence of any length holds at most 2 blocks (the
    positions L - 3 .. L - 1 and the block its next token starts), so a pool of the null block
    and 2 more decodes it without end; the count the scheduler reads never exceeds what is free."""
    cache = HybridPagedKVCache(2, Hkv, D, 3, BS, windows=[4, 4])  # one windowed group
    cache.add_sequence("a")
    drv = Driver(cache, [4, 4])
    assert drv.step(["a"], [8]) <= 1e-5
    for _ in range(40):
        assert cache.blocks_needed("a", 1) <= cache.num_free_blocks
        assert drv.step(["a"], [1]) <= 1e-5
        cache.check()
        assert len(cache.held_blocks("a")) <= 2
    table = cache.block_table("a")
    assert len(table) == -(-48 // BS) and table[:-2] == [cache.null_block] * (len(table) - 2)


def test_cache_full_changes_nothing_in_any_group():
    cache = HybridPagedKVCache(len(WINDOWS), Hkv, D, 8, BS, windows=WINDOWS)
    cache.add_sequence("a")
    before = (cache.num_free_blocks, [cache.block_table("a", k) for k in range(3)])
    with pytest.raises(CacheFull):
        cache.packed(["a"], [12])  # 3 blocks in each of 3 groups: 9 > 7 free
    assert (cache.num_free_blocks, [cache.block_table("a", k) for k in range(3)]) == before
    assert cache.length("a") == 0
    cache.check()


def test_prefix_hits_share_every_group_and_read_right():
    """A prompt seen before: each group finds its chain; the hit is the shortest, and the
    continuation reads the shared K/V as the first sequence wrote it."""
    cache = HybridPagedKVCache(len(WINDOWS), Hkv, D, 64, BS, windows=WINDOWS)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks
    drv = Driver(cache, WINDOWS)
    cache.add_sequence("a")
    drv.step(["a"], [14], token_ids=[prompt])
    hit = cache.add_sequence("b", prompt)
    assert hit == 12
    for i in range(len(WINDOWS)):  # b's K/V so far are a's (the shared blocks), for the oracle
        K, V = drv.full["a", i]
        drv.full["b", i] = (K[:, :, :hit], V[:, :, :hit])
    assert drv.step(["b"], [2], token_ids=[prompt[hit:]]) <= 1e-5
    assert drv.step(["a", "b"], [1, 1]) <= 1e-5
    cache.check()


def test_a_windowed_groups_evicted_chain_shortens_the_hit():
    """Once a windowed group's dropped blocks are reused, its chain stops there: the hit is 0,
    never a block whose K/V are gone."""
    cache = HybridPagedKVCache(2, Hkv, D, 12, BS, windows=[None, 4])  # groups of 1: global, windowed
    prompt = list(range(20))
    drv = Driver(cache, [None, 4])
    cache.add_sequence("a")
    drv.step(["a"], [20], token_ids=[prompt])  # 5 full blocks per group; the windowed drops 0-3
    cache.free("a")  # every block cached, the windowed group's first ones least recently freed
    cache.add_sequence("c")
    drv.step(["c"], [8])  # 4 blocks: the one plain free block, then the windowed group's 0, 1, 2
    assert cache.groups[0].add_sequence("probe", prompt) == 16  # the global chain is still there
    cache.groups[0].free("probe")
    assert cache.add_sequence("b", prompt) == 0
    cache.check()
    cache.free("c")
    assert drv.step(["b"], [20]) <= 1e-5


def test_gemma3_4096_tokens_in_the_pool_hold_under_0_3x_all_global():
    """Issue 40 in the engine's pool: a 4,096-token Gemma 3 270M sequence (18 layers, 5 local
    512-key layers to 1 global, 1 KV head x 256, bf16), prefilled in 512-token chunks, holds the
    global group's 256 blocks and 32 per local group: (3 x 4096 + 15 x 512) / (18 x 4096) of the
    bytes all-global layers take. Bytes per block measured on the pool's planes (meta tensors)."""
    windows = ((512,) * 5 + (None,)) * 3
    cache = HybridPagedKVCache(18, 1, 256, 1300, 16, torch.bfloat16, "meta", windows=windows)
    cache.add_sequence("a")
    for _ in range(8):
        cache.packed(["a"], [512]).commit()  # (no layer writes: the bookkeeping alone)
    assert cache.length("a") == 4096
    held = [len(cache.held_blocks("a", k)) for k in range(len(cache.groups))]
    assert sorted(held) == [32] * 5 + [256]
    block_bytes = cache.memory_bytes() // cache.num_blocks  # 16 tokens x 3 layers
    assert block_bytes == 16 * 3 * 2 * 256 * 2
    all_global = 4096 * 18 * 2 * 256 * 2
    ratio = sum(held) * block_bytes / all_global
    assert ratio == pytest.approx((3 * 4096 + 15 * 512) / (18 * 4096))  # 0.2708
    assert ratio <= 0.3


def test_tensor_parallel_replay_is_refused_by_name():
    cache = HybridPagedKVCache(2, Hkv, D, 8, BS, windows=[None, 4])
    with pytest.raises(NotImplementedError, match="tensor parallelism over a hybrid pool"):
        cache.journal = lambda *a, **k: None
    assert cache.journal is None
