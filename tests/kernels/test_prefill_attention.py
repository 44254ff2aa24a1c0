"""kernels.prefill (prefill_attention.c) against a float64 softmax(q k^T) v, in both ISA variants."""

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import kernels
from headwise.kernels import prefill

VARIANTS = [v for v, flags in kernels.ISA_VARIANTS.items() if set(flags) <= kernels.cpu_flags()]  # this CPU runs


def reference(q, k, v, scale, causal):
    """float64 softmax(q k^T * scale) v with the G query heads of each KV head, bottom-right causal."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    kk, vv = (x.double().repeat_interleave(H // Hkv, 1) for x in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
    return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)


def variant_run(variant, q, k, v, scale, causal):
    """One compiled variant called directly (the package loads only this CPU's best)."""
    mod = importlib.import_module(f"headwise.kernels._cpu_{variant}")
    B, H, T, D = q.shape
    out, lse = torch.empty(B, H, T, D), torch.empty(B, H, T)
    rc = mod.prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, k.shape[1], T, k.shape[2], D,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], scale, int(causal), 0.0,
    )  # fmt: skip
    assert rc == 0
    return out, lse


def test_this_machine_runs_the_kernel():
    assert prefill.prefill_attention_unavailable() is None and VARIANTS


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2),
    Hkv=st.sampled_from([1, 2, 3]),
    G=st.sampled_from([1, 3, 4, 16]),
    T=st.integers(1, 70),
    extra=st.integers(0, 40),
    D=st.sampled_from([8, 24, 64, 80, 128, 256]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    variant=st.sampled_from(VARIANTS),
)
def test_matches_float64_reference(B, Hkv, G, T, extra, D, causal, seed, variant):
    """Odd T (partial query blocks), keys past the queries (a prefill after a cache), every GQA
    group size, head_dim with and without a partial 32-channel tile, q and K/V as strided views."""
    g = torch.Generator().manual_seed(seed)
    S = T + extra
    q = torch.randn(B, T, Hkv * G, D, generator=g).transpose(1, 2)  # (B, H, T, D), as a projection hands it
    k, v = (torch.randn(B, Hkv, S + 5, D, generator=g)[:, :, :S] for _ in range(2))  # views of a longer cache
    scale = 1 / math.sqrt(D)
    want, want_lse = reference(q, k, v, scale, causal)
    out, lse = variant_run(variant, q, k, v, scale, causal)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-6)
    if variant == kernels.isa():
        got, got_lse = prefill.prefill_attention(q, k, v, scale, causal, want_lse=True)
        assert torch.equal(got, out) and torch.equal(got_lse, lse)


def test_same_bits_at_any_thread_count():
    """Each (batch, KV head, query block) is one thread's work, whatever the split."""
    q, k, v = torch.randn(2, 9, 100, 64), torch.randn(2, 3, 100, 64), torch.randn(2, 3, 100, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill.prefill_attention(q, k, v)[0]
        torch.set_num_threads(2)
        two = prefill.prefill_attention(q, k, v)[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_same_bits_at_any_query_block():
    """Query tokens per block (prefill_query_block: by default the key block's 64 in the avx512
    build, 32 in avx2; fewer where the blocks would not give every thread two): a row meets its
    keys in the same key blocks whatever its query block, so every size gives the same bits, and
    the float64 reference's values."""
    mod = kernels._ext()[0]
    q, k, v = torch.randn(1, 8, 75, 64), torch.randn(1, 2, 90, 64), torch.randn(1, 2, 90, 64)
    before = mod.prefill_query_block(-1)
    try:
        outs = []
        for n in (1, 5, 16, 64, 256):
            assert mod.prefill_query_block(n) in (before, 1, 5, 16, 64)  # the size before
            outs.append(prefill.prefill_attention(q, k, v, causal=True, want_lse=True))
        for bad in (0, 257):
            with pytest.raises(ValueError, match="give 1 to 256"):
                mod.prefill_query_block(bad)
    finally:
        mod.prefill_query_block(before)
    default = {"avx512": 64, "avx2": 32}[kernels.isa()]
    assert before == default and mod.prefill_query_block(-1) == default
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    want, want_lse = reference(q, k, v, 1 / 8, True)
    torch.testing.assert_close(outs[0][0].double(), want, atol=2e-5, rtol=1e-5)


def test_no_keys_gives_zeros_and_minus_infinity():
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 0, 16)
    out, lse = prefill.prefill_attention(q, k, k, causal=False, want_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize(
    "shapes,kw,match",
    [
        (((1, 4, 8, 16), (1, 3, 8, 16)), {}, "dividing H"),
        (((1, 34, 8, 16), (1, 2, 8, 16)), {}, "G=17"),
        (((1, 2, 8, 12), (1, 2, 8, 12)), {}, "head_dim 12"),
        (((1, 2, 8, 16), (1, 2, 5, 16)), {"causal": True}, "at least as many keys"),
        (((1, 2, 8, 16), (1, 2, 8, 16)), {"dtype": torch.float64}, "fp32"),
    ],
)
def test_bad_input_is_refused(shapes, kw, match):
    dtype = kw.pop("dtype", torch.float32)
    q, k = torch.randn(*shapes[0], dtype=dtype), torch.randn(*shapes[1], dtype=dtype)
    with pytest.raises(ValueError, match=match):
        prefill.prefill_attention(q, k, k, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        prefill.prefill_attention(
            torch.randn(1, 2, 16, 8).transpose(-1, -2), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
        )


def test_window_left_against_a_masked_softmax():
    """window_left: query t (position t + S - T) sees keys [p - window_left, p]; checked arguments."""
    prefill_attention = prefill.prefill_attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g) for s in ((1, 6, 50, 32), (1, 2, 90, 32), (1, 2, 90, 32)))
    out, lse = prefill_attention(q, k, v, 0.3, True, True, window_left=9)
    s = q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.3  # (1, 6, 50, 90)
    p, j = torch.arange(40, 90)[:, None], torch.arange(90)[None]
    s = s.masked_fill(~((j <= p) & (j >= p - 9)), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v.repeat_interleave(3, 1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="window_left"):
        prefill_attention(q, k, v, causal=False, window_left=3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_softcap_in_each_variant(variant):
    """softcap: scores c * tanh(s / c) before the causal mask, in each compiled variant."""
    mod = importlib.import_module(f"headwise.kernels._cpu_{variant}")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 4, 37, 24), (2, 2, 45, 24), (2, 2, 45, 24)))
    q = q * 3
    out, lse = torch.empty(2, 4, 37, 24), torch.empty(2, 4, 37)
    rc = mod.prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 2, 4, 2, 37, 45, 24,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], 0.2, 1, 0.7,
    )  # fmt: skip
    assert rc == 0
    s = 0.7 * torch.tanh(q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.2 / 0.7)
    s = s.masked_fill(~torch.ones(37, 45, dtype=torch.bool).tril(8), float("-inf"))
    torch.testing.assert_close(
        out, (torch.softmax(s, -1) @ v.double().repeat_interleave(2, 1)).float(), atol=2e-5, rtol=1e-4
    )
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float(), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        prefill.prefill_attention(q, k, v, softcap=-1.0)
