"""Sliding windows, logit soft-capping, a custom scale and QK-norm (issue 40: Mistral, Gemma 2/3,
Qwen3), against a reference written here in plain torch: scores, tanh cap, mask, softmax."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from headwise.attention import MultiHeadAttention, attend, explain
from headwise.attention.backends.chunked import chunked_attention
from headwise.attention.spec import make_spec
from headwise.cache import ContiguousKVCache


def reference(q, k, v, *, window=None, softcap=None, scale=None):
    """Causal attention, bottom-right aligned (query i at position S - T + i), in fp64.
    Key j is visible from query p iff p - window < j <= p (Hugging Face's sliding_window)."""
    B, H, T, D = q.shape
    S, G = k.shape[2], H // k.shape[1]
    k, v = k.double().repeat_interleave(G, dim=1), v.double().repeat_interleave(G, dim=1)
    s = q.double() @ k.transpose(-2, -1) * (D**-0.5 if scale is None else scale)  # (B, H, T, S)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.arange(S - T, S)[:, None]
    j = torch.arange(S)[None, :]
    allowed = j <= p
    if window is not None:
        allowed &= j > p - window
    w = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return (w @ v).float()


def qkv(B, H, Hkv, T, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, T, D, generator=g),
        torch.randn(B, Hkv, S, D, generator=g),
        torch.randn(B, Hkv, S, D, generator=g),
    )


HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("backend", ["math", "chunked", "sdpa", "auto"])
@pytest.mark.parametrize("window,softcap", [(3, None), (None, 2.0), (5, 1.5), (64, None)])
def test_attend_matches_reference(H, Hkv, backend, window, softcap):
    q, k, v = qkv(2, H, Hkv, 11, 11, 16)
    q = q * 3  # large scores, so the cap bites
    if backend == "sdpa" and softcap is not None:
        with pytest.raises(ValueError, match="soft-capping"):
            attend(q, k, v, is_causal=True, window=window, softcap=softcap, backend=backend)
        return
    out = attend(q, k, v, is_causal=True, window=window, softcap=softcap, scale=0.3, backend=backend)
    torch.testing.assert_close(out, reference(q, k, v, window=window, softcap=softcap, scale=0.3), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("T,S", [(1, 40), (3, 40), (40, 40)])
def test_chunked_tiles_skip_outside_window(T, S):
    """Tiles of 4 queries x 8 keys: most lie outside a window of 6 and are skipped."""
    q, k, v = qkv(1, 4, 2, T, S, 8, seed=1)
    spec = make_spec(q, k, v, is_causal=True, window=6, softcap=0.7)
    out = chunked_attention(q, k, v, spec, block_q=4, block_k=8).out
    torch.testing.assert_close(out, reference(q, k, v, window=6, softcap=0.7), atol=2e-5, rtol=1e-4)


def test_chunked_backward_through_cap_and_window():
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, 2, 9, 9, 8, seed=2))
    spec = make_spec(q, k, v, is_causal=True, window=4, softcap=1.0)
    grads = torch.autograd.grad(chunked_attention(q, k, v, spec, block_q=4, block_k=4).out.square().sum(), (q, k, v))
    want = torch.autograd.grad(reference(q, k, v, window=4, softcap=1.0).square().sum(), (q, k, v))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-3)


def test_lse_and_weights_capped():
    q, k, v = qkv(1, 2, 1, 5, 7, 8, seed=3)
    res = attend(q * 4, k, v, is_causal=True, softcap=1.0, window=3, need_weights=True, return_lse=True)
    s = 1.0 * torch.tanh((q * 4).double() @ k.double().repeat(1, 2, 1, 1).transpose(-2, -1) * 8**-0.5)
    p, j = torch.arange(2, 7)[:, None], torch.arange(7)[None]
    s = s.masked_fill(~((j <= p) & (j > p - 3)), float("-inf"))
    torch.testing.assert_close(res.lse, torch.logsumexp(s, -1).float())
    torch.testing.assert_close(res.weights, torch.softmax(s, -1).float())
    chunked = attend(q * 4, k, v, is_causal=True, softcap=1.0, window=3, return_lse=True, backend="chunked")
    torch.testing.assert_close(chunked.lse, res.lse)


def test_explain_says_how_window_and_softcap_are_handled():
    q, k, v = qkv(1, 4, 2, 6, 6, 16)
    exp = explain(q, k, v, is_causal=True, window=4, softcap=30.0)
    text = str(exp)
    assert "sdpa" in exp.rejected and any("soft-capping" in r for r in exp.rejected["sdpa"])
    assert "window: query at position p sees keys [p - 3, p + 0]" in text
    assert "softcap: scores become 30 * tanh(s / 30)" in text


