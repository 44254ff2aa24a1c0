"""ContiguousKVCache through MultiHeadAttention against the full-sequence pass.

The oracle is the same layer with no cache (is_causal=True) over the whole
sequence, or, for ragged batches, over each sequence alone: it shares nothing
with the cache but the weights.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import MultiHeadAttention
from headwise.cache import CacheRead, ContiguousKVCache, kv_bytes_per_token
from headwise.core.config import ModelConfig
from headwise.core.plan import kv_bytes_per_token as planned_bytes

C, T_FULL = 32, 12
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


def err(a, b):
    return (a - b).abs().max().item()


def layer(H, Hkv, rope, **kw):
    return MultiHeadAttention(C, H, Hkv, rope=rope, **kw).eval()


def cache_for(m, B, T_max=16, **kw):
    return ContiguousKVCache(1, B, m.num_kv_heads, T_max, m.head_dim, **kw)


def run_chunks(m, x, cache, chunks):
    """Feed x (B, T, C) through the cache in consecutive chunks; outputs concatenated (B, T, C)."""
    outs, t = [], 0
    for n in chunks:
        outs.append(m(x[:, t : t + n], is_causal=True, cache=cache))
        t += n
    return torch.cat(outs, dim=1)


def chunks_from_cuts(cuts, T):
    bounds = [0, *sorted(cuts), T]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def ragged_schedule(draw, B=3, max_len=10):
    """Per-sequence lengths and a split of each into chunks; step i feeds every sequence
    its i-th chunk (or nothing), right-padded to the longest chunk of that step."""
    lengths = [draw(st.integers(1, max_len)) for _ in range(B)]
    chunks = [chunks_from_cuts(draw(st.sets(st.integers(1, L - 1))) if L > 1 else [], L) for L in lengths]
    return lengths, chunks


def run_ragged(m, xs, cache, chunks):
    """xs: per-sequence (L_b, C). Returns per-sequence outputs (L_b, C) from batched padded steps."""
    B = len(xs)
    outs, done = [[] for _ in range(B)], [0] * B
    for i in range(max(len(c) for c in chunks)):
        n = [c[i] if i < len(c) else 0 for c in chunks]
        T = max(n)
        x = torch.randn(B, T, C) * 3  # padding is junk, never zeros
        for b in range(B):
            x[b, : n[b]] = xs[b][done[b] : done[b] + n[b]]
        kpm = torch.arange(T)[None, :] >= torch.tensor(n)[:, None]  # (B, T) True = padding
        y = m(x, is_causal=True, key_padding_mask=kpm, cache=cache)
        for b in range(B):
            outs[b].append(y[b, : n[b]])
            done[b] += n[b]
    assert cache.lengths.tolist() == done
    return [torch.cat(o) for o in outs]


# ------------------------------------------------------------------ equal to the full pass
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
@pytest.mark.parametrize("H,Hkv", HEADS, ids=["mha", "gqa", "mqa"])
@settings(max_examples=20)
@given(cuts=st.sets(st.integers(1, T_FULL - 1)))
def test_any_split_equals_full_pass(H, Hkv, rope, static, cuts):
    """Chunked prefill at any split points (all points = token-by-token decoding)."""
    torch.manual_seed(0)
    m = layer(H, Hkv, rope)
    x = torch.randn(2, T_FULL, C)
    with torch.no_grad():
        full = m(x, is_causal=True)
        got = run_chunks(m, x, cache_for(m, 2, static=static), chunks_from_cuts(cuts, T_FULL))
    assert err(got, full) <= 1e-5


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
@pytest.mark.parametrize("H,Hkv", HEADS, ids=["mha", "gqa", "mqa"])
@settings(max_examples=20)
@given(schedule=ragged_schedule())
def test_ragged_padded_batch_equals_each_sequence_alone(H, Hkv, rope, static, schedule):
    """Sequences of different lengths in one batch, right-padded per step (key_padding_mask)."""
    torch.manual_seed(0)
    lengths, chunks = schedule
    m = layer(H, Hkv, rope)
    xs = [torch.randn(L, C) for L in lengths]
    with torch.no_grad():
        got = run_ragged(m, xs, cache_for(m, len(xs), static=static), chunks)
        for b, x in enumerate(xs):
            assert err(got[b], m(x[None], is_causal=True)[0]) <= 1e-5, f"sequence {b}"


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "math"])
def test_padded_prefill_then_decode_on_every_backend(backend):
    torch.manual_seed(0)
    m = layer(4, 2, True, backend=backend)
    lengths = [5, 2, 7]
    xs = [torch.randn(L + 4, C) for L in lengths]  # prompt, then 4 decode steps
    prompt = torch.zeros(3, 7, C)
    for b, L in enumerate(lengths):
        prompt[b, :L] = xs[b][:L]
    kpm = torch.arange(7)[None, :] >= torch.tensor(lengths)[:, None]
    cache = cache_for(m, 3)
    with torch.no_grad():
        y = m(prompt, is_causal=True, key_padding_mask=kpm, cache=cache)
        steps = [
            m(torch.stack([x[L + i] for x, L in zip(xs, lengths)])[:, None], is_causal=True, cache=cache)
            for i in range(4)
        ]
        for b, L in enumerate(lengths):
            got = torch.cat([y[b, :L], *[s[b] for s in steps]])
            assert err(got, m(xs[b][None], is_causal=True)[0]) <= 1e-5
    assert cache.lengths.tolist() == [9, 6, 11]


def test_layers_of_a_model_each_use_their_own_cache():
    torch.manual_seed(0)
    blocks = [layer(4, 2, True) for _ in range(3)]

    def model(x, cache=None):
        for i, blk in enumerate(blocks):
            x = x + blk(x, is_causal=True, cache=None if cache is None else cache.layer(i))
        return x

    x = torch.randn(2, 9, C)
    cache = ContiguousKVCache(3, 2, 2, 16, 8)
    with torch.no_grad():
        full = model(x)
        got = torch.cat([model(x[:, :4], cache)] + [model(x[:, t : t + 1], cache) for t in range(4, 9)], dim=1)
    assert err(got, full) <= 1e-5
    assert cache.lengths.tolist() == [9, 9]
    assert all(cache.layer(i).lengths.tolist() == [9, 9] for i in range(3))


# ------------------------------------------------------------------ how it stores and reads
def test_uniform_decode_writes_in_place_and_reads_a_view_without_masks():
    cache = ContiguousKVCache(1, 2, 2, 32, 8)
    kbuf = cache.layer(0).store.k[0]
    ptr = kbuf.data_ptr()
    read = cache.update(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    for _ in range(3):
        k = torch.randn(2, 2, 1, 8)
        read = cache.update(k, torch.randn(2, 2, 1, 8))
    assert isinstance(read, CacheRead)
    assert read.attn_mask is None and read.key_padding_mask is None
    assert read.k.shape == (2, 2, 8, 8) and read.k.data_ptr() == ptr == kbuf.data_ptr()  # a view, no copy
    assert torch.equal(read.k[:, :, -1:], k)
    assert torch.equal(cache.positions(2), torch.tensor([[8, 9], [8, 9]]))


def test_ragged_read_masks_each_sequence_causally():
    cache = ContiguousKVCache(1, 2, 1, 8, 4)
    cache.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), torch.tensor([3, 1]))
    assert torch.equal(cache.positions(2), torch.tensor([[3, 4], [1, 2]]))
    read = cache.update(torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4))
    assert read.k.shape == (2, 1, 5, 4)  # up to the longest sequence
    expected = torch.tensor(
        [
            [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],  # seq 0: positions 3, 4
            [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]],
        ]
    ).bool()  # seq 1: positions 1, 2
    assert torch.equal(read.attn_mask[:, 0], expected)


def test_static_reads_never_change_shape():
    cache = ContiguousKVCache(1, 2, 2, 10, 8, static=True)
    shapes = {tuple(cache.update(torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8)).k.shape) for T in (3, 1, 1)}
    assert shapes == {(2, 2, 10, 8)}


def test_memory_bytes_matches_the_planner():
    cfg = ModelConfig(
        "t", "llama", vocab_size=10, d_model=64, num_layers=3, num_heads=8, d_ff=64, max_positions=64, num_kv_heads=2
    )  # Hkv=2, D=8
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        cache = ContiguousKVCache(3, 4, 2, 16, 8, dtype=dtype)
        assert cache.memory_bytes() == 2 * 3 * 4 * 2 * 16 * 8 * torch.finfo(dtype).bits // 8
        assert cache.memory_bytes() == planned_bytes(cfg, name) * 4 * 16 == kv_bytes_per_token(cfg, dtype) * 4 * 16
        assert cache.bytes_per_token() == kv_bytes_per_token(cfg, name)


# ------------------------------------------------------------------ reset, trim, reorder
def test_trim_then_continue_equals_full_pass_over_the_kept_prefix():
    torch.manual_seed(0)
    m = layer(4, 2, True)
    x, other = torch.randn(2, 10, C), torch.randn(2, 3, C)
    cache = cache_for(m, 2)
    with torch.no_grad():
        m(x[:, :8], is_causal=True, cache=cache)
        cache.trim(5)  # e.g. rejected speculative tokens
        got = run_chunks(m, other, cache, [1, 2])
        ref = m(torch.cat([x[:, :5], other], dim=1), is_causal=True)[:, 5:]
    assert err(got, ref) <= 1e-5
    cache.trim([8, 3])
    assert cache.lengths.tolist() == [8, 3]


def test_reorder_copies_beams_and_reset_forgets():
    torch.manual_seed(0)
    m = layer(4, 2, True)
    x, nxt = torch.randn(2, 6, C), torch.randn(2, 1, C)
    cache = cache_for(m, 2)
    with torch.no_grad():
        m(x, is_causal=True, cache=cache)
        cache.reorder([1, 1])  # both beams continue from sequence 1
        got = m(nxt, is_causal=True, cache=cache)
        ref = m(torch.cat([x[1:].expand(2, -1, -1), nxt], dim=1), is_causal=True)[:, -1:]
        assert err(got, ref) <= 1e-5
        cache.reset()
        assert cache.lengths.tolist() == [0, 0]
        assert err(m(x, is_causal=True, cache=cache), m(x, is_causal=True)) <= 1e-5
        cache.reset([0])
        assert cache.lengths.tolist() == [0, 6]


# ------------------------------------------------------------------ bad input
def test_append_past_max_seq_len_names_the_sequence_and_numbers():
    cache = ContiguousKVCache(1, 2, 2, 16, 8)
    cache.update(torch.randn(2, 2, 14, 8), torch.randn(2, 2, 14, 8), torch.tensor([10, 14]))
    with pytest.raises(ValueError, match=r"^append of 5 tokens to sequence 1 at length 14 exceeds max_seq_len=16$"):
        cache.update(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    assert cache.lengths.tolist() == [10, 14]  # nothing was written
    cache.update(torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8))
    assert cache.lengths.tolist() == [12, 16]


def test_static_cache_overflow_is_caught_too():
    cache = ContiguousKVCache(1, 1, 1, 4, 8, static=True)
    cache.update(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="append of 1 tokens to sequence 0 at length 4 exceeds max_seq_len=4"):
        cache.update(torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))


def test_wrong_shapes_dtype_and_batch_name_the_numbers():
    cache = ContiguousKVCache(1, 2, 2, 16, 8)
    ok = torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match=r"k has 4 KV heads but this cache holds num_kv_heads=2"):
        cache.update(torch.randn(2, 4, 3, 8), ok)
    with pytest.raises(ValueError, match=r"v has batch 3 but this cache was built for batch_size=2"):
        cache.update(ok, torch.randn(3, 2, 3, 8))
    with pytest.raises(ValueError, match=r"k has head dim 16 but this cache holds head_dim=8"):
        cache.update(torch.randn(2, 2, 3, 16), ok)
    with pytest.raises(TypeError, match=r"k has dtype torch.float16 but this cache holds torch.float32"):
        cache.update(ok.half(), ok)
    with pytest.raises(ValueError, match=r"k must be \(B, Hkv, T, D\) = \(2, 2, T, 8\), got \(2, 3, 8\)"):
        cache.update(ok[0], ok)
    with pytest.raises(ValueError, match=r"k has 3 new tokens but v has 2"):
        cache.update(ok, ok[:, :, :2])
    with pytest.raises(ValueError, match=r"num_new\[1\]=4 is outside \[0, T=3\]"):
        cache.update(ok, ok, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"num_new must be \(B,\) = \(2,\)"):
        cache.update(ok, ok, torch.tensor([3]))
    assert cache.lengths.tolist() == [0, 0]


def test_through_the_layer_a_mismatched_cache_is_named():
    m = layer(4, 2, False)
    with pytest.raises(ValueError, match="k has 2 KV heads but this cache holds num_kv_heads=1"):
        m(torch.randn(2, 3, C), is_causal=True, cache=ContiguousKVCache(1, 2, 1, 16, 8))
    with pytest.raises(ValueError, match="k has batch 2 but this cache was built for batch_size=3"):
        m(torch.randn(2, 3, C), is_causal=True, cache=ContiguousKVCache(1, 3, 2, 16, 8))


def test_bad_bookkeeping_calls():
    cache = ContiguousKVCache(2, 2, 1, 8, 4)
    with pytest.raises(TypeError, match="this cache has num_layers=2; pass cache.layer"):
        cache.positions(1)
    with pytest.raises(IndexError, match="layer 2 out of range: this cache has num_layers=2"):
        cache.layer(2)
    with pytest.raises(ValueError, match="cannot trim sequence 0 to 3 tokens: it holds 0"):
        cache.trim(3)
    with pytest.raises(ValueError, match=r"reorder needs 2 row indices in \[0, 2\), got \[0, 2\]"):
        cache.reorder([0, 2])
    with pytest.raises(ValueError, match="cache sizes must be positive ints, got max_seq_len=0"):
        ContiguousKVCache(1, 1, 1, 0, 4)
    with pytest.raises(ValueError, match="kv_dtype must be None .* or 'int8', got 'fp8'"):
        ContiguousKVCache(1, 1, 1, 4, 4, kv_dtype="fp8")


# ------------------------------------------------------------------ torch.compile (slow: ~10-30 s)
def test_torch_compile_decode_step_matches_eager_and_compiles_once():
    """COMPILE TEST: one tiny layer; the first call compiles (10-30 s on 2 CPU cores).

    A static cache gives every decode step the same shapes, and its host-side length
    bookkeeping runs outside the graph, so later steps reuse the first compilation."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = layer(4, 2, True)
    x = torch.randn(2, 10, C)
    eager_cache, compiled_cache = cache_for(m, 2, static=True), cache_for(m, 2, static=True)
    step = torch.compile(lambda xt: m(xt, is_causal=True, cache=compiled_cache), fullgraph=False)
    with torch.no_grad():
        m(x[:, :4], is_causal=True, cache=eager_cache)
        m(x[:, :4], is_causal=True, cache=compiled_cache)
        got, ref = [], []
        for t in range(4, 10):
            got.append(step(x[:, t : t + 1]))
            ref.append(m(x[:, t : t + 1], is_causal=True, cache=eager_cache))
            if t == 4:
                graphs = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs, "a decode step recompiled"
    assert err(torch.cat(got, 1), torch.cat(ref, 1)) <= 1e-5
    assert err(torch.cat(got, 1), m(x, is_causal=True)[:, 4:]) <= 1e-5
    assert compiled_cache.lengths.tolist() == [10, 10]
