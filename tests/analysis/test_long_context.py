"""Per-head statistics at long context (issue 16, item 1): the tiled kernel against the math
backend's full weights, the analysis against roles.py on full patterns, and the peak memory
at T = 16384 in a fresh process."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise.attention import attend
from headwise.attention.backends.head_stats import attention_stats

STATS = (
    "visible entropy max_weight sink_mass local_mass distance sink_distance visible_sinks spread "
    "offsets offsets_visible top_norm_share sink_norm_share"
).split()


def reference(q, k, norms, *, sinks, local, K, **masks):
    """Every statistic straight from the (B, H, T, S) weights of backend='math', in float64;
    visibility from the mask arguments with plain comparisons."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    w = attend(q, k, k, backend="math", need_weights=True, **masks).weights.double()
    pos = torch.arange(S - T, S)[:, None]  # bottom-right aligned query positions
    j = torch.arange(S)[None]
    rel, dist = pos - j, (pos - j).abs().double()
    vis = torch.ones(B, H, T, S, dtype=torch.bool)
    if masks.get("is_causal"):
        vis &= rel >= 0
    if masks.get("window") is not None:
        left, right = masks["window"]
        vis &= (rel <= left) & (rel >= -right)
    if masks.get("key_padding_mask") is not None:
        vis &= ~masks["key_padding_mask"][:, None, None, :]
    m = masks.get("attn_mask")
    if m is not None:
        vis &= m if m.dtype == torch.bool else torch.isfinite(m)
    contrib = w * norms.double()[:, :, None, :]
    budget = contrib.sum(-1).clamp_min(1e-30)
    at = [(j - pos) == o for o in range(-K, K + 1)]
    return {
        "visible": vis.sum(-1),
        "entropy": -torch.xlogy(w, w).sum(-1),
        "max_weight": w.amax(-1),
        "sink_mass": w[..., :sinks].sum(-1),
        "local_mass": (w * (dist <= local)).sum(-1),
        "distance": (w * dist).sum(-1),
        "sink_distance": (w[..., :sinks] * dist[:, :sinks]).sum(-1),
        "visible_sinks": vis[..., :sinks].sum(-1),
        "spread": (vis[..., sinks:] * dist[:, sinks:]).sum(-1),
        "offsets": torch.stack([(w * a).sum(-1) for a in at], -1),
        "offsets_visible": torch.stack([(vis & a).sum(-1) for a in at], -1),
        "top_norm_share": contrib.gather(-1, w.argmax(-1, keepdim=True))[..., 0] / budget,
        "sink_norm_share": contrib[..., :sinks].sum(-1) / budget,
    }


@st.composite
def cases(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    T = draw(st.integers(1, 120))
    S = draw(st.integers(max(1, T - 20), 160))  # S < T too: early causal rows see nothing
    kind = draw(st.sampled_from(["none", "causal", "padding", "window", "causal_window", "bool", "float", "alibi"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    masks = {}
    if kind in ("causal", "padding", "causal_window", "alibi"):
        masks["is_causal"] = True
    if kind == "padding":  # right padding of a different length per row, and a fully padded row's keys
        lengths = torch.randint(0, S + 1, (B,), generator=g)
        masks["key_padding_mask"] = torch.arange(S)[None] >= lengths[:, None]
    if kind in ("window", "causal_window"):
        masks["window"] = (draw(st.integers(0, 12)), 0 if kind == "causal_window" else draw(st.integers(0, 12)))
    if kind == "bool":
        masks["attn_mask"] = torch.rand(B, 1, T, S, generator=g) > 0.4
    if kind == "float":
        m = torch.randn(1, Hkv * G, T, S, generator=g)
        masks["attn_mask"] = m.masked_fill(torch.rand(m.shape, generator=g) > 0.7, float("-inf"))
    if kind == "alibi":
        masks["alibi_slopes"] = torch.rand(Hkv * G, generator=g)

    def block(n):  # tiles that do not divide the length
        b = draw(st.integers(5, 48))
        return b + 1 if n > b and n % b == 0 else b

    shape = dict(B=B, H=Hkv * G, Hkv=Hkv, T=T, S=S, D=draw(st.sampled_from([4, 8])))
    return shape, masks, block(T), block(S), draw(st.sampled_from([None, "chunked", "sdpa"])), g


@settings(max_examples=30, deadline=None)
@given(cases(), st.integers(0, 6), st.integers(0, 20))
def test_kernel_statistics_equal_those_of_the_math_backends_weights(case, sinks, local):
    shape, masks, block_q, block_k, lse_from, g = case
    B, H, Hkv, T, S, D = (shape[n] for n in "B H Hkv T S D".split())
    q = torch.randn(B, H, T, D, generator=g) * 1.5
    k = torch.randn(B, Hkv, S, D, generator=g) * 1.5
    norms = torch.rand(B, H, S, generator=g) + 0.1
    lse = None  # the kernel's own first pass, or the LSE of a fused forward
    if lse_from is not None:
        lse = attend(q, k, k, backend=lse_from, return_lse=True, **masks).lse
    got = attention_stats(
        q, k, lse=lse, key_norms=norms, sinks=sinks, local=local, offsets=4, block_q=block_q, block_k=block_k, **masks
    )
    ref = reference(q, k, norms, sinks=sinks, local=local, K=4, **masks)
    for name in STATS:
        torch.testing.assert_close(getattr(got, name).double(), ref[name].double(), atol=1e-5, rtol=1e-5, msg=name)


def test_fully_masked_rows_give_zeros_not_nan():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 7, 4)
    pad = torch.ones(1, 7, dtype=torch.bool)  # every key padded
    got = attention_stats(q, k, key_norms=torch.rand(1, 2, 7), key_padding_mask=pad)
    for name in STATS:
        t = getattr(got, name)
        assert torch.isfinite(t).all() and (t == 0).all(), name


def test_bad_arguments_name_the_problem():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 7, 4)
    with pytest.raises(ValueError, match=r"key_norms has shape \(1, 1, 7\) but must be \(B, H, S\) = \(1, 2, 7\)"):
        attention_stats(q, k, key_norms=torch.rand(1, 1, 7))
    with pytest.raises(ValueError, match=r"lse has shape \(1, 2, 4\)"):
        attention_stats(q, k, lse=torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        attention_stats(q, k, sinks=-1)
