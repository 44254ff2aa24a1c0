"""MultiHeadAttention against PyTorch's own modules and the seed's textbook module."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headwise import MultiHeadAttention
from headwise.cache import CacheRead


class SeedMultiHeadAttention(nn.Module):
    """The module exactly as the seed text writes it: the independent reference."""

    def __init__(self, d_model, num_heads, dropout=0.1):
        super().__init__()
        self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.w_v = nn.Linear(d_model, d_model, bias=False)
        self.w_o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        b = q.size(0)
        q = self.w_q(q).view(b, -1, self.num_heads, self.d_k).transpose(1, 2)
        k = self.w_k(k).view(b, -1, self.num_heads, self.d_k).transpose(1, 2)
        v = self.w_v(v).view(b, -1, self.num_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.d_k**0.5)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(b, -1, self.d_model)
        return self.w_o(out)


BACKENDS = ["auto", "sdpa", "chunked", "math"]


def _err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_from_torch_matches_nn_multihead_attention(bias, backend):
    mha = nn.MultiheadAttention(64, 8, bias=bias, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(mha, backend=backend).eval()
    x = torch.randn(3, 10, 64)
    kpm = torch.zeros(3, 10, dtype=torch.bool)
    kpm[1, 6:] = True
    blocked = torch.rand(10, 10) > 0.7  # nn.MultiheadAttention: True = masked out
    blocked.fill_diagonal_(False)
    with torch.no_grad():
        assert _err(mha(x, x, x, need_weights=False)[0], ours(x)) <= 1e-5
        ref = mha(x, x, x, key_padding_mask=kpm, attn_mask=blocked, need_weights=False)[0]
        assert _err(ref, ours(x, key_padding_mask=kpm, attn_mask=~blocked)) <= 1e-5
        float_mask = torch.randn(10, 10)
        assert _err(mha(x, x, x, attn_mask=float_mask)[0], ours(x, attn_mask=float_mask)) <= 1e-5
        per_head = torch.rand(3 * 8, 10, 10) > 0.8  # torch's (B*H, T, S) layout
        per_head[:, torch.arange(10), torch.arange(10)] = False
        assert _err(mha(x, x, x, attn_mask=per_head)[0], ours(x, attn_mask=~per_head)) <= 1e-5
        causal = nn.Transformer.generate_square_subsequent_mask(10)
        assert _err(mha(x, x, x, attn_mask=causal, is_causal=True)[0], ours(x, is_causal=True)) <= 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_need_weights_matches_per_head_weights(bias):
    mha = nn.MultiheadAttention(48, 6, bias=bias, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(mha).eval()
    x, mem = torch.randn(2, 5, 48), torch.randn(2, 9, 48)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[0, 7:] = True
    with torch.no_grad():
        ref, ref_w = mha(x, mem, mem, key_padding_mask=kpm, average_attn_weights=False)
        out, w = ours(x, mem, key_padding_mask=kpm, need_weights=True)
    assert w.shape == (2, 6, 5, 9)
    assert _err(ref, out) <= 1e-5 and _err(ref_w, w) <= 1e-5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_with_kdim_vdim(bias, backend):
    mha = nn.MultiheadAttention(64, 4, bias=bias, kdim=24, vdim=40, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(mha, backend=backend).eval()
    x, k, v = torch.randn(2, 5, 64), torch.randn(2, 7, 24), torch.randn(2, 7, 40)
    kpm = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    with torch.no_grad():
        ref = mha(x, k, v, key_padding_mask=kpm)[0]
        assert _err(ref, ours(x, k, v, key_padding_mask=kpm)) <= 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_to_torch_round_trip(bias):
    ours = MultiHeadAttention(64, 8, bias=bias).eval()
    if bias:
        nn.init.normal_(ours.qkv_proj.bias)
        nn.init.normal_(ours.out_proj.bias)
    mha = ours.to_torch().eval()
    x, mem = torch.randn(2, 6, 64), torch.randn(2, 11, 64)
    with torch.no_grad():
        assert _err(mha(x, x, x)[0], ours(x)) <= 1e-5
        assert _err(mha(x, mem, mem)[0], ours(x, mem)) <= 1e-5  # cross attention, fused weights
        back = MultiHeadAttention.from_torch(mha)
    for a, b in zip(ours.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_projections_from_seed_module(backend):
    seed = SeedMultiHeadAttention(96, 12).eval()
    ours = MultiHeadAttention(96, 12, backend=backend).load_projections(seed.w_q, seed.w_k, seed.w_v, seed.w_o).eval()
    x = torch.randn(2, 16, 96)
    causal = torch.tril(torch.ones(16, 16))
    with torch.no_grad():
        assert _err(seed(x, x, x), ours(x)) <= 1e-5
        assert _err(seed(x, x, x, mask=causal), ours(x, is_causal=True)) <= 1e-5


def test_parameter_counts():
    C = 128
    assert sum(p.numel() for p in MultiHeadAttention(C, 8).parameters()) == 4 * C * C  # the seed's 4*C^2
    H, Hkv = 8, 2
    n = sum(p.numel() for p in MultiHeadAttention(C, H, Hkv).parameters())
    assert n == 2 * C * C + 2 * C * C * Hkv // H  # GQA
    linears = [nn.Linear(C, C), nn.Linear(C, C * Hkv // H), nn.Linear(C, C * Hkv // H), nn.Linear(C, C)]
    assert n == sum(lin.weight.numel() for lin in linears)  # four textbook Linears


def test_gqa_layer_equals_mha_with_repeated_kv_heads():
    """A GQA layer is an MHA layer whose K/V weights repeat each KV head for its group."""
    gqa = MultiHeadAttention(64, 8, 2).eval()
    mha = MultiHeadAttention(64, 8).eval()
    wq, wk, wv, wo = gqa.projection_weights()
    rep = lambda w: w.view(2, 8, 64).repeat_interleave(4, dim=0).reshape(64, 64)  # noqa: E731
    mha.load_projections(wq, rep(wk), rep(wv), wo)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        assert _err(gqa(x, is_causal=True), mha(x, is_causal=True)) <= 1e-5


@pytest.mark.parametrize(
    "H,Hkv,remove",
    [
        (8, 8, [1, 4, 5]),  # MHA
        (8, 2, [0, 1, 2, 3]),  # GQA: a whole KV group goes
        (9, 3, [0, 4]),  # GQA: query heads within groups (uneven groups remain)
        (6, 1, [2, 5]),  # MQA
    ],
)
def test_prune_heads_equals_zeroing_them(H, Hkv, remove):
    m = MultiHeadAttention(48, H, Hkv, head_dim=8, bias=True).eval()
    for p in m.parameters():
        nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 48)
    keep = torch.ones(H)
    keep[remove] = 0
    with torch.no_grad():
        ref = m(x, is_causal=True, head_mask=keep)
        before = sum(p.numel() for p in m.parameters())
        m.prune_heads(remove)
        out = m(x, is_causal=True)
    assert _err(ref, out) <= 1e-5
    assert m.num_heads == H - len(remove)
    assert m.out_proj.weight.shape == (48, (H - len(remove)) * 8)
    dropped_kv = Hkv - m.num_kv_heads
    assert before - sum(p.numel() for p in m.parameters()) == len(remove) * 8 * (48 + 1) + len(
        remove
    ) * 8 * 48 + dropped_kv * 2 * 8 * (48 + 1)
    m.prune_heads(remove)  # already pruned: nothing changes
    assert m.num_heads == H - len(remove)


def test_head_mask_gives_gradients_for_importance():
    m = MultiHeadAttention(32, 4).eval()
    mask = torch.ones(4, requires_grad=True)
    m(torch.randn(2, 5, 32), head_mask=mask).square().sum().backward()
    assert mask.grad is not None and mask.grad.abs().sum() > 0


def test_dropout_only_in_training():
    m = MultiHeadAttention(32, 4, dropout=0.5)
    x = torch.randn(2, 5, 32)
    m.eval()
    assert torch.equal(m(x), m(x))
    m.train()
    assert not torch.equal(m(x), m(x))


class _TinyCache:
    """A minimal cache honouring the protocol (preallocated, uniform lengths)."""

    def __init__(self, B, Hkv, D, T_max):
        self.k = torch.zeros(B, Hkv, T_max, D)
        self.v = torch.zeros(B, Hkv, T_max, D)
        self.len = 0

    def positions(self, num_new):
        return torch.arange(self.len, self.len + num_new)[None]

    def update(self, k, v, num_new=None):
        T = k.shape[2]
        self.k[:, :, self.len : self.len + T] = k
        self.v[:, :, self.len : self.len + T] = v
        self.len += T
        return CacheRead(self.k[:, :, : self.len], self.v[:, :, : self.len])


@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_through_cache_protocol_equals_full_pass(H, Hkv, backend):
    m = MultiHeadAttention(64, H, Hkv, rope=True, backend=backend).eval()
    x = torch.randn(2, 12, 64)
    with torch.no_grad():
        full = m(x, is_causal=True)
        cache = _TinyCache(2, Hkv, 64 // H, 16)
        steps = [m(x[:, :5], is_causal=True, cache=cache)]  # chunked prefill, then decode
        steps += [m(x[:, t : t + 1], is_causal=True, cache=cache) for t in range(5, 12)]
    assert _err(torch.cat(steps, dim=1), full) <= 1e-5
