"""The GQA fold and the LSE merge, each written once and shared by the backends."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise.attention import attend, fold_heads, unfold_heads
from headwise.attention.backends import merge_lse
from headwise.attention.backends import chunked as chunked_backend


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), Hkv=st.integers(1, 3), G=st.integers(1, 4), T=st.integers(1, 5))
def test_fold_puts_each_query_head_against_its_kv_head(B, Hkv, G, T):
    """Row r of folded KV head j is query head j*G + r // T at position r % T (Llama's GQA map
    h -> h // G), and unfold inverts it."""
    H, D = Hkv * G, 3
    q = torch.randn(B, H, T, D)
    f = fold_heads(q, Hkv)
    assert f.shape == (B, Hkv, G * T, D)
    for h in range(H):
        for t in range(T):
            assert torch.equal(f[:, h // G, (h % G) * T + t], q[:, h, t])
    assert torch.equal(unfold_heads(f, H), q)


def test_folded_attention_equals_per_head_attention_with_repeated_kv():
    """The folded math backend equals attention head by head over K/V repeated per query head."""
    B, H, Hkv, T, S, D = 2, 6, 2, 3, 7, 4
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    kr, vr = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    ref = torch.softmax(q @ kr.transpose(-2, -1) / D**0.5, dim=-1) @ vr
    torch.testing.assert_close(attend(q, k, v, backend="math"), ref, atol=1e-6, rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(S=st.integers(2, 20), cut=st.integers(1, 19), causal=st.booleans())
def test_merging_two_key_parts_equals_attention_over_all_keys(S, cut, causal):
    """(out, lse) of keys [0, cut) and [cut, S), merged, equal attention over all S keys; rows
    that see nothing in one part (causal) take the other part whole."""
    cut = min(cut, S - 1)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)
    pos = torch.arange(S - 4, S)[:, None]  # bottom-right causal positions of the queries
    keys = torch.arange(S)[None]
    mask = (keys <= pos) if causal else torch.ones(4, S, dtype=torch.bool)
    whole = attend(q, k, v, attn_mask=mask, backend="math", return_lse=True)
    a = attend(q, k[:, :, :cut], v[:, :, :cut], attn_mask=mask[:, :cut], backend="math", return_lse=True)
    b = attend(q, k[:, :, cut:], v[:, :, cut:], attn_mask=mask[:, cut:], backend="math", return_lse=True)
    out, lse = merge_lse(*merge_lse(None, None, a.out, a.lse), b.out, b.lse)
    torch.testing.assert_close(out, whole.out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, whole.lse, atol=1e-6, rtol=1e-5)


def test_chunked_merges_its_tiles_with_the_shared_merge(monkeypatch):
    """The chunked backend combines its key tiles through merge_lse: one call per visible tile."""
    calls = []

    def counting(*args):
        calls.append(1)
        return merge_lse(*args)

    monkeypatch.setattr(chunked_backend, "merge_lse", counting)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    out = attend(q, k, v, backend="chunked")
    ref = attend(q, k, v, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1  # one 256-key tile
    calls.clear()
    out = chunked_backend.chunked_attention(q, k, v, _spec(q, k, v), block_k=16).out
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 3  # 40 keys in tiles of 16: three parts


def _spec(q, k, v):
    from headwise.attention.spec import make_spec

    return make_spec(q, k, v)
