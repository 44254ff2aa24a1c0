"""RoPE against the complex-number formulation of the RoFormer paper / Meta's Llama."""

import torch

from headwise import RotaryEmbedding


def reference_rope_interleaved(x, positions, base=10000.0):
    """x (B, H, T, D): channel pairs (2i, 2i+1) as complex numbers, rotated by pos * theta_i."""
    D = x.shape[-1]
    theta = 1.0 / base ** (torch.arange(0, D, 2).double() / D)
    rot = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.double), positions.double()[:, None] * theta)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2))
    return torch.view_as_real(xc * rot).reshape(x.shape).float()


def test_interleaved_matches_complex_reference():
    x = torch.randn(2, 3, 11, 32)
    pos = torch.arange(5, 16)
    out = RotaryEmbedding(32, interleaved=True)(x, pos)
    assert (out - reference_rope_interleaved(x, pos)).abs().max() <= 1e-5


def test_halves_layout_is_a_permutation_of_interleaved():
    """HF's rotate_half layout equals the interleaved one after permuting channels (the
    permutation HF applies when converting Meta checkpoints)."""
    D = 16
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])  # interleaved -> halves
    x = torch.randn(1, 2, 7, D)
    pos = torch.arange(7)
    a = RotaryEmbedding(D, interleaved=True)(x, pos)[..., perm]
    b = RotaryEmbedding(D)(x[..., perm], pos)
    assert (a - b).abs().max() <= 1e-5


def test_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(64)
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)
    s = lambda m, n: (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()  # noqa: E731
    assert torch.allclose(s(3, 1), s(103, 101), atol=1e-4)
    assert torch.allclose(s(7, 7), (q * k).sum(), atol=1e-4)


def test_partial_rotary_leaves_the_rest():
    x = torch.randn(1, 2, 5, 32)
    out = RotaryEmbedding(16)(x, torch.arange(5))
    assert torch.equal(out[..., 16:], x[..., 16:])