def test_errors():
    q, k, v = qkv(1, 2, 2, 3, 3, 8)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="softcap must be"):
            attend(q, k, v, softcap=bad)
        with pytest.raises(ValueError, match="softcap must be"):
            MultiHeadAttention(16, 2, softcap=bad)
    with pytest.raises(ValueError, match="window must be >= 1"):
        attend(q, k, v, is_causal=True, window=0)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            MultiHeadAttention(16, 2, window=bad)
    with pytest.raises(ValueError, match="scale must be"):
        MultiHeadAttention(16, 2, scale=-0.1)


# ------------------------------------------------------------------ the layer
def rope_half(x, pos, base=10000.0):
    """Rotate-half RoPE (Hugging Face's Llama/Gemma): x (B, H, T, D), pos (T,)."""
    D = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None]  # (T, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return (x.double() * cos + torch.cat([-x2, x1], -1).double() * sin).float()


def layer_reference(attn: MultiHeadAttention, x, *, window, softcap, scale, rope=True):
    """Project with the layer's weights, per-head RMSNorm, RoPE, then `reference`, then O."""
    B, T, _ = x.shape
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    wq, wk, wv, wo = attn.projection_weights()
    q = (x @ wq.T).view(B, T, H, D).transpose(1, 2)
    k = (x @ wk.T).view(B, T, Hkv, D).transpose(1, 2)
    v = (x @ wv.T).view(B, T, Hkv, D).transpose(1, 2)

    def rms(t, w):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6) * w

    q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    if rope:
        q, k = rope_half(q, torch.arange(T)), rope_half(k, torch.arange(T))
    o = reference(q, k, v, window=window, softcap=softcap, scale=scale)
    return o.transpose(1, 2).reshape(B, T, H * D) @ wo.T


def make_layer(H=4, Hkv=1, D=16, window=5, softcap=2.0, scale=0.2, backend="auto", seed=0):
    torch.manual_seed(seed)
    attn = MultiHeadAttention(
        32,
        H,
        Hkv,
        head_dim=D,
        rope=True,
        window=window,
        softcap=softcap,
        scale=scale,
        q_norm=nn.RMSNorm(D, eps=1e-6),
        k_norm=nn.RMSNorm(D, eps=1e-6),
        backend=backend,
    ).eval()
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.uniform_(0.5, 2.0)
    return attn


def test_layer_state_dict_names_and_repr():
    attn = make_layer()
    names = set(attn.state_dict())
    assert {"q_norm.weight", "k_norm.weight"} <= names
    assert "q_norm.weight" not in MultiHeadAttention(32, 4).state_dict()
    r = repr(attn)
    assert "window=5" in r and "softcap=2.0" in r and "scale=0.2" in r


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("backend", ["auto", "math", "chunked"])
def test_layer_forward(H, Hkv, backend):
    attn = make_layer(H, Hkv, backend=backend)
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        out = attn(x, is_causal=True)
        want = layer_reference(attn, x, window=5, softcap=2.0, scale=0.2)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("H,Hkv", HEADS)
def test_layer_decode_through_a_cache_longer_than_the_window(H, Hkv):
    """Prefill 7 tokens, then decode one at a time to 20: each step equals the full causal run."""
    attn = make_layer(H, Hkv, window=4)
    x = torch.randn(1, 20, 32)
    cache = ContiguousKVCache(1, 1, Hkv, 32, 16)
    with torch.no_grad():
        want = layer_reference(attn, x, window=4, softcap=2.0, scale=0.2)
        outs = [attn(x[:, :7], is_causal=True, cache=cache.layer(0))]
        outs += [attn(x[:, t : t + 1], is_causal=True, cache=cache.layer(0)) for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-4, rtol=1e-4)


def test_attend_heads_adds_the_layers_settings():
    """The fused executor's call (models/blocks.fused_layer): heads already projected, normed and
    rotated, kwargs it builds without window, softcap or scale."""
    attn = make_layer(4, 2, window=3, softcap=1.0, scale=0.5)
    q, k, v = qkv(1, 4, 2, 9, 9, 16, seed=5)
    q, k = attn.norm_qk(q, k)
    with torch.no_grad():
        out = attn.attend_heads(q, k, v, None, None, dict(is_causal=True, alibi_slopes=None, backend="auto"))
        want = reference(q, k, v, window=3, softcap=1.0, scale=0.5)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    # norm_qk normalises each head's D values: the reference RMSNorm by hand
    q0 = qkv(1, 4, 2, 9, 9, 16, seed=5)[0]
    by_hand = q0 * torch.rsqrt(q0.square().mean(-1, keepdim=True) + 1e-6) * attn.q_norm.weight
    torch.testing.assert_close(q, by_hand)


