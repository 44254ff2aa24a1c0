"""headwise.kernels.attention.decode_attention against softmax(q k^T * scale + mask) v in float64 (plain torch)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise.kernels import attention as ka


def reference(q, k, v, lengths, scale):
    """(out, lse) in float64: sequence c sees keys [0, lengths[c]); no keys -> out 0, lse -inf."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # (C, Hkv, G, width)
    hidden = torch.arange(k.shape[2]) >= lengths[:, None]  # (C, width)
    s = s.masked_fill(hidden[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # (C, Hkv, G)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows without keys: 0, not NaN
    return p @ v.double(), lse


def pooled(C, Hkv, width, D, gen):
    """k, v as cache/packed.py region_views makes them: as_strided views (C, Hkv, width, D) of a
    pool (Hkv, NB, bs, D), sequence c's keys R blocks after sequence c-1's, K and V planes apart."""
    bs, R = 16, -(-width // 16) + 1  # one spare block per region: views must skip it
    NB = C * R + 3
    views = []
    for _ in range(2):
        plane = torch.randn(Hkv, NB, bs, D, generator=gen)
        views.append(plane.as_strided((C, Hkv, width, D), (R * bs * D, NB * bs * D, D, 1), 2 * bs * D))
    return views


def test_kernel_builds_and_runs_here():
    assert ka.decode_attention_unavailable() is None  # x86-64 + AVX2 + gcc, like small_linear


@pytest.mark.parametrize("G", [1, 3, 4, 16])
@pytest.mark.parametrize("D", [8, 24, 64, 128, 256])  # 24: the avx512 build's 16-wide loop, then an 8-wide tail
@pytest.mark.parametrize("width", [1, 7, 8, 37, 256])
def test_strided_views_equal_the_reference(G, D, width):
    gen = torch.Generator().manual_seed(G * 1000 + D + width)
    C, Hkv = 6, 3
    k, v = pooled(C, Hkv, width, D, gen)
    assert not k.is_contiguous()
    q = torch.randn(C, Hkv, G, D, generator=gen) * 2
    lengths = torch.randint(0, width + 1, (C,), generator=gen)
    lengths[0], lengths[1], lengths[2] = 0, width, 1  # no keys, all of them, one
    scale = 1 / math.sqrt(D)
    out, lse = ka.decode_attention(q, k, v, lengths, scale, want_lse=True)
    want, want_lse = reference(q, k, v, lengths, scale)
    assert out.shape == (C, Hkv, G, D) and lse.shape == (C, Hkv, G) and out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
    torch.testing.assert_close(lse[1:].double(), want_lse[1:], atol=2e-6, rtol=1e-6)


def test_large_scores_and_a_growing_max_stay_exact():
    """Scores that rise along the keys rescale the running sums every tile; scores of ~1e3 overflow exp
    unless the max is subtracted."""
    gen = torch.Generator().manual_seed(1)
    C, Hkv, G, D, width = 2, 1, 3, 64, 100
    q = torch.randn(C, Hkv, G, D, generator=gen)
    k = torch.randn(C, Hkv, width, D, generator=gen) * torch.linspace(0.1, 30, width)[:, None]
    v = torch.randn(C, Hkv, width, D, generator=gen)
    lengths = torch.tensor([width, 61])
    out, lse = ka.decode_attention(q, k, v, lengths, 1.0, want_lse=True)
    want, want_lse = reference(q, k, v, lengths, 1.0)
    assert want_lse.abs().max() > 100
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-6)


def test_without_lse_and_with_no_sequences():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*s, generator=gen) for s in ((4, 2, 3, 64), (4, 2, 40, 64), (4, 2, 40, 64)))
    lengths = torch.tensor([40, 3, 0, 17])
    out, lse = ka.decode_attention(q, k, v, lengths, 0.125)
    assert lse is None
    torch.testing.assert_close(out.double(), reference(q, k, v, lengths, 0.125)[0], atol=2e-6, rtol=1e-5)
    empty, _ = ka.decode_attention(q[:0], k[:0], v[:0], lengths[:0], 0.125, want_lse=True)
    assert empty.shape == (0, 2, 3, 64)


