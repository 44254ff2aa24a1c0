"""Every backend against the math reference, over hypothesis-drawn shapes and masks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from headwise.attention import attend, backends, explain, weights_from_lse
from headwise.attention.backends.chunked import chunked_attention
from headwise.attention.spec import make_spec

# flash needs CUDA; paged reads caches; decode serves decode steps only, prefill causal or unmasked
# requests only (their own tests below)
FAST = [b for b in backends() if b not in ("math", "flash", "paged", "decode", "prefill")]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@st.composite
def problems(draw, dtype=torch.float32):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 3]))  # MHA when 1, MQA when Hkv == 1
    H = Hkv * G
    T = draw(st.integers(1, 33))
    S = draw(st.integers(1, 45))
    D = draw(st.sampled_from([16, 32, 64, 80, 128]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    kw = {"is_causal": draw(st.booleans())}
    if draw(st.booleans()):
        kpm = torch.rand(B, S, generator=g) < 0.3
        if draw(st.booleans()):
            kpm[0] = True  # a fully padded sequence: zeros, not NaN
        kw["key_padding_mask"] = kpm
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    if mask_kind:
        shape = draw(st.sampled_from([(T, S), (1, 1, T, S), (B, 1, T, S), (1, H, T, S), (B, H, T, S)]))
        m = torch.rand(shape, generator=g)
        kw["attn_mask"] = m > 0.25 if mask_kind == "bool" else (m * 4 - 2).to(dtype)
    if draw(st.booleans()):
        kw["window"] = draw(st.one_of(st.integers(1, 20), st.tuples(st.integers(0, 15), st.integers(0, 15))))
    if draw(st.booleans()):
        kw["alibi_slopes"] = torch.rand(H, generator=g) if draw(st.booleans()) else torch.rand(B, H, generator=g)
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 0.5))
    return q, k, v, kw


def _check_close(out, ref, dtype):
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert err <= TOL[dtype], f"max abs error {err}"


@pytest.mark.parametrize("backend", FAST)
@given(p=problems())
def test_backend_matches_math_fp32(backend, p):
    q, k, v, kw = p
    ref = attend(q, k, v, backend="math", **kw)
    assert not torch.isnan(ref).any()
    _check_close(attend(q, k, v, backend=backend, **kw), ref, torch.float32)


@pytest.mark.parametrize("backend", FAST)
@given(p=problems(dtype=torch.bfloat16))
def test_backend_matches_math_bf16(backend, p):
    q, k, v, kw = p
    if explain(q, k, v, backend=backend, **kw).chosen is None:
        return  # e.g. sdpa declines ALiBi in bf16; auto then picks another backend (tested below)
    _check_close(attend(q, k, v, backend=backend, **kw), attend(q, k, v, backend="math", **kw), torch.bfloat16)


@given(p=problems(dtype=torch.bfloat16))
def test_auto_matches_math_bf16(p):
    q, k, v, kw = p
    _check_close(attend(q, k, v, **kw), attend(q, k, v, backend="math", **kw), torch.bfloat16)


@given(p=problems(), bq=st.integers(1, 9), bk=st.integers(1, 12))
def test_chunked_many_tiles(p, bq, bk):
    """Small tiles exercise tile skipping, per-tile masks and the online rescaling."""
    q, k, v, kw = p
    ref = attend(q, k, v, backend="math", return_lse=True, **kw)
    res = chunked_attention(q, k, v, make_spec(q, k, v, return_lse=True, **kw), block_q=bq, block_k=bk)
    _check_close(res.out, ref.out, torch.float32)
    assert torch.equal(torch.isneginf(res.lse), torch.isneginf(ref.lse))
    finite = ~torch.isneginf(ref.lse)
    assert torch.allclose(res.lse[finite], ref.lse[finite], atol=1e-5)


def _grads(q, k, v, kw, backend, **extra):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if backend == "chunked-small":
        out = chunked_attention(q, k, v, make_spec(q, k, v, **kw), block_q=3, block_k=5).out
    else:
        out = attend(q, k, v, backend=backend, **kw)
    g = torch.linspace(-1, 1, out.numel()).view_as(out)
    return torch.autograd.grad((out * g).sum(), (q, k, v))


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "chunked-small"])
@given(p=problems())
def test_gradients_match_math(backend, p):
    q, k, v, kw = p
    for got, ref in zip(_grads(q, k, v, kw, backend), _grads(q, k, v, kw, "math")):
        assert not torch.isnan(got).any()
        assert (got - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())  # fp32 rounding


@given(p=problems())
def test_chunked_lse_gradient(p):
    """The LSE output is differentiable too (chunked backward adds d lse / d s = p)."""
    q, k, v, kw = p
    kw.pop("key_padding_mask", None)
    kw.pop("attn_mask", None)  # keep every row finite so lse.sum() is defined
    kw.pop("window", None)

    def grads(backend):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        res = attend(qq, kk, vv, backend=backend, return_lse=True, **kw)
        rows = ~torch.isneginf(res.lse)
        return torch.autograd.grad(res.out.sum() + res.lse[rows].sum(), (qq, kk, vv))

    for got, ref in zip(grads("chunked"), grads("math")):
        assert (got - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
@given(p=problems())
def test_lse_and_rebuilt_weights(backend, p):
    q, k, v, kw = p
    ref = attend(q, k, v, backend="math", need_weights=True, return_lse=True, **kw)
    res = attend(q, k, v, backend=backend, return_lse=True, **kw)
    assert torch.equal(torch.isneginf(res.lse), torch.isneginf(ref.lse))
    finite = ~torch.isneginf(ref.lse)
    assert torch.allclose(res.lse[finite], ref.lse[finite], atol=1e-5)
    H, T = q.shape[1], q.shape[2]
    heads = [0, H - 1]
    queries = slice(T // 3, T)
    w = weights_from_lse(q, k, res.lse, heads=heads, queries=queries, **kw)
    assert (w - ref.weights[:, heads][:, :, queries]).abs().max().item() <= 1e-5


def test_fully_masked_rows_are_zero_everywhere():
    q, k, v = torch.randn(2, 4, 6, 32), torch.randn(2, 2, 8, 32), torch.randn(2, 2, 8, 32)
    kpm = torch.zeros(2, 8, dtype=torch.bool)
    kpm[1] = True
    for backend in ["math", *FAST]:
        out = attend(q, k, v, key_padding_mask=kpm, backend=backend)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert not torch.isnan(out).any()
    # Causal with more queries than keys: the first T - S queries see no key at all.
    q = torch.randn(1, 2, 10, 16)
    k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    for backend in ["math", *FAST]:
        out = attend(q, k, v, is_causal=True, backend=backend)
        assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))


def test_causal_is_bottom_right_like_decoding():
    """Attending the last T queries against S keys equals the last T rows of the full causal pass."""
    q, k, v = torch.randn(2, 4, 20, 32), torch.randn(2, 4, 20, 32), torch.randn(2, 4, 20, 32)
    full = attend(q, k, v, is_causal=True, backend="math")
    for backend in ["math", *FAST]:
        tail = attend(q[:, :, 15:], k, v, is_causal=True, backend=backend)
        assert (tail - full[:, :, 15:]).abs().max() <= 1e-5


def test_sdpa_gqa_reads_kv_grouped():
    """GQA equals MHA with each KV head repeated for its group (the independent definition)."""
    q, k, v = torch.randn(2, 8, 7, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
    for backend in ["math", *FAST]:
        assert (attend(q, k, v, backend=backend) - ref).abs().max() <= 1e-5


def test_dropout_statistics():
    """With dropout the output is unbiased: averaging many draws approaches the no-dropout output."""
    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    ref = attend(q, k, v, backend="math")
    for backend in ["math", "sdpa"]:
        draws = torch.stack([attend(q, k, v, dropout_p=0.3, backend=backend) for _ in range(3000)])
        assert not torch.equal(draws[0], draws[1])
        assert (draws.mean(0) - ref).abs().max() < 0.1
    assert "no dropout" in explain(q, k, v, dropout_p=0.3).rejected["chunked"]


def test_auto_order_and_explain():
    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    assert backends()[:1] == ["flash"] and backends()[-1] == "math"
    e = explain(q, k, v)
    assert e.chosen == "decode" and "needs CUDA" in " ".join(e.rejected["flash"])  # no mask, 4 rows per KV head
    e = explain(q, k, v, is_causal=True)  # 4 query rows under a causal mask: not a decode step
    assert e.chosen == "prefill" and "see every key" in " ".join(e.rejected["decode"])
    e = explain(q, k, v, window=3)  # a two-sided window: a mask the prefill kernel does not draw
    assert e.chosen == "sdpa" and "a window only with causal" in " ".join(e.rejected["prefill"])
    e = explain(q, k, v, attn_mask=torch.ones(4, 6, dtype=torch.bool))
    assert e.chosen == "sdpa" and "causal or no mask only" in " ".join(e.rejected["prefill"])
    assert explain(q, k, v, need_weights=True).chosen == "math"
    e = explain(q, k, v, return_lse=True, dropout_p=0.1)
    assert e.chosen == "math" and "no dropout" in e.rejected["chunked"]
    assert "flash-attn" in str(explain(q, k, v, backend="flash")) or "CUDA" in str(explain(q, k, v, backend="flash"))


def test_a_backend_registered_later_is_chosen_for_requests_seen_before():
    """attend() memoizes its choice for plain requests; registering a backend must undo that."""
    from headwise.attention.backends import registry

    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    want = attend(q, k, v, backend="math")
    assert torch.allclose(attend(q, k, v), want, atol=1e-6)  # memoized: sdpa
    calls = []

    def mine(q, k, v, spec):
        calls.append(spec.H)
        return registry._REGISTRY["math"].fn(q, k, v, spec)

    registry.register_backend("mine", mine, before="flash")
    try:
        assert torch.allclose(attend(q, k, v), want, atol=1e-6) and calls == [4]
    finally:
        registry._REGISTRY.pop("mine")
        registry._CHANGES[0] += 1  # as a registry change: later calls choose again
    attend(q, k, v)
    assert calls == [4]


@st.composite
def decode_problems(draw):
    """What the decode backend serves: G*T <= 16 query rows per KV head that see every key,
    K/V as views of a longer cache (strided, as a contiguous cache hands them over)."""
    B, Hkv = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 3, 4]))
    T = draw(st.integers(1, 16 // G))
    S, D = draw(st.integers(1, 300)), draw(st.sampled_from([8, 64, 128]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    k, v = (torch.randn(B, Hkv, S + 7, D, generator=g)[:, :, :S] for _ in range(2))  # views of a bigger cache
    kw = {"is_causal": T == 1 and draw(st.booleans())}
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 0.5))
    return q, k, v, kw


@given(p=decode_problems())
def test_decode_backend_matches_math(p):
    q, k, v, kw = p
    assert explain(q, k, v, **kw).chosen == "decode"  # auto takes it for these on CPU
    ref = attend(q, k, v, backend="math", return_lse=True, **kw)
    res = attend(q, k, v, backend="decode", return_lse=True, **kw)
    # fp32 against fp32: with scale 0.5 and D=128 the scores reach ~30, where both sides' exp()
    # rounds at ~1e-6 relative, so the bound is relative to the values (~4 at most) as well
    torch.testing.assert_close(res.out, ref.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.lse, ref.lse, atol=1e-5, rtol=1e-6)


@given(p=problems())
def test_decode_backend_refuses_by_name_or_matches_math(p):
    """Every request: either explain() names why decode refuses it (and attend says so), or it matches math."""
    q, k, v, kw = p
    reasons = explain(q, k, v, backend="decode", **kw).rejected.get("decode", [])
    if reasons:
        with pytest.raises(ValueError, match="decode"):
            attend(q, k, v, backend="decode", **kw)
    else:
        _check_close(attend(q, k, v, backend="decode", **kw), attend(q, k, v, backend="math", **kw), torch.float32)


def test_memoized_choice_follows_the_layout():
    """attend() memoizes plain requests by shape; K/V of the same shapes but transposed in memory
    must not reuse the decode kernel's choice (it needs each key's D values contiguous)."""
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert torch.allclose(attend(q, k, v), attend(q, k, v, backend="math"), atol=1e-6)  # decode, memoized
    kt, vt = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (k, v))  # same values, stride(-1) = 5
    assert kt.stride(-1) != 1 and "decode" in explain(q, kt, vt).rejected
    assert torch.allclose(attend(q, kt, vt), attend(q, k, v, backend="math"), atol=1e-6)


@st.composite
def prefill_problems(draw):
    """What the prefill backend serves: causal (S >= T, bottom-right) or unmasked fp32 requests,
    any GQA group up to 16, q a transposed projection and K/V views of a longer cache."""
    B, Hkv = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 3, 16]))
    T = draw(st.integers(2, 60))
    causal = draw(st.booleans())
    S = T + draw(st.integers(0, 30)) if causal else draw(st.integers(1, 80))
    D = draw(st.sampled_from([8, 64, 80, 128]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, T, Hkv * G, D, generator=g).transpose(1, 2)
    k, v = (torch.randn(B, Hkv, S + 7, D, generator=g)[:, :, :S] for _ in range(2))
    kw = {"is_causal": causal}
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 0.5))
    return q, k, v, kw


@given(p=prefill_problems())
def test_prefill_backend_matches_math(p):
    q, k, v, kw = p
    if q.shape[2] * q.shape[1] // k.shape[1] > 16 or kw["is_causal"]:  # not a decode step: auto takes prefill
        assert explain(q, k, v, **kw).chosen == "prefill"
    ref = attend(q, k, v, backend="math", return_lse=True, **kw)
    res = attend(q, k, v, backend="prefill", return_lse=True, **kw)
    # fp32 both, summed in different orders (MKL's, under load with fewer threads): one run saw one
    # value of 11,136 1.35e-5 off (of 0.25), over the 1e-5 this test had
    torch.testing.assert_close(res.out, ref.out, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(res.lse, ref.lse, atol=1e-5, rtol=1e-6)


@given(p=problems())
def test_prefill_backend_refuses_by_name_or_matches_math(p):
    """Every request: either explain() names why prefill refuses it (and attend says so), or it matches math."""
    q, k, v, kw = p
    reasons = explain(q, k, v, backend="prefill", **kw).rejected.get("prefill", [])
    if reasons:
        with pytest.raises(ValueError, match="prefill"):
            attend(q, k, v, backend="prefill", **kw)
    else:
        _check_close(attend(q, k, v, backend="prefill", **kw), attend(q, k, v, backend="math", **kw), torch.float32)


def test_requests_with_a_backward_skip_the_forward_only_kernels():
    """The choice attend() memoizes for a no-grad request of some shapes must not serve the same
    shapes with grad: prefill has no backward, so the gradients come from sdpa and equal math's."""
    q, k, v = torch.randn(1, 4, 24, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    with torch.no_grad():
        attend(q, k, v, is_causal=True)  # memoized: prefill
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    assert "no autograd" in " ".join(explain(qg, kg, vg, is_causal=True).rejected["prefill"])
    attend(qg, kg, vg, is_causal=True).square().sum().backward()
    qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
    attend(qm, km, vm, is_causal=True, backend="math").square().sum().backward()
    for got, want in ((qg, qm), (kg, km), (vg, vm)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)