def test_default_scale_is_inverse_sqrt_head_dim():
    attn = make_layer(window=None, softcap=None, scale=None)
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, is_causal=True),
            layer_reference(attn, x, window=None, softcap=None, scale=1 / math.sqrt(16)),
            atol=1e-4,
            rtol=1e-4,
        )


def test_a_window_longer_than_the_keys_is_no_window():
    """Gemma 3's local layers (window 512) on a shorter context run the plain fast paths."""
    q, k, v = qkv(1, 4, 1, 1, 9, 16)
    assert make_spec(q, k, v, is_causal=True, window=9).window is None
    assert make_spec(q, k, v, is_causal=True, window=8).window == (7, 0)
    e = explain(q, k, v, is_causal=True, window=512)
    assert "covers every key" in str(e)
    assert e.chosen == explain(q, k, v, is_causal=True).chosen


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("window", [1, 8, 39])
def test_decode_kernel_reads_only_the_window(H, Hkv, window):
    """One query row against 40 keys: the decode kernel, given K/V from the window's first key."""
    q, k, v = qkv(2, H, Hkv, 1, 40, 16, seed=7)
    e = explain(q, k, v, is_causal=True, window=window)
    assert e.chosen == "decode" and "each query row reads only the keys of its window" in str(e)
    out = attend(q, k, v, is_causal=True, window=window)
    torch.testing.assert_close(out, reference(q, k, v, window=window), atol=2e-5, rtol=1e-4)
    k[:, :, : 40 - window] = float("nan")  # keys before the window are never read
    torch.testing.assert_close(attend(q, k, v, is_causal=True, window=window), out)


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize(
    "T,S,window", [(70, 70, 5), (70, 70, 33), (100, 130, 40), (9, 200, 64), (65, 65, 64), (40, 300, 16)]
)
def test_prefill_kernel_window(H, Hkv, T, S, window):
    """The C prefill kernel with a window: blocks before a query block's window are not read (NaN
    there changes nothing), rows mask the keys before their own window."""
    q, k, v = qkv(1, H, Hkv, T, S, 16, seed=8)
    e = explain(q, k, v, is_causal=True, window=window)
    assert e.chosen == "prefill", str(e)
    res = attend(q, k, v, is_causal=True, window=window, return_lse=True)
    torch.testing.assert_close(res.out, reference(q, k, v, window=window), atol=2e-5, rtol=1e-4)
    ref = attend(q, k, v, is_causal=True, window=window, return_lse=True, backend="math")
    torch.testing.assert_close(res.lse, ref.lse, atol=1e-4, rtol=1e-4)
    before = S - T - (window - 1)  # keys before the first query's window
    if before > 0:
        k[:, :, :before], v[:, :, :before] = float("nan"), float("nan")
        torch.testing.assert_close(attend(q, k, v, is_causal=True, window=window), res.out)


def test_head_stats_see_the_cap_and_the_window():
    """attention_stats (analysis' long-context pass): entropy and max weight of capped, windowed rows."""
    from headwise.attention.backends.head_stats import attention_stats

    q, k, v = qkv(1, 4, 2, 12, 12, 16, seed=9)
    q = q * 3
    st = attention_stats(q, k, is_causal=True, window=5, softcap=1.5, block_q=4, block_k=4)
    s = 1.5 * torch.tanh(q.double() @ k.double().repeat_interleave(2, 1).transpose(-2, -1) / 4 / 1.5)
    p, j = torch.arange(12)[:, None], torch.arange(12)[None]
    w = torch.softmax(s.masked_fill(~((j <= p) & (j > p - 5)), float("-inf")), -1)
    torch.testing.assert_close(st.max_weight.double(), w.amax(-1), atol=1e-5, rtol=1e-4)
    entropy = -(w * w.clamp_min(1e-300).log()).sum(-1)
    torch.testing.assert_close(st.entropy.double(), entropy, atol=1e-4, rtol=1e-4)


