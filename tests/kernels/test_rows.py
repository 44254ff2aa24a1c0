"""kernels.rms_norm / swiglu / rope_ (csrc/generic/rows.c), the prefill's RMSNorm, SwiGLU and RoPE, against PyTorch's ops
and the RotaryEmbedding module; PackedLinear.forward_add against F.linear + residual."""

import pytest
import torch
import torch.nn.functional as F

from headwise import kernels
from headwise.attention.rope import RotaryEmbedding
from headwise.models.packing import PackedLinear


@pytest.mark.parametrize("M,I", [(1, 96), (7, 13), (8, 1536), (9, 1536), (513, 1536), (100, 5)])
def test_swiglu_equals_torch(M, I):
    """Every row split (one task of 8 rows, a tail, many), odd widths (the scalar tail of 8 lanes)."""
    gu = torch.randn(M, 2 * I, generator=torch.Generator().manual_seed(M + I)) * 4
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate.double()) * up.double()
    got = kernels.swiglu(gu)
    assert got.shape == (M, I) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_swiglu_keeps_leading_dims_and_refuses_what_it_cannot_take():
    gu = torch.randn(2, 3, 10)
    torch.testing.assert_close(kernels.swiglu(gu), F.silu(gu[..., :5]) * gu[..., 5:], rtol=1e-5, atol=1e-6)
    for bad in (
        torch.randn(4, 9),
        torch.randn(4, 10).double(),
        torch.randn(10, 4).t(),
        torch.randn(4, 10, requires_grad=True),
    ):
        assert not (kernels.rows_kernels_take(bad) and bad.shape[-1] % 2 == 0)
        with pytest.raises(ValueError, match="swiglu needs"):
            kernels.swiglu(bad)


@pytest.mark.parametrize("M,I", [(1, 576), (9, 37), (300, 576), (2, 1)])
def test_rms_norm_equals_torch(M, I):
    x = torch.randn(M, I, generator=torch.Generator().manual_seed(M)) * 3
    w = torch.rand(I) + 0.5
    want = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-5) * w.double()
    got = kernels.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (I,), w, eps=1e-5), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rms_norm needs"):
        kernels.rms_norm(x, torch.rand(I + 1), 1e-5)


@pytest.mark.parametrize("M", [1, 8, 9, 300])
@pytest.mark.parametrize("heads,D,extra", [(12, 64, 192), (2, 8, 0), (3, 16, 5)])
def test_rope_equals_the_rope_module(M, heads, D, extra):
    """In place on the first heads * D columns, each row at its own position; the rest untouched."""
    rope = RotaryEmbedding(D)
    pos = torch.randint(0, 4000, (M,), generator=torch.Generator().manual_seed(M))
    cos, sin = (t.reshape(M, D // 2).contiguous() for t in rope.cos_sin(pos[:, None]))
    y = torch.randn(M, heads * D + extra)
    before = y.clone()
    out = kernels.rope_(y, cos, sin, heads * D, D)
    assert out is y
    want = rope(before[:, : heads * D].reshape(M, heads, 1, D), pos[:, None]).reshape(M, heads * D)
    torch.testing.assert_close(y[:, : heads * D], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(y[:, heads * D :], before[:, heads * D :])


def test_rope_with_wrong_tables_is_refused():
    y = torch.randn(2, 16)
    with pytest.raises(ValueError, match="rope_ needs"):
        kernels.rope_(y, torch.randn(2, 3), torch.randn(2, 3), 16, 8)  # tables of 3, heads of 8 want 4
    with pytest.raises(ValueError, match="rope_ needs"):
        kernels.rope_(y, torch.randn(2, 4), torch.randn(2, 4), 12, 8)  # 12 columns: not whole heads
    with pytest.raises(ValueError, match="rope_ needs"):
        kernels.rope_(y, torch.randn(3, 4), torch.randn(3, 4), 16, 8)  # 3 rows of angles for 2 rows


@pytest.mark.parametrize("rows", [3, 65, 300])  # the small-row kernel's rows, and oneDNN's with its post-op
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_forward_add_equals_f_linear_plus_residual(rows, bias):
    lin = torch.nn.Linear(96, 40, bias=bias)
    want_w, want_b = lin.weight.clone(), None if lin.bias is None else lin.bias.clone()
    lin.__class__ = PackedLinear
    x, r = torch.randn(rows, 96), torch.randn(rows, 40)
    got = lin.forward_add(x, r)
    torch.testing.assert_close(got, F.linear(x, want_w, want_b) + r, rtol=1e-4, atol=1e-4)
    strided = torch.randn(40, rows).t()  # not contiguous: the plain add
    torch.testing.assert_close(lin.forward_add(x, strided), F.linear(x, want_w, want_b) + strided, rtol=1e-4, atol=1e-4)