def test_same_bits_at_any_thread_count():
    """Each (sequence, KV head) pair is one thread's pass: the thread count cannot change a bit."""
    gen = torch.Generator().manual_seed(3)
    k, v = pooled(16, 3, 256, 64, gen)
    q = torch.randn(16, 3, 3, 64, generator=gen)
    lengths = torch.randint(0, 257, (16,), generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ka.decode_attention(q, k, v, lengths, 0.125, want_lse=True)
        torch.set_num_threads(2)
        two = ka.decode_attention(q, k, v, lengths, 0.125, want_lse=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_fits():
    assert ka.fits(3, 64) and ka.fits(16, 256) and ka.fits(1, 8)
    assert not (ka.fits(17, 64) or ka.fits(3, 60) or ka.fits(3, 264) or ka.fits(0, 64))


def _inputs(**over):
    a = dict(
        q=torch.randn(2, 3, 3, 64),
        k=torch.randn(2, 3, 10, 64),
        v=torch.randn(2, 3, 10, 64),
        lengths=torch.tensor([10, 4]),
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=torch.randn(2, 3, 3, 64, dtype=torch.float64)), "q must be a 4-D fp32"),
        (dict(k=torch.randn(2, 3, 10, 64).double()), "k must be a 4-D fp32, bf16 or fp16"),
        (dict(k=torch.randn(2, 3, 10, 64).half()), "k \\(torch.float16\\) and v \\(torch.float32\\) must share"),
        (dict(v=torch.randn(3, 10, 64)), "v must be a 4-D fp32"),
        (dict(q=torch.randn(2, 3, 64, 3).transpose(-1, -2)), "q .* must be contiguous"),
        (dict(q=torch.randn(2, 3, 17, 64)), "G=17 .* D=64 need 1 <= G <= 16"),
        (dict(q=torch.randn(2, 3, 3, 60), k=torch.randn(2, 3, 10, 60), v=torch.randn(2, 3, 10, 60)), "D % 8"),
        (dict(k=torch.randn(2, 3, 11, 64)), "must both be"),
        (dict(k=torch.randn(2, 1, 10, 64), v=torch.randn(2, 1, 10, 64)), "must both be"),
        (dict(k=torch.randn(2, 3, 64, 10).transpose(-1, -2)), "stride\\(-1\\) == 1"),
        (dict(lengths=torch.tensor([10, 4], dtype=torch.int32)), "lengths must be a contiguous int64"),
        (dict(lengths=torch.tensor([10])), "shape \\(2,\\)"),
        (dict(lengths=torch.tensor([11, 4])), "lengths must lie in \\[0, width=10\\]; got min 4, max 11"),
        (dict(lengths=torch.tensor([-1, 4])), "got min -1"),
    ],
)
def test_bad_input_is_refused(over, match):
    a = _inputs(**over)
    with pytest.raises(ValueError, match=match):
        ka.decode_attention(a["q"], a["k"], a["v"], a["lengths"], 0.125)


def paged_reference(q, k, v, tables, bs, lengths, scale):
    """Gather each sequence's keys through its table into a (C, Hkv, width, D) copy, then reference()."""
    C, width = tables.shape[0], tables.shape[1] * bs
    rows = (tables[:, :, None] * bs + torch.arange(bs)).reshape(C, width)  # (C, width) pool rows
    return reference(q, k[:, rows].transpose(0, 1), v[:, rows].transpose(0, 1), lengths, scale)


@settings(max_examples=60, deadline=None)
@given(
    G=st.sampled_from([1, 3, 4, 16]),
    Hkv=st.sampled_from([1, 2, 3]),
    D=st.sampled_from([8, 64, 128]),
    bs=st.sampled_from([1, 3, 8, 16, 5]),  # a whole number of 8-key tiles per block or not
    C=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_block_tables_read_scattered_blocks_like_the_reference(G, Hkv, D, bs, C, seed):
    """paged_decode_attention (the kernel's block-table addressing, used by the one-call decode layer
    over a fragmented pool): scattered, shared and repeated blocks, ragged lengths, GQA and MQA."""
    gen = torch.Generator().manual_seed(seed)
    NB, width = 40, int(torch.randint(1, 9, (1,), generator=gen))  # blocks in the pool, blocks per table
    k, v = (torch.randn(Hkv, NB * bs, D, generator=gen) for _ in range(2))
    tables = torch.randint(0, NB, (C, width), generator=gen)  # any blocks, in any order, shared
    lengths = torch.randint(0, width * bs + 1, (C,), generator=gen)
    q = torch.randn(C, Hkv, G, D, generator=gen)
    scale = 1 / math.sqrt(D)
    out, lse = ka.paged_decode_attention(q, k, v, tables, bs, lengths, scale, want_lse=True)
    want, want_lse = paged_reference(q, k, v, tables, bs, lengths, scale)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    seen = lengths > 0
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], atol=2e-6, rtol=1e-6)
    assert (out[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()


def test_block_tables_that_name_blocks_outside_the_pool_are_refused():
    k = v = torch.randn(2, 4 * 8, 16)
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="outside the pool's 4 blocks"):
        ka.paged_decode_attention(q, k, v, torch.tensor([[0, 4]]), 8, torch.tensor([9]), 0.25)
    with pytest.raises(ValueError, match="lengths must lie in"):
        ka.paged_decode_attention(q, k, v, torch.tensor([[0, 3]]), 8, torch.tensor([17]), 0.25)


@pytest.mark.parametrize("cap", [0.3, 2.0, 30.0])
def test_softcap_against_a_capped_softmax(cap):
    """softcap: each score c * tanh(s / c) before the softmax; sequences of their own lengths."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*s, generator=g) for s in ((3, 2, 4, 64), (3, 2, 29, 64), (3, 2, 29, 64)))
    lengths = torch.tensor([29, 9, 1])
    out, lse = ka.decode_attention(q * 3, k, v, lengths, 0.125, True, softcap=cap)
    s = cap * torch.tanh((q * 3).double() @ k.double().transpose(-1, -2) * 0.125 / cap)  # (3, 2, 4, 29)
    for c, n in enumerate(lengths.tolist()):
        s[c, :, :, n:] = float("-inf")
    torch.testing.assert_close(out, (torch.softmax(s, -1) @ v.double()).float(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float(), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        ka.decode_attention(q, k, v, lengths, 0.125, softcap=0.0)