def test_a_hook_sees_the_layers_settings():
    """Analysis hooks rebuild weights from the LSE with the call's kwargs: the layer's own window,
    softcap and scale are among them."""
    attn = make_layer(4, 2, window=3, softcap=1.0, scale=0.5)
    seen = {}

    class Hook:
        wants_lse = True

        def __call__(self, layer, q, k, v, out, lse, weights, kwargs):
            seen.update(kwargs)
            return out

    attn.hook = Hook()
    with torch.no_grad():
        attn(torch.randn(1, 6, 32), is_causal=True)
    assert (seen["window"], seen["softcap"], seen["scale"]) == (3, 1.0, 0.5)


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("window,softcap", [(None, 50.0), (None, 1.0), (8, 0.5), (None, None)])
def test_decode_kernel_caps_the_scores(H, Hkv, window, softcap):
    """Gemma 2's decode: the C decode kernel caps each score before its softmax."""
    q, k, v = qkv(2, H, Hkv, 1, 37, 32, seed=11)
    q = q * 4
    e = explain(q, k, v, is_causal=True, window=window, softcap=softcap)
    assert e.chosen == "decode", str(e)
    res = attend(q, k, v, is_causal=True, window=window, softcap=softcap, return_lse=True)
    torch.testing.assert_close(res.out, reference(q, k, v, window=window, softcap=softcap), atol=2e-5, rtol=1e-4)
    ref = attend(q, k, v, is_causal=True, window=window, softcap=softcap, return_lse=True, backend="math")
    torch.testing.assert_close(res.lse, ref.lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "math", "chunked"])
@pytest.mark.parametrize("T,S", [(1, 30), (12, 12), (5, 30)])
def test_against_transformers_gemma2_eager_attention(backend, T, S):
    """Hugging Face's own Gemma 2 attention math (eager_attention_forward: scale, soft-cap, then the
    mask) with its own sliding-window mask functions (masking_utils), queries at the last T positions."""
    from transformers import masking_utils
    from transformers.models.gemma2 import modeling_gemma2 as gemma2

    q, k, v = qkv(2, 4, 2, T, S, 16, seed=12)
    q = q * 4
    W, cap, scale = 7, 2.5, 0.3
    allow = masking_utils.and_masks(
        masking_utils.causal_mask_function, masking_utils.sliding_window_overlay(W)
    )  # (b, h, q_idx, kv_idx) -> bool, q_idx an absolute position
    zero = torch.tensor(0)
    mask = allow(zero, zero, torch.arange(S - T, S)[:, None], torch.arange(S)[None]).expand(T, S)
    additive = torch.zeros(T, S).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    module = nn.Module()
    module.num_key_value_groups, module.training = 2, False
    want, _ = gemma2.eager_attention_forward(module, q, k, v, additive, scaling=scale, softcap=cap)  # (B, T, H, D)
    out = attend(q, k, v, is_causal=True, window=W, softcap=cap, scale=scale, backend=backend)
    torch.testing.assert_close(out.transpose(1, 2), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("T,S,window,softcap", [(70, 70, None, 1.0), (40, 90, 16, 0.5), (33, 33, 8, 50.0)])
def test_prefill_kernel_caps_the_scores(H, Hkv, T, S, window, softcap):
    """Gemma 2's prefill: the C prefill kernel caps each block's scores before its masks."""
    q, k, v = qkv(1, H, Hkv, T, S, 16, seed=13)
    q = q * 4
    e = explain(q, k, v, is_causal=True, window=window, softcap=softcap)
    assert e.chosen == "prefill", str(e)
    res = attend(q, k, v, is_causal=True, window=window, softcap=softcap, return_lse=True)
    torch.testing.assert_close(res.out, reference(q, k, v, window=window, softcap=softcap), atol=2e-5, rtol=1e-4)
    ref = attend(q, k, v, is_causal=True, window=window, softcap=softcap, return_lse=True, backend="math")
    torch.testing.assert_close(res.lse, ref.lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("windows", [None, [4]])  # every slot kept, or the cache's own ring of 4
def test_layer_chunked_prefill_through_a_cache(windows):
    """A 23-token prompt in chunks of 5 (the last one 3), then 4 decodes: equal to one causal run."""
    attn = make_layer(4, 2, window=4)
    x = torch.randn(1, 27, 32)
    cache = ContiguousKVCache(1, 1, 2, 32, 16, windows=windows)
    with torch.no_grad():
        want = layer_reference(attn, x, window=4, softcap=2.0, scale=0.2)
        bounds = [0, 5, 10, 15, 20, 23, 24, 25, 26, 27]
        outs = [attn(x[:, a:b], is_causal=True, cache=cache.layer(0)) for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-4, rtol=1e-4)
