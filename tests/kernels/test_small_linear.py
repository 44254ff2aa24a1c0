"""headwise.kernels.small_linear against PyTorch's own ops (F.linear, F.rms_norm, F.silu)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from headwise import kernels


def lin(x, w, b=None, **kw):
    """small_linear with W given as its blocked copy, as PackedLinear passes it."""
    return kernels.small_linear(x, kernels.block_weight(w), w.shape[0], b, **kw)


def assert_close_to(got, x, w, b=None, r=None):
    """got against x @ w.T + b + r in float64, to within fp32's rounding of a dot product of
    that length (summation order differs from PyTorch's, so bits may differ)."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    size = F.linear(x.double().abs(), w.double().abs())  # sum_j |x_j w_ij|
    if r is not None:
        want, size = want + r.double(), size + r.double().abs()
    err = (got.double() - want).abs()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (err <= 1e-5 * size + 1e-6).all(), f"max error {err.max():.3g}"


def test_kernel_builds_and_runs_here():
    assert kernels.kernels_unavailable() is None  # x86-64 + AVX2 + gcc: this machine has all three
    assert len(kernels._omp_libraries()) == 1  # it joined torch's OpenMP pool, no second runtime


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 13, 16, kernels.KERNEL_ROWS])  # both tiles, their tails
@pytest.mark.parametrize("O,I", [(1, 1), (3, 7), (4, 8), (5, 9), (33, 64), (130, 100), (64, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(M, O, I, bias):
    x, w = torch.randn(M, I), torch.randn(O, I)
    b = torch.randn(O) if bias else None
    assert_close_to(lin(x, w, b), x, w, b)


@pytest.mark.parametrize("M", [1, 3, 9])
def test_residual_and_leading_dims(M):
    x, w, b, r = torch.randn(M, 1, 48), torch.randn(20, 48), torch.randn(20), torch.randn(M, 1, 20)
    got = lin(x, w, b, residual=r)
    assert got.shape == (M, 1, 20)
    assert_close_to(got, x, w, b, r)


@pytest.mark.parametrize("M,I", [(1, 576), (3, 37), (4, 64), (9, 576), (16, 300)])
def test_rmsnorm_prologue_equals_torch(M, I):
    x, w, nw = torch.randn(M, I) * 3, torch.randn(50, I), torch.rand(I) + 0.5
    got = lin(x, w, prologue=kernels.PRO_RMSNORM, norm_weight=nw, eps=1e-5)
    normed = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-5) * nw.double()
    assert_close_to(got, normed, w)
    torch.testing.assert_close(got, F.linear(F.rms_norm(x, (I,), nw, eps=1e-5), w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("M,I", [(1, 96), (2, 13), (4, 1536), (7, 1536)])
def test_swiglu_prologue_equals_torch(M, I):
    gu, w, r = torch.randn(M, 2 * I) * 4, torch.randn(30, I), torch.randn(M, 30)
    gate, up = gu.chunk(2, dim=-1)
    got = lin(gu, w, residual=r, prologue=kernels.PRO_SWIGLU)
    assert_close_to(got, F.silu(gate.double()) * up.double(), w, r=r)


@pytest.mark.parametrize("M", [2, 16])  # both tiles
def test_same_bits_at_any_thread_count(M):
    """Each output row is one thread's dot product: the thread count cannot change a bit."""
    x, w = torch.randn(M, 576), torch.randn(3000, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x, w)
        torch.set_num_threads(2)
        two = lin(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("M", [8, 16, 40])  # the tiles that prefetch, one and several row groups
def test_prefetch_distance_changes_no_bit(M):
    """The distance set per CPU at load (prefetch_ahead_for) only moves loads earlier: any distance,
    even none or one past the weight's end, gives the same bits, and those equal F.linear."""
    mod, _ = kernels._ext()
    x, w = torch.randn(M, 576), torch.randn(1000, 576)
    picked = mod.prefetch_ahead(-1)
    assert picked == kernels.cpu.prefetch_ahead_for()
    try:
        outs = []
        for d in (0, 32, 64, 128, 4096):
            mod.prefetch_ahead(d)
            outs.append(lin(x, w))
    finally:
        mod.prefetch_ahead(picked)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert_close_to(outs[0], x, w)
    with pytest.raises(ValueError, match="4096"):
        mod.prefetch_ahead(5000)


def test_prefetch_distance_by_cpu_and_environment(monkeypatch):
    monkeypatch.delenv("HEADWISE_PREFETCH_AHEAD", raising=False)
    assert (
        kernels.cpu.prefetch_ahead_for("AuthenticAMD", "26") == kernels.cpu.PREFETCH_AHEAD_BY_CPU["AuthenticAMD", "26"]
    )
    assert kernels.cpu.prefetch_ahead_for("GenuineIntel", "6") == kernels.cpu.PREFETCH_AHEAD_DEFAULT
    monkeypatch.setenv("HEADWISE_PREFETCH_AHEAD", "96")
    assert kernels.cpu.prefetch_ahead_for("AuthenticAMD", "26") == 96
    monkeypatch.setenv("HEADWISE_PREFETCH_AHEAD", "far")
    with pytest.raises(ValueError, match="HEADWISE_PREFETCH_AHEAD"):
        kernels.cpu.prefetch_ahead_for()
    monkeypatch.delenv("HEADWISE_QUANT_PREFETCH_AHEAD", raising=False)
    zen5 = kernels.cpu.QUANT_PREFETCH_AHEAD_BY_CPU["AuthenticAMD", "26"]
    assert kernels.cpu.quant_prefetch_ahead_for("AuthenticAMD", "26") == zen5
    assert kernels.cpu.quant_prefetch_ahead_for("AuthenticAMD", "25") == kernels.cpu.QUANT_PREFETCH_AHEAD_DEFAULT
    intel = kernels.cpu.QUANT_PREFETCH_AHEAD_BY_CPU["GenuineIntel", "6"]
    assert kernels.cpu.quant_prefetch_ahead_for("GenuineIntel", "6") == intel
    monkeypatch.delenv("HEADWISE_ZMM_MIN_ROWS", raising=False)
    assert kernels.cpu.zmm_min_rows_for("GenuineIntel", "6") == kernels.cpu.ZMM_MIN_ROWS_BY_CPU["GenuineIntel", "6"]
    assert kernels.cpu.zmm_min_rows_for("AuthenticAMD", "26") == kernels.cpu.ZMM_MIN_ROWS_DEFAULT
    monkeypatch.setenv("HEADWISE_ZMM_MIN_ROWS", "65")
    assert kernels.cpu.zmm_min_rows_for("GenuineIntel", "6") == 65
    for bad in ("0", "66", "few"):
        monkeypatch.setenv("HEADWISE_ZMM_MIN_ROWS", bad)
        with pytest.raises(ValueError, match="HEADWISE_ZMM_MIN_ROWS"):
            kernels.cpu.zmm_min_rows_for()
    monkeypatch.delenv("HEADWISE_ZMM_MIN_ROWS")
    monkeypatch.setenv("HEADWISE_QUANT_PREFETCH_AHEAD", "4096")
    assert kernels.cpu.quant_prefetch_ahead_for("AuthenticAMD", "26") == 4096
    monkeypatch.setenv("HEADWISE_QUANT_PREFETCH_AHEAD", "99999")
    with pytest.raises(ValueError, match="HEADWISE_QUANT_PREFETCH_AHEAD"):
        kernels.cpu.quant_prefetch_ahead_for()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (torch.randn(1, 8).half(), torch.randn(4, 8)), "fp32"),
        (lambda: (torch.randn(8, 3).t(), torch.randn(4, 8)), "strided"),
        (lambda: (torch.randn(1, 9), torch.randn(4, 8)), "does not fit"),
        (lambda: (torch.randn(kernels.KERNEL_ROWS + 1, 8), torch.randn(4, 8)), "more than"),
    ],
)
def test_bad_input_is_refused(make, match):
    x, w = make()
    with pytest.raises(ValueError, match=match):
        lin(x, w)


def test_bad_residual_blocked_weight_and_norm_weight_are_refused():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="residual"):
        lin(x, w, residual=torch.randn(2, 3))
    with pytest.raises(ValueError, match="norm_weight"):
        lin(x, w, prologue=kernels.PRO_RMSNORM, norm_weight=torch.randn(7))
    with pytest.raises(ValueError, match="block_weight"):
        kernels.small_linear(x, w, 4)  # the plain weight, not its blocked copy
    with pytest.raises(ValueError, match="block_weight"):
        kernels.small_linear(x, kernels.block_weight(w), 12)  # blocks for 4 rows, asked for 12


def test_block_layout():
    w = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    blocked = kernels.block_weight(w)
    assert blocked.shape == (2, 3, 8)
    assert torch.equal(blocked[1, 2, :2], w[8:, 2]) and not blocked[1, :, 2:].any()  # rows past 10 are 0
    assert torch.equal(blocked[0].t(), w[:8])


def test_switched_off_by_environment():
    code = "from headwise import kernels; print(kernels.kernels_unavailable())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HEADWISE_KERNELS": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "HEADWISE_KERNELS=0" in out


@pytest.mark.parametrize("M", [1, 3, 9])
@pytest.mark.parametrize("heads,D,extra", [(12, 64, 192), (2, 8, 0), (3, 16, 5)])
def test_rope_epilogue_equals_the_rope_module(M, heads, D, extra):
    """RoPE folded into the matmul == the linear, then RotaryEmbedding (torch ops) on the rotated heads;
    the columns after them (v) untouched."""
    from headwise.attention.rope import RotaryEmbedding

    I = 40
    x, w = torch.randn(M, I), torch.randn(heads * D + extra, I)
    rope = RotaryEmbedding(D)
    pos = torch.randint(0, 4000, (M,))
    cos, sin = (t.reshape(M, D // 2).contiguous() for t in rope.cos_sin(pos[:, None]))  # (M, 1, 1, D/2) each
    got = lin(x, w, rope=(cos, sin, heads * D, D))
    plain = F.linear(x, w)  # (M, O)
    heads_in = plain[:, : heads * D].reshape(M, heads, 1, D)  # (B=M, H, T=1, D)
    want_rot = rope(heads_in, pos[:, None]).reshape(M, heads * D)
    torch.testing.assert_close(got[:, : heads * D], want_rot, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[:, heads * D :], plain[:, heads * D :], atol=1e-4, rtol=1e-4)


def test_rope_with_wrong_tables_is_refused():
    x, w = torch.randn(2, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="rope needs cos and sin"):
        lin(x, w, rope=(torch.randn(2, 3), torch.randn(2, 3), 16, 8))  # tables of 3, heads of 8 want 4
    with pytest.raises(ValueError, match="whole heads"):
        lin(x, w, rope=(torch.randn(2, 4), torch.randn(2, 4), 12, 8))  # 12 columns: not whole heads
