"""Value-weighted norms against nn.MultiheadAttention's own weights, rollout and the
"hints, not explanations" measurement on hand-made patterns."""

import torch

from headwise.analysis import Capture, attached, rollout, value_norms, weighted_norms
from headwise.analysis.attribution import HINT_RATIO, HintAccumulator
from headwise.attention import MultiHeadAttention


@torch.no_grad()
def test_value_weighted_norms_match_the_formula_on_torch_mha():
    torch.manual_seed(0)
    C, H, D = 16, 4, 4
    mha = torch.nn.MultiheadAttention(C, H, batch_first=True).eval()
    for p in mha.parameters():
        p.normal_(0, 0.5)
    ours = MultiHeadAttention.from_torch(mha)
    x = torch.randn(2, 5, C)
    cap = Capture(("pattern", "v"))
    with attached(ours, capture=cap):
        ours(x)
    got = weighted_norms(cap.pattern[0], value_norms(ours, cap.v[0]))  # (B, H, T, S)

    _, a = mha(x, x, x, need_weights=True, average_attn_weights=False)  # PyTorch's weights
    w_v, b_v = mha.in_proj_weight[2 * C :], mha.in_proj_bias[2 * C :]
    w_o = mha.out_proj.weight
    want = torch.empty(2, H, 5, 5)
    for b in range(2):
        for h in range(H):
            rows = slice(h * D, (h + 1) * D)
            for j in range(5):
                f = w_o[:, rows] @ (w_v[rows] @ x[b, j] + b_v[rows])  # f_h(x_j), (C,)
                for i in range(5):
                    want[b, h, i, j] = (a[b, h, i, j] * f).norm()
    assert torch.allclose(cap.pattern[0], a, atol=1e-6)
    assert torch.allclose(got, want, atol=1e-5)


def test_rollout_follows_the_paper():
    T = 4
    eye = torch.eye(T)[None, None]  # (1, 1, T, T)
    uniform = torch.full((1, 2, T, T), 1 / T)
    # a layer that attends only to itself changes nothing
    assert torch.allclose(rollout([eye, eye]), torch.eye(T)[None])
    # one layer: 0.5 I + 0.5 mean over heads
    assert torch.allclose(rollout([uniform]), 0.5 * torch.eye(T) + 0.5 / T)
    # layers compose by matrix product, last layer on the left
    a1 = torch.softmax(torch.randn(1, 3, T, T), -1)
    a2 = torch.softmax(torch.randn(1, 3, T, T), -1)
    r1 = 0.5 * torch.eye(T) + 0.5 * a1.mean(1)
    r2 = 0.5 * torch.eye(T) + 0.5 * a2.mean(1)
    assert torch.allclose(rollout([a1, a2]), r2 @ r1, atol=1e-6)
    assert torch.allclose(rollout([a1, a2]).sum(-1), torch.ones(1, T))


def test_hint_flag_catches_a_heavily_attended_token_with_no_value():
    """Head 0 puts 0.8 of every row on token 0, whose value vector is zero: its top token
    explains nothing (flagged). Head 1 has the same weights but equal value norms everywhere:
    the weight share is the norm share (ratio 1)."""
    T, D, C = 5, 4, 8
    layer = MultiHeadAttention(C, 2, head_dim=D)
    torch.nn.init.eye_(layer.out_proj.weight)  # W_O = [I | 0]-ish: norms pass through
    p = torch.full((1, 2, T, T), 0.2 / (T - 1))
    p[..., 0] = 0.8
    v = torch.ones(1, 2, T, D)
    v[0, 0, 0] = 0.0  # head 0: token 0 carries nothing
    acc = HintAccumulator([2])
    acc.add(0, layer, p, v, torch.ones(1, T, dtype=torch.bool))
    res = acc.result()
    assert torch.allclose(res.top_weight[0], torch.tensor([0.8, 0.8]))
    assert res.top_norm_share[0][0] == 0 and abs(float(res.top_norm_share[0][1]) - 0.8) < 1e-6
    assert res.flagged[0].tolist() == [True, False]
    assert float(res.ratio[0][1]) > HINT_RATIO
