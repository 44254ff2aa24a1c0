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


def _float64_rows(rope, positions):
    """cos and sin (N, dim/2) of the same fp32 angles (pos * inv_freq), taken in float64."""
    angles = (positions.reshape(-1, 1).float() * rope.inv_freq).double()
    return angles.cos(), angles.sin()


def test_table_holds_cos_sin_of_every_position_and_follows_inv_freq():
    """RotaryEmbedding.table: rows 0 .. P - 1 of cos / sin, P >= what was asked (doubling from
    256), each the float64 value of its fp32 angle to fp32 rounding; a new or edited inv_freq
    makes a new table."""
    rope = RotaryEmbedding(24, base=500.0)
    cos, sin = rope.table(10)
    assert cos.shape == sin.shape == (256, 12) and cos.is_contiguous() and sin.is_contiguous()
    want_cos, want_sin = _float64_rows(rope, torch.arange(256))
    assert (cos.double() - want_cos).abs().max() <= 2e-7 and (sin.double() - want_sin).abs().max() <= 2e-7
    assert rope.table(256)[0] is cos  # kept
    assert rope.table(300)[0].shape == (512, 12)  # doubled
    assert rope.table(1500)[0].shape == (1500, 12)
    rope.inv_freq.mul_(0.5)  # edited in place: a new table of the new angles
    cos2, _ = rope.table(10)
    assert (cos2.double() - _float64_rows(rope, torch.arange(cos2.shape[0]))[0]).abs().max() <= 2e-7
    rope.inv_freq = rope.inv_freq * 2.0  # replaced (by the first numbers again)
    cos3, _ = rope.table(10)
    assert cos3 is not cos2 and torch.allclose(cos3[:256], cos, atol=2e-7)


def test_steps_take_rope_rows_from_the_table_as_cos_sin_gives_them():
    """Step.rope_rows from the table (positions known on the host) against cos_sin of the step's
    positions tensor, in float64: a contiguous cache's decode step of one sequence and of three
    (at a long position; its positions tensor made when asked, as the step was made), a ragged
    step (no run: cos_sin), and the engine's packed step."""
    from headwise.cache import ContiguousKVCache, PagedKVCache

    rope = RotaryEmbedding(16)

    def check(step):
        cos, sin = step.rope_rows(rope)
        pos = step.input_positions.reshape(-1)
        want_cos, want_sin = _float64_rows(rope, pos)
        assert cos.shape == (pos.numel(), 8) and cos.is_contiguous() and sin.is_contiguous()
        assert (cos.double() - want_cos).abs().max() <= 2e-7 and (sin.double() - want_sin).abs().max() <= 2e-7

    for B, L in ((1, 5), (3, 1200)):
        cache = ContiguousKVCache(1, B, 2, 1300, 16)
        kv = torch.zeros(B, 2, L, 16)
        cache.layer(0).update(kv, kv)
        step = cache.step(1)
        assert step.positions_run == (L, B, 1)
        new = torch.zeros(B, 2, 1, 16)
        cache.layer(0).update(new, new)  # the step's token written: its positions stay as made
        assert step.input_positions.tolist() == [[L]] * B
        check(step)
        check(cache.step(4))
    ragged = ContiguousKVCache(1, 2, 2, 64, 16)
    ragged.layer(0).update(torch.zeros(2, 2, 6, 16), torch.zeros(2, 2, 6, 16), torch.tensor([6, 3]))
    step = ragged.step(1)
    assert step.positions_run is None
    check(step)
    paged = PagedKVCache(1, 2, 16, num_blocks=16, block_size=4)
    paged.add_sequence("a", list(range(9)))
    paged.add_sequence("b", list(range(3)))
    step = paged.packed(["a", "b"], [9, 3])
    assert step.max_position == 8
    check(step)
