"""Bad input gets an error that names the problem."""

import pytest
import torch

from headwise import MultiHeadAttention, attend
from headwise.attention import weights_from_lse


def qkv(B=2, H=4, Hkv=2, T=5, S=7, D=16):
    return torch.randn(B, H, T, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have 4 dims \(B, H, T, D\), got shape \(4, 5, 16\)"):
        attend(q[0], k, v)
    with pytest.raises(ValueError, match="k must have 4 dims"):
        attend(q, k[0], v)


def test_heads_not_divisible():
    q, k, v = qkv(H=6, Hkv=4)
    with pytest.raises(ValueError, match="num_heads=6 .* not divisible by num_kv_heads=4"):
        attend(q, k, v)
    with pytest.raises(ValueError, match="num_heads=12 is not divisible by num_kv_heads=5"):
        MultiHeadAttention(96, 12, 5)


def test_mismatched_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="head dim 16 but k has head dim 8"):
        attend(q, k[..., :8], v)
    with pytest.raises(ValueError, match=r"must agree on \(B, Hkv, S\)"):
        attend(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="batch 2 but k/v have batch 1"):
        attend(q, k[:1], v[:1])


def test_mask_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 9\) .* keys of length 7"):
        attend(q, k, v, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast to .* dim H is 3, expected 1 or 4"):
        attend(q, k, v, attn_mask=torch.ones(2, 3, 5, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="queries x keys is 5 x 7"):
        attend(q, k, v, attn_mask=torch.ones(5, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool .* or float"):
        attend(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"alibi_slopes must be \(H,\)"):
        attend(q, k, v, alibi_slopes=torch.ones(3))


def test_unknown_backend_lists_valid_ones():
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match="unknown attention backend 'fast'; valid backends: auto, flash, decode, prefill, sdpa, chunked, paged, math",
    ):
        attend(q, k, v, backend="fast")


def test_forced_backend_that_cannot_run():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="backend 'flash' cannot serve this request: .*needs CUDA"):
        attend(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="backend 'sdpa' cannot serve .* returns no weights"):
        attend(q, k, v, backend="sdpa", need_weights=True)
    with pytest.raises(ValueError, match="backend 'chunked' cannot serve .* no dropout"):
        attend(q, k, v, backend="chunked", dropout_p=0.1)


def test_layer_input_errors():
    m = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match=r"query must be \(B, T, d_model=32\), got \(2, 5, 16\)"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"head_mask must be \(H,\) = \(4,\)"):
        m(torch.randn(2, 5, 32), head_mask=torch.ones(3))
    with pytest.raises(ValueError, match="w_q has shape"):
        m.load_projections(torch.randn(16, 32), torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32))
    with pytest.raises(ValueError, match="out of range: this layer was built with 4 heads"):
        m.prune_heads([4])
    with pytest.raises(ValueError, match="would remove every head"):
        m.prune_heads([0, 1, 2, 3])
    with pytest.raises(ValueError, match="cannot represent this layer: it has 2 KV heads"):
        MultiHeadAttention(32, 4, 2).to_torch()


def test_weights_from_lse_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"lse has shape \(2, 4\) but q implies"):
        weights_from_lse(q, k, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"heads must be in \[0, 4\)"):
        weights_from_lse(q, k, torch.zeros(2, 4, 5), heads=[4])
