"""SlidingWindowCache through MultiHeadAttention against the full pass with a window mask.

The oracle is the same layer with no cache over the whole sequence, with a bool
band mask built here (query i sees keys j with i - W < j <= i), i.e. what
`attend(..., is_causal=True, window=W)` computes.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import MultiHeadAttention
from headwise.cache import SlidingWindowCache

C, T_FULL = 32, 12
HEADS = [(4, 4), (4, 2), (4, 1)]


def err(a, b):
    return (a - b).abs().max().item()


def band(T, W):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & (i - j < W)  # (T, T) True = may attend


def windowed(m, x, W):
    return m(x, attn_mask=band(x.shape[1], W))


def chunks_from_cuts(cuts, T):
    bounds = [0, *sorted(cuts), T]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def run_chunks(m, x, cache, chunks):
    outs, t = [], 0
    for n in chunks:
        outs.append(m(x[:, t : t + n], is_causal=True, cache=cache))
        t += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
@pytest.mark.parametrize("H,Hkv", HEADS, ids=["mha", "gqa", "mqa"])
@settings(max_examples=25)
@given(cuts=st.sets(st.integers(1, T_FULL - 1)), W=st.sampled_from([1, 3, 5, 16]))
def test_any_split_equals_full_windowed_pass(H, Hkv, rope, cuts, W):
    """Chunks longer than W included: a chunk evicts keys its own first queries need."""
    torch.manual_seed(0)
    m = MultiHeadAttention(C, H, Hkv, rope=rope).eval()
    x = torch.randn(2, T_FULL, C)
    cache = SlidingWindowCache(1, 2, Hkv, W, m.head_dim)
    with torch.no_grad():
        got = run_chunks(m, x, cache, chunks_from_cuts(cuts, T_FULL))
        assert err(got, windowed(m, x, W)) <= 1e-5
    assert cache.lengths.tolist() == [T_FULL, T_FULL]


@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
@pytest.mark.parametrize("H,Hkv", HEADS, ids=["mha", "gqa", "mqa"])
@settings(max_examples=15)
@given(data=st.data(), W=st.sampled_from([2, 4, 16]))
def test_ragged_padded_batch_equals_each_sequence_alone(H, Hkv, rope, data, W):
    torch.manual_seed(0)
    lengths = [data.draw(st.integers(1, 10)) for _ in range(3)]
    chunks = [chunks_from_cuts(data.draw(st.sets(st.integers(1, L - 1))) if L > 1 else [], L) for L in lengths]
    m = MultiHeadAttention(C, H, Hkv, rope=rope).eval()
    xs = [torch.randn(L, C) for L in lengths]
    cache = SlidingWindowCache(1, 3, Hkv, W, m.head_dim)
    outs, done = [[], [], []], [0, 0, 0]
    with torch.no_grad():
        for i in range(max(len(c) for c in chunks)):
            n = [c[i] if i < len(c) else 0 for c in chunks]
            x = torch.randn(3, max(n), C) * 3  # junk padding
            for b in range(3):
                x[b, : n[b]] = xs[b][done[b] : done[b] + n[b]]
            kpm = torch.arange(max(n))[None, :] >= torch.tensor(n)[:, None]
            y = m(x, is_causal=True, key_padding_mask=kpm, cache=cache)
            for b in range(3):
                outs[b].append(y[b, : n[b]])
                done[b] += n[b]
        for b in range(3):
            assert err(torch.cat(outs[b]), windowed(m, xs[b][None], W)[0]) <= 1e-5, f"sequence {b}"
    assert cache.lengths.tolist() == lengths


def test_long_decode_memory_stays_bounded_by_the_window():
    torch.manual_seed(0)
    W = 4
    m = MultiHeadAttention(C, 4, 2, rope=True).eval()
    x = torch.randn(1, 40, C)
    cache = SlidingWindowCache(2, 1, 2, W, 8)
    before = cache.memory_bytes()
    assert before == 2 * 2 * 1 * 2 * W * 8 * 4  # K+V, layers, B, Hkv, W, D, fp32
    with torch.no_grad():
        got = torch.cat(
            [m(x[:, :3], is_causal=True, cache=cache.layer(0))]
            + [m(x[:, t : t + 1], is_causal=True, cache=cache.layer(0)) for t in range(3, 40)],
            dim=1,
        )
        assert err(got, windowed(m, x, W)) <= 1e-5
    assert cache.memory_bytes() == before
    assert cache.layer(0).positions(2).tolist() == [[40, 41]]  # positions keep growing past W


def test_decode_with_a_full_ring_reads_the_buffer_in_place_without_masks():
    cache = SlidingWindowCache(1, 2, 1, 3, 4)
    cache.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))
    read = cache.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)).read
    assert read.attn_mask is None and read.k.data_ptr() == cache.layer(0).store.k[0].data_ptr()


def test_reorder_and_reset():
    torch.manual_seed(0)
    m = MultiHeadAttention(C, 4, 2).eval()
    x, nxt = torch.randn(2, 7, C), torch.randn(2, 1, C)
    cache = SlidingWindowCache(1, 2, 2, 3, 8)
    with torch.no_grad():
        m(x, is_causal=True, cache=cache)
        cache.reorder([1, 0])
        got = m(nxt, is_causal=True, cache=cache)
        ref = windowed(m, torch.cat([x.flip(0), nxt], dim=1), 3)[:, -1:]
        assert err(got, ref) <= 1e-5
        cache.reset()
        assert err(m(x, is_causal=True, cache=cache), windowed(m, x, 3)) <= 1e-5


def test_int8_ring_stays_close_to_fp32():
    torch.manual_seed(0)
    m = MultiHeadAttention(C, 4, 2, rope=True).eval()
    x = torch.randn(2, 20, C)
    cache = SlidingWindowCache(1, 2, 2, 6, 8, kv_dtype="int8")
    with torch.no_grad():
        got = run_chunks(m, x, cache, [8] + [1] * 12)
        ref = windowed(m, x, 6)
    assert err(got, ref) <= 2e-2 * ref.abs().max().item()
    assert cache.memory_bytes() == 2 * 2 * 2 * 6 * (8 + 4)


def test_bad_input():
    cache = SlidingWindowCache(1, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="k has 3 KV heads but this cache holds num_kv_heads=2"):
        cache.update(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))
    with pytest.raises(TypeError, match="k has dtype torch.float64 but this cache holds torch.float32"):
        cache.update(torch.randn(2, 2, 1, 8).double(), torch.randn(2, 2, 1, 8))
    with pytest.raises(ValueError, match="k has batch 1 but this cache was built for batch_size=2"):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    with pytest.raises(ValueError, match="cache sizes must be positive ints, got window=0"):
        SlidingWindowCache(1, 1, 1, 0, 8)
    m = MultiHeadAttention(C, 4, 4, alibi=True).eval()
    with pytest.raises(ValueError, match="ALiBi needs keys in position order"):
        m(torch.randn(2, 3, C), is_causal=True, cache=SlidingWindowCache(1, 2, 4, 4, 8))
