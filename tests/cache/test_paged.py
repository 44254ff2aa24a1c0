"""PagedKVCache through MultiHeadAttention against the full-sequence pass.

The oracle is the same layer with no cache (is_causal=True) over each whole
sequence: it shares nothing with the paged cache but the weights. Small blocks
(4 tokens) and small tiles (8 tokens) make every read cross blocks and tiles.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from headwise import MultiHeadAttention
from headwise.attention.functional import attend
from headwise.attention.backends import paged as paged_backend
from headwise.cache import paged_step
from headwise.cache.block_pool import CacheFull
from headwise.cache.protocol import LayerKVCache
from headwise.cache.paged import PagedKVCache

C, BS, TILE = 32, 4, 8
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
HEAD_IDS = ["MHA", "GQA", "MQA"]


def err(a, b):
    return (a - b).abs().max().item()


def layer(H=4, Hkv=2, rope=True, **kw):
    return MultiHeadAttention(C, H, Hkv, rope=rope, **kw).eval()


def cache_for(m, num_blocks=32, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("tile_tokens", TILE)
    return PagedKVCache(1, m.num_kv_heads, m.head_dim, num_blocks, **kw)


def full(m, x):
    with torch.no_grad():
        return m(x, is_causal=True)


def feed(m, cache, seq_id, x, chunks, fragment=None):
    """Feed x (1, T, C) to one sequence in consecutive chunks; outputs concatenated (1, T, C).
    fragment: a second sequence id that takes a block between chunks (non-consecutive tables)."""
    outs, t = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(m(x[:, t : t + n], is_causal=True, cache=cache.batch([seq_id], n)))
            t += n
            if fragment is not None:
                k = torch.zeros(1, m.num_kv_heads, BS, m.head_dim)
                cache.batch([fragment], BS).update(k, k)
    return torch.cat(outs, dim=1)


def chunks_from_cuts(cuts, T):
    bounds = [0, *sorted(cuts), T]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.fixture(params=["views", "gathers", "matmul"])
def read_path(request, monkeypatch):
    """How attention reads the blocks: as views of consecutive blocks, by gathered tiles
    (fragmented tables), or gathered with the matmul kernel used off CPU."""
    if request.param == "views":
        monkeypatch.setattr(paged_step, "MIN_VIEW_BLOCKS", 2)
    if request.param == "matmul":
        monkeypatch.setattr(paged_backend, "_CPU_FLASH", None)
    return request.param


# ------------------------------------------------------------------ equal to the full pass
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("H,Hkv", HEADS, ids=HEAD_IDS)
def test_token_by_token_decode_matches_full_pass(H, Hkv, rope, read_path):
    m = layer(H, Hkv, rope)
    x = torch.randn(1, 23, C)
    cache = cache_for(m)
    cache.add_sequence("s")
    frag = None
    if read_path != "views":
        cache.add_sequence(frag := "other")
    out = feed(m, cache, "s", x, [1] * 23, fragment=frag)
    assert err(out, full(m, x)) <= 1e-5
    segs = cache.batch(["s"]).groups[0].segments
    if read_path == "views":  # consecutive blocks: one view, no copy
        assert [s.index for s in segs] == [None]
    else:  # scattered blocks: tiles of TILE keys
        assert all(s.index is not None and s.k1 - s.k0 <= TILE for s in segs)


@settings(max_examples=25)
@given(heads=st.sampled_from(HEADS), T=st.integers(1, 30), data=st.data())
def test_chunked_prefill_any_split_matches_full_pass(heads, T, data):
    m = layer(*heads)
    x = torch.randn(1, T, C)
    chunks = chunks_from_cuts(data.draw(st.sets(st.integers(1, T - 1))) if T > 1 else [], T)
    cache = cache_for(m)
    cache.add_sequence(0)
    assert err(feed(m, cache, 0, x, chunks), full(m, x)) <= 1e-5


# A batch whose longest sequence fits one tile is read by one padded gather for all rows;
# longer ones sequence by sequence, each over exactly its own blocks.
BATCH_READS = pytest.mark.parametrize("tile", [TILE, 64], ids=["per-sequence", "one-padded-gather"])


@BATCH_READS
@pytest.mark.parametrize("H,Hkv", HEADS, ids=HEAD_IDS)
def test_sequences_of_different_lengths_decode_together(H, Hkv, tile):
    """Ragged prefill in one padded batch, then batched decode steps (sometimes of a subset):
    each sequence equals that sequence alone."""
    m = layer(H, Hkv)
    lengths, decode = [5, 13, 9], 4
    xs = [torch.randn(1, L + decode, C) for L in lengths]
    cache = cache_for(m, tile_tokens=tile)
    ids = ["a", "b", "c"]
    for s in ids:
        cache.add_sequence(s)
    outs = {s: [] for s in ids}
    with torch.no_grad():
        T = max(lengths)
        x = torch.zeros(3, T, C)
        pad = torch.ones(3, T, dtype=torch.bool)
        for b, L in enumerate(lengths):
            x[b, :L], pad[b, :L] = xs[b][0, :L], False
        y = m(x, is_causal=True, key_padding_mask=pad, cache=cache.batch(ids, lengths))
        for b, L in enumerate(lengths):
            outs[ids[b]].append(y[b : b + 1, :L])
        for i in range(decode):
            step_ids = ids if i != 1 else ["c", "a"]  # any subset, any order
            x = torch.cat([xs[ids.index(s)][:, lengths[ids.index(s)] + len(outs[s]) - 1] for s in step_ids])
            y = m(x[:, None], is_causal=True, cache=cache.batch(step_ids))
            for b, s in enumerate(step_ids):
                outs[s].append(y[b : b + 1])
        for s in ["b"]:  # b missed step 1: catch up alone
            outs[s].append(m(xs[1][:, -1:], is_causal=True, cache=cache.batch([s])))
    for b, s in enumerate(ids):
        assert err(torch.cat(outs[s], dim=1), full(m, xs[b])) <= 1e-5, s


def test_fork_copy_on_write_keeps_branches_apart():
    """Parallel sampling: a fork shares the prompt's blocks, including the partly filled last
    one; each branch then appends its own tokens and equals its own full pass."""
    m = layer(4, 2)
    prompt = torch.randn(1, 6, C)  # 6 tokens: the second block is partial
    branches = [torch.randn(1, 5, C) for _ in range(3)]
    cache = cache_for(m)
    cache.add_sequence(0)
    with torch.no_grad():
        p_out = m(prompt, is_causal=True, cache=cache.batch([0], 6))
        cache.fork(0, 1)
        cache.fork(0, 2)
        assert cache.block_table(1) == cache.block_table(0)
        assert cache.pool.refcount(cache.block_table(0)[-1]) == 3
        outs = [[], [], []]
        for t in range(5):
            x = torch.cat([br[:, t] for br in branches])[:, None]
            y = m(x, is_causal=True, cache=cache.batch([0, 1, 2]))
            for b in range(3):
                outs[b].append(y[b : b + 1])
    assert len({tuple(cache.block_table(s)) for s in range(3)}) == 3
    assert cache.block_table(0)[0] == cache.block_table(1)[0] == cache.block_table(2)[0]  # full block stays shared
    for b in range(3):
        x = torch.cat([prompt, branches[b]], dim=1)
        assert err(torch.cat([p_out, *outs[b]], dim=1), full(m, x)) <= 1e-5


@pytest.mark.parametrize("keep_first", [True, False], ids=["shared-live", "cached-after-free"])
def test_prefix_reuse_equals_recomputing(keep_first):
    """A second request with the same prompt prefix reuses its full blocks (live, or freed but
    still cached) and gets the outputs that recomputing the whole prompt gives."""
    m = layer(4, 2)
    emb = nn.Embedding(50, C)
    prompt = torch.randint(0, 50, (14,)).tolist()
    second = prompt[:11] + [3, 4, 5]  # shares 11 tokens: 2 full blocks of 4
    cache = cache_for(m)
    with torch.no_grad():
        assert cache.add_sequence("a", prompt) == 0
        x = emb(torch.tensor([prompt]))
        cache_a = cache.batch(["a"], len(prompt), [prompt])
        assert err(m(x, is_causal=True, cache=cache_a), full(m, x)) <= 1e-5
        if not keep_first:
            cache.free("a")
        n = cache.add_sequence("b", second)
        assert n == 8
        x2 = emb(torch.tensor([second]))
        y = m(x2[:, n:], is_causal=True, cache=cache.batch(["b"], len(second) - n, [second[n:]]))
        assert err(y, full(m, x2)[:, n:]) <= 1e-5
        y = m(emb(torch.tensor([[7]])), is_causal=True, cache=cache.batch(["b"], 1, [[7]]))
        assert err(y, full(m, emb(torch.tensor([second + [7]])))[:, -1:]) <= 1e-5
        # The whole prompt cached: the last token is still left to compute (its logits are needed).
        assert cache.add_sequence("c", second[:8]) == 4


def test_prefix_blocks_are_registered_only_after_every_layer_wrote():
    cache = PagedKVCache(2, 1, 2, 8, block_size=2)
    cache.add_sequence("a")
    step = cache.batch(["a"], 4, [[1, 2, 3, 4]])
    assert isinstance(step.layer(0), LayerKVCache)
    kv = torch.ones(1, 1, 4, 2)
    step.layer(0).update(kv, kv)
    cache.add_sequence("early", [1, 2, 3, 4, 5])
    assert cache.length("early") == 0  # layer 1 has not written yet
    step.layer(1).update(kv, kv)
    cache.add_sequence("late", [1, 2, 3, 4, 5])
    assert cache.length("late") == 4


# ------------------------------------------------------------------ int8
@pytest.mark.parametrize("H,Hkv", HEADS, ids=HEAD_IDS)
def test_int8_decode_within_bound(H, Hkv):
    """int8 K/V, per-(token, head) scales: within 2e-2 of the output's largest entry (measured
    ~3e-3); token-by-token equals one chunked prefill (the same tokens are quantized alike)."""
    m = layer(H, Hkv)
    x = torch.randn(1, 21, C)
    ref = full(m, x)
    c1, c2 = cache_for(m, kv_dtype="int8"), cache_for(m, kv_dtype="int8")
    c1.add_sequence(0), c2.add_sequence(0)
    by_token = feed(m, c1, 0, x, [1] * 21)
    by_chunk = feed(m, c2, 0, x, [9, 12])
    assert err(by_token, ref) <= 2e-2 * ref.abs().max().item()
    assert err(by_token, by_chunk) <= 1e-5
    assert c1.memory_bytes() / cache_for(m).memory_bytes() == pytest.approx((m.head_dim + 4) / (4 * m.head_dim))


# ------------------------------------------------------------------ exhaustion
def test_copy_on_write_is_counted_exactly():
    """Two sequences sharing a partial block, both appending: only the first writer copies,
    so one free block is enough; three writers need two."""
    cache = PagedKVCache(1, 1, 2, 3, block_size=4)
    cache.add_sequence(0)
    kv = torch.randn(1, 1, 6, 2)
    cache.batch([0], 6).update(kv, kv)  # 2 blocks, the second partial
    cache.fork(0, 1)
    assert cache.blocks_needed(0, 1) == 1 and cache.num_free_blocks == 1
    cache.fork(0, 2)
    with pytest.raises(CacheFull, match="needs 2 new blocks but only 1 are free"):
        cache.batch([0, 1, 2], 1)
    cache.free(2)
    one = torch.randn(2, 1, 1, 2)
    cache.batch([0, 1], 1).update(one, one)
    assert cache.num_free_blocks == 0 and cache.block_table(0)[-1] != cache.block_table(1)[-1]
    for s in (0, 1):
        k, _ = cache.read_sequence(s)
        assert torch.equal(k[0, :6], kv[0, 0]) and torch.equal(k[0, 6], one[s, 0, 0])


def test_cache_full_names_the_numbers_and_leaves_everyone_intact():
    m = layer(4, 2)
    xa, xb = torch.randn(1, 12, C), torch.randn(1, 10, C)
    cache = cache_for(m, num_blocks=6)
    cache.add_sequence("a"), cache.add_sequence("b")
    out_a = [feed(m, cache, "a", xa[:, :9], [9])]  # 3 blocks
    out_b = [feed(m, cache, "b", xb[:, :7], [7])]  # 2 blocks: 1 free left
    tables = {s: cache.block_table(s) for s in "ab"}
    before = {s: cache.read_sequence(s) for s in "ab"}
    cache.add_sequence("c")
    assert not cache.can_allocate("c", 8) and cache.can_allocate("c", 4)
    with pytest.raises(CacheFull, match=r"needs 2 new blocks but only 1 are free"):
        cache.batch(["c"], 8)
    with pytest.raises(CacheFull, match=r"needs 2 new blocks but only 1 are free"):
        cache.batch(["a", "b"], [4, 4])  # all or nothing: neither grows
    assert {s: cache.block_table(s) for s in "ab"} == tables
    assert [cache.length(s) for s in "abc"] == [9, 7, 0] and cache.num_free_blocks == 1
    for s in "ab":
        assert all(torch.equal(p, q) for p, q in zip(before[s], cache.read_sequence(s)))
    cache.free("c")
    out_a.append(feed(m, cache, "a", xa[:, 9:], [1, 1, 1]))  # fits in a's last block
    out_b.append(feed(m, cache, "b", xb[:, 7:], [1, 1, 1]))  # takes the free block
    assert err(torch.cat(out_a, 1), full(m, xa)) <= 1e-5
    assert err(torch.cat(out_b, 1), full(m, xb)) <= 1e-5
    with pytest.raises(CacheFull):
        cache.batch(["a"], 1)


# ------------------------------------------------------------------ attend options
@BATCH_READS
def test_alibi_uses_each_sequences_true_positions(tile):
    m = layer(4, 4, rope=False, alibi=True)
    xs = [torch.randn(1, 7, C), torch.randn(1, 11, C)]
    cache = cache_for(m, tile_tokens=tile)
    cache.add_sequence(0), cache.add_sequence(1)
    with torch.no_grad():
        x = torch.zeros(2, 10, C)
        x[0, :6], x[1, :10] = xs[0][0, :6], xs[1][0, :10]
        pad = torch.arange(10)[None] >= torch.tensor([[6], [10]])
        y = m(x, is_causal=True, key_padding_mask=pad, cache=cache.batch([0, 1], [6, 10]))
        z = m(torch.cat([xs[0][:, 6:7], xs[1][:, 10:11]]), is_causal=True, cache=cache.batch([0, 1]))
    assert err(torch.cat([y[0:1, :6], z[0:1]], 1), full(m, xs[0])) <= 1e-5
    assert err(torch.cat([y[1:2, :10], z[1:2]], 1), full(m, xs[1])) <= 1e-5


def test_pruned_layer_with_uneven_groups_reads_through_kv_map():
    m = layer(8, 4, rope=True)
    m.prune_heads([0, 2, 3])  # groups of 1 and 2: kv_map is set
    assert m.kv_map is not None
    x = torch.randn(1, 10, C)
    cache = cache_for(m)
    cache.add_sequence(0)
    assert err(feed(m, cache, 0, x, [4, 1, 1, 4]), full(m, x)) <= 1e-5


@BATCH_READS
def test_return_lse_scale_masks_and_reference_path(tile):
    """The tiled read against headwise.attend(backend='math') over the same keys."""
    torch.manual_seed(1)
    Hkv, H, D = 2, 4, 8
    cache = PagedKVCache(1, Hkv, D, 16, block_size=BS, tile_tokens=tile)
    cache.add_sequence(0), cache.add_sequence(1)
    k0, v0 = torch.randn(2, 1, Hkv, 9, D).unbind(0)
    cache.batch([0], 9).update(k0, v0)
    step = cache.batch([0, 1], [3, 5])
    k, v = torch.randn(2, 2, Hkv, 5, D).unbind(0)
    read = step.update(k, v, torch.tensor([3, 5]))
    assert len(step.groups) == (2 if tile == TILE else 1)
    q = torch.randn(2, H, 5, D)
    S = 12  # sequence 0 after the step; 1 has 5
    user = torch.rand(2, 1, 5, S) > 0.3
    user[1, 0, 0] = False  # a row that sees nothing: LSE -inf, output 0
    kpm = torch.zeros(2, S, dtype=torch.bool)
    kpm[0, 2] = True
    got = read.attend(q, is_causal=True, attn_mask=user, key_padding_mask=kpm, scale=0.3, return_lse=True)
    dense = [(torch.cat([k0[0], k[0, :, :3]], 1), torch.cat([v0[0], v[0, :, :3]], 1)), (k[1], v[1])]
    for b, (kb, vb) in enumerate(dense):
        L, n = [9, 0][b], [3, 5][b]
        Sb = L + n
        vis = torch.arange(Sb)[None] <= (L + torch.arange(n))[:, None]  # (n, Sb) causal
        vis = vis & user[b, 0, :n, :Sb] & ~kpm[b, :Sb]
        ref = attend(q[b : b + 1, :, :n], kb[None], vb[None], attn_mask=vis, scale=0.3, backend="math", return_lse=True)
        assert err(got.out[b : b + 1, :, :n], ref.out) <= 1e-5
        lse, ref_lse = got.lse[b : b + 1, :, :n], ref.lse  # -inf: rows that see nothing
        assert torch.equal(lse.isneginf(), ref_lse.isneginf())
        assert err(lse.nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0)) <= 1e-5
    assert got.lse[1, :, 0].isneginf().all() and not got.out[1, :, 0].any()
    math = read.attend(
        q, is_causal=True, attn_mask=user, key_padding_mask=kpm, scale=0.3, backend="math", need_weights=True
    )
    real = torch.tensor([[1] * 3 + [0] * 2, [1] * 5]).bool()[:, None, :, None]
    assert err(math.out * real, got.out * real) <= 1e-5
    assert math.weights.shape == (2, H, 5, S)


def test_need_weights_through_the_layer_uses_the_reference():
    m = layer(4, 2)
    x = torch.randn(1, 9, C)
    cache = cache_for(m)
    cache.add_sequence(0)
    feed(m, cache, 0, x[:, :8], [8])
    with torch.no_grad():
        out, w = m(x[:, 8:], is_causal=True, need_weights=True, cache=cache.batch([0]))
        ref, ref_w = m(x, is_causal=True, need_weights=True)
    assert err(out, ref[:, 8:]) <= 1e-5 and err(w, ref_w[:, :, 8:]) <= 1e-5


# ------------------------------------------------------------------ bad input
def test_bad_input_names_the_numbers_and_ids():
    cache = PagedKVCache(2, 2, 8, 16, block_size=4)
    cache.add_sequence("a")
    step = cache.batch(["a"], 3)
    good = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"k has 3 KV heads but this cache holds num_kv_heads=2"):
        step.layer(0).update(torch.randn(1, 3, 3, 8), good)
    with pytest.raises(ValueError, match=r"v has head dim 4 but this cache holds head_dim=8"):
        step.layer(0).update(good, torch.randn(1, 2, 3, 4))
    with pytest.raises(TypeError, match=r"k has dtype torch.float64 but this cache holds torch.float32"):
        step.layer(0).update(good.double(), good)
    with pytest.raises(ValueError, match=r"shape \(1, 2, 5, 8\) but this step is .* \(1, 2, 3, 8\)"):
        step.layer(0).update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match=r"num_new=\[2\] .* reserved num_new=\[3\]"):
        step.layer(0).update(good, good, torch.tensor([2]))
    with pytest.raises(ValueError, match=r"positions\(4\) but this step holds T=3"):
        step.layer(0).positions(4)
    with pytest.raises(IndexError, match=r"layer 2 out of range: this cache has num_layers=2"):
        step.layer(2)
    with pytest.raises(TypeError, match="num_layers=2; pass step.layer"):
        step.update(good, good)
    read = step.layer(0).update(good, good)
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="num_heads=3 .* not divisible by num_kv_heads=2"):
        read.attend(torch.randn(1, 3, 3, 8))
    with pytest.raises(ValueError, match="returns no weights: pass backend='math'"):
        read.attend(q, need_weights=True)
    with pytest.raises(ValueError, match="no dropout"):
        read.attend(q, dropout_p=0.1)
    with pytest.raises(ValueError, match="nope"):
        read.attend(q, backend="nope")
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(B, S\) = \(1, 3\)"):
        read.attend(q, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    for call in (
        lambda: cache.batch(["a", "zz"]),
        lambda: cache.fork("zz", "b"),
        lambda: cache.free("zz"),
        lambda: cache.length("zz"),
        lambda: cache.can_allocate("zz", 1),
    ):
        with pytest.raises(KeyError, match=r"unknown sequence id 'zz': the cache holds 1 sequence\(s\) \['a'\]"):
            call()
    with pytest.raises(ValueError, match="sequence 'a' already exists"):
        cache.add_sequence("a")
    with pytest.raises(ValueError, match="cannot fork 'a' into 'a'"):
        cache.fork("a", "a")
    with pytest.raises(ValueError, match="repeated: 'a'"):
        cache.batch(["a", "a"])
    with pytest.raises(ValueError, match="token_ids for sequence 'a' has 2 ids but num_new is 1"):
        cache.batch(["a"], 1, [[1, 2]])
    with pytest.raises(ValueError, match="num_new for sequence 'a' must be an int >= 0, got -1"):
        cache.batch(["a"], -1)
    with pytest.raises(TypeError, match="must be floating point"):
        PagedKVCache(1, 2, 8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        PagedKVCache(1, 2, 8, 0)
