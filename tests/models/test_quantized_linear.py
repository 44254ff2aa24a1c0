"""QuantizedLinear / QuantizedEmbedding (models/linear.py) against F.linear and indexing on the
weight as the gguf package dequantizes it (independent of our decoders and kernels).

Both routes are forced: the PyTorch fallback (dequantize, F.linear: exact up to F.linear's own
rounding) and the kernel (kernels.quant: within the rounding of its int8 activations)."""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headwise import kernels
from headwise.models import linear
from headwise.models.blocks import RMSNorm, fused_linear
from headwise.models.linear import FORMATS, QuantizedEmbedding, QuantizedLinear, weight_bytes
from headwise.models.packing import pack_linears, prepack, unpack_linears

SHAPES = [(7, 32), (33, 96), (64, 256), (130, 512)]  # (O, I): odd row counts, 1..16 blocks of 32
K_SHAPES = [(7, 256), (33, 512)]  # the K-quants' blocks are 256 values


def make_blocks(fmt, O, I, seed=0):
    """Blocks as llama.cpp's quantizer writes them (q4_0, q4_1, q5_0, q5_1, q8_0) or random with
    sane f16 scales (the K-quants: gguf cannot quantize them)."""
    g = torch.Generator().manual_seed(seed)
    if fmt in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        w = torch.randn(O, I, generator=g) * 0.05
        return torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(FORMATS[fmt][0])))
    _, block, nbytes = FORMATS[fmt]
    b = torch.randint(0, 256, (O * I // block, nbytes), generator=g, dtype=torch.uint8)
    scales = (torch.rand(O * I // block, 2, generator=g) * 0.01).half().view(torch.uint8)  # (N, 4) bytes
    if fmt in ("q4_k", "q5_k"):  # d, dmin at bytes 0..3
        b[:, 0:4] = scales
    else:  # q6_k: d at bytes 208..209
        b[:, 208:210] = scales[:, 0:2]
    return b.reshape(O, -1).contiguous()


def reference_weight(blocks, fmt, O, I):
    """gguf's numpy dequantizer: the reference transformers uses too."""
    out = gguf.quants.dequantize(blocks.numpy().reshape(-1), gguf.GGMLQuantizationType(FORMATS[fmt][0]))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(O, I)


def cases():
    for fmt in FORMATS:
        for O, I in K_SHAPES if FORMATS[fmt][1] == 256 else SHAPES:
            yield fmt, O, I


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setattr(linear, "kernel_unavailable", lambda fmt: "forced off by the test")


@pytest.mark.parametrize("fmt,O,I", list(cases()))
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_fallback_is_flinear_on_the_dequantized_weight(fmt, O, I, rows, no_kernel):
    blocks = make_blocks(fmt, O, I)
    bias = torch.randn(O)
    lin = QuantizedLinear(I, O, fmt, bias=True, blocks=blocks)
    with torch.no_grad():
        lin.bias.copy_(bias)
    x = torch.randn(rows, I)
    w = reference_weight(blocks, fmt, O, I)
    assert torch.equal(lin.weight, w)  # our decoders are bit for bit gguf's
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(rounded_x(x), w, bias), rtol=1e-6, atol=1e-6)


def rounded_x(x):
    """x as the kernel rounds it before its integer dots (kernels/quant.py, tests/kernels):
    per 32 values d = amax / 127, q = round-half-even(x * (1 / d)), in fp32; back as q * d."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b * torch.where(d == 0, 0, 1 / d)) * d).reshape(x.shape)


@pytest.mark.parametrize("fmt,O,I", list(cases()))
def test_every_route_computes_the_same_rows(fmt, O, I):
    """A row's output does not depend on the route its step takes: the kernel (<= KERNEL_ROWS
    rows), dequantize + F.linear (more rows), or the PyTorch fallback agree to fp32 rounding."""
    lin = QuantizedLinear(I, O, fmt, blocks=make_blocks(fmt, O, I))
    x = torch.randn(kernels.KERNEL_ROWS + 6, I)
    with torch.no_grad():
        many = lin(x)  # one call of 70 rows: dequantize + F.linear
        few = torch.cat([lin(x[i : i + 5]) for i in range(0, len(x), 5)])  # the kernel
        size = rounded_x(x).abs() @ lin.weight.abs().T
    assert ((many - few).abs() <= 2e-6 * size + 1e-6).all()


def activation_bound(x, w, block):
    """|x W^T - x_q W^T| when x is rounded to int8 per `block` values (scale amax / 127: at most
    half a step, amax / 254, per value), plus fp32 accumulation."""
    xb = x.double().reshape(x.shape[0], -1, block)  # (M, nb, block)
    step = xb.abs().amax(-1) / 254  # (M, nb)
    wb = w.double().abs().reshape(w.shape[0], -1, block).sum(-1)  # (O, nb)
    return 1.05 * step @ wb.T + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6


def kernel_block(fmt):
    return FORMATS[fmt][1]  # the K-quants quantize x per 256 (q8_K), the others per 32 (q8_0/q8_1)


def test_the_kernel_runs_here():
    """This machine (x86-64, AVX2) builds headwise.kernels with the quantized kernels."""
    for fmt in FORMATS:
        assert linear.kernel_unavailable(fmt) is None


@pytest.mark.parametrize("fmt,O,I", list(cases()))
@pytest.mark.parametrize("rows", [1, 3, 16, kernels.KERNEL_ROWS])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_within_activation_rounding(fmt, O, I, rows, threads, monkeypatch):
    calls = []
    run = QuantizedLinear.run
    monkeypatch.setattr(QuantizedLinear, "run", staticmethod(lambda p, x, **k: calls.append(1) or run(p, x, **k)))
    blocks = make_blocks(fmt, O, I, seed=rows)
    lin = QuantizedLinear(I, O, fmt, blocks=blocks)
    x = torch.randn(rows, I)
    w = reference_weight(blocks, fmt, O, I)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            y = lin(x)
    finally:
        torch.set_num_threads(n)
    assert calls, "the kernel was not used"
    err = (y.double() - x.double() @ w.double().T).abs()
    assert (err <= activation_bound(x, w, kernel_block(fmt))).all(), err.max()


@pytest.mark.parametrize("tile", [linear.TILE_VALUES, 256 * 7])  # one tile, or 10 tiles of 7 rows (the last 1)
def test_many_rows_dequantize_tiles_and_keep_no_copy(monkeypatch, tile):
    monkeypatch.setattr(QuantizedLinear, "run", None)  # the kernel must not be called
    monkeypatch.setattr(linear, "TILE_VALUES", tile)
    blocks = make_blocks("q4_1", 64, 256)
    lin = QuantizedLinear(256, 64, "q4_1", bias=True, blocks=blocks)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(3, kernels.KERNEL_ROWS, 256)
    with torch.inference_mode():
        got = lin(x)
    want = F.linear(rounded_x(x.reshape(-1, 256)), reference_weight(blocks, "q4_1", 64, 256), lin.bias.detach())
    torch.testing.assert_close(got, want.view(3, -1, 64))
    assert [n for n, _ in lin.named_buffers()] == ["blocks"] and [n for n, _ in lin.named_parameters()] == ["bias"]


def test_gradients_reach_the_bias_and_the_input():
    """Training through a quantized layer (the bias, or whatever comes before it): the rounding
    of x passes gradients straight through, as if it were not there."""
    lin = QuantizedLinear(64, 8, "q8_0", bias=True, blocks=make_blocks("q8_0", 8, 64))
    x = torch.randn(100, 64, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(100, 64))
    torch.testing.assert_close(lin.bias.grad, torch.full((8,), 100.0))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q6_k"])
def test_fused_linear_prologues_and_residual(fmt):
    """The decoder block's few-rows call: RMSNorm or SwiGLU folded in before, a residual after;
    against the same ops in float64 on the dequantized weight."""
    I, O, M = 256, 96, 4
    lin = QuantizedLinear(I, O, fmt, blocks=make_blocks(fmt, O, I))
    w = reference_weight(lin.blocks, fmt, O, I)
    norm = RMSNorm(I, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(I) + 0.5)
        x, r, gu = torch.randn(M, I), torch.randn(M, O), torch.randn(M, 2 * I)
        assert lin.route_plan(x) is not None
        for got, h in (
            (fused_linear(lin, x, norm=norm, residual=r), norm(x)),
            (fused_linear(lin, gu, swiglu=True, residual=r), F.silu(gu[:, :I]) * gu[:, I:]),
        ):
            err = (got.double() - (h.double() @ w.double().T + r.double())).abs()
            assert (err <= activation_bound(h, w, kernel_block(fmt)) + 1e-5).all(), err.max()


def test_route_plan_refuses_what_the_kernel_cannot_take():
    lin = QuantizedLinear(256, 32, "q8_0", blocks=make_blocks("q8_0", 32, 256))
    assert lin.route_plan(torch.randn(kernels.KERNEL_ROWS, 256)) is not None
    assert lin.route_plan(torch.randn(kernels.KERNEL_ROWS + 1, 256)) is None
    assert lin.route_plan(torch.randn(2, 256, dtype=torch.bfloat16)) is None
    assert lin.route_plan(torch.randn(256, 2).t()) is None  # strided


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_embedding_gathers_dequantized_rows(fmt):
    V, C = 50, 256
    blocks = make_blocks(fmt, V, C)
    emb = QuantizedEmbedding(V, C, fmt, blocks=blocks)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(emb(ids), reference_weight(blocks, fmt, V, C)[ids])


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_packed_embedding_gathers_the_same_rows_one_id_or_many(fmt):
    """Packed in groups of 8 rows (as a tied head's kernel wants): a lookup of one id (a decode
    step) and of many give the dequantized rows; an id out of range is named."""
    V, C = 50, 256  # 50 rows: the last group holds 2
    blocks = make_blocks(fmt, V, C)
    emb = QuantizedEmbedding(V, C, fmt, blocks=blocks)
    if not emb.pack():
        pytest.fail(f"no packing here: {linear.kernel_unavailable(fmt)}")
    want = reference_weight(blocks, fmt, V, C)
    for i in (0, 7, 8, 13, 48, 49):
        assert torch.equal(emb(torch.tensor([[i]])), want[i].view(1, 1, C)), i
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(emb(ids), want[ids])
    for bad in (50, -1):
        with pytest.raises(IndexError, match=f"token id {bad} is out of range for an embedding of 50 rows"):
            emb(torch.tensor([[bad]]))


def test_tied_head_shares_the_embedding_blocks():
    emb = QuantizedEmbedding(64, 256, "q8_0", blocks=make_blocks("q8_0", 64, 256))
    head = QuantizedLinear.tied_to(emb)
    assert head.blocks is emb.blocks and (head.in_features, head.out_features) == (256, 64)
    model = torch.nn.ModuleDict({"embed": emb, "head": head})
    assert weight_bytes(model) == {"q8_0": emb.blocks.numel()}  # counted once


def test_weight_is_a_copy_repr_and_bytes():
    lin = QuantizedLinear(256, 8, "q4_0", blocks=make_blocks("q4_0", 8, 256))
    before = lin.blocks.clone()
    lin.weight.zero_()  # a copy: the blocks do not change
    assert torch.equal(lin.blocks, before)
    assert "fmt=q4_0" in repr(lin) and lin.weight_bytes() == 8 * 8 * 18


def test_bad_blocks_and_formats_are_named():
    with pytest.raises(ValueError, match=r"uint8 \(8, 144\)"):
        QuantizedLinear(256, 8, "q4_0", blocks=torch.zeros(8, 100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown quantized format 'q2_k'"):
        QuantizedLinear(256, 8, "q2_k")
    with pytest.raises(ValueError, match="not a multiple"):
        QuantizedLinear(100, 8, "q8_0")


def test_packing_leaves_quantized_linears_alone():
    model = torch.nn.Sequential(torch.nn.Linear(256, 8), QuantizedLinear(8 * 32, 4, "q8_0"))
    pack_linears(model)
    prepack(model)
    assert type(model[1]) is QuantizedLinear
    unpack_linears(model)
    assert type(model[1]) is QuantizedLinear and type(model[0]) is torch.nn.Linear


def test_models_import_and_run_without_the_extension(tmp_path):
    """The PyTorch fallback, and load says once that it will be used."""
    code = (
        "import sys, torch, headwise.models\n"
        "from headwise.models.linear import QuantizedLinear, kernel_unavailable\n"
        "lin = QuantizedLinear(32, 4, 'q8_0', blocks=torch.zeros(4, 34, dtype=torch.uint8))\n"
        "print(kernel_unavailable('q8_0') is not None, lin(torch.ones(2, 32)).abs().sum().item())\n"
        "import warnings, headwise\n"
        "from tests.models.test_gguf import write_tiny_llama\n"
        "write_tiny_llama(sys.argv[1])\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    headwise.load(sys.argv[1])\n"
        "print(sum('have no kernel here' in str(x.message) for x in w))\n"
    )
    env = {"HEADWISE_KERNELS": "0", "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-c", code, str(tmp_path / "tiny.gguf")]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "0.0", "1"]


@pytest.mark.parametrize("fmt", linear.PACKABLE)
@pytest.mark.parametrize("O", [8, 13, 70])  # whole groups of 8 rows, and a padded last group
def test_packed_layout_computes_the_same(fmt, O):
    """pack(): the same bytes in kernels.quant's 8-row groups; kernel, prefill (the kernel 64
    rows at a time on AVX2, dequantized tiles + GEMM elsewhere: both checked here), .weight, the
    embedding lookup and a tied head all give what the file layout gives."""
    import copy

    I = 256
    rows = QuantizedLinear(I, O, fmt, blocks=make_blocks(fmt, O, I))
    packed = copy.deepcopy(rows)
    assert packed.pack() and packed.packed and packed.blocks.shape == (-(-O // 8), 8 * rows.blocks.shape[1])
    assert torch.equal(packed.weight, rows.weight) and torch.equal(packed.file_blocks(), rows.blocks)
    # the K-quants' random sub-block scales and mins (up to 127 x d for Q6_K) make sums that cancel
    # much more than they keep, so the two layouts' float sums (in other orders) differ by up to
    # ~5e-5 there; each is within tests/kernels' float64 bound
    tol = 1.5e-4 if FORMATS[fmt][1] == 256 else 1e-5
    for n in (1, 5, kernels.KERNEL_ROWS + 3):
        x = torch.randn(n, I)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), rows(x), rtol=tol, atol=tol)
            torch.testing.assert_close(packed._tiled(x), packed._chunked(x), rtol=tol, atol=tol)
    emb = QuantizedEmbedding(O, I, fmt, blocks=rows.blocks.clone())
    ids = torch.tensor([[0, O - 1, O // 2], [1, 1, O - 2]])
    want = emb(ids)
    assert emb.pack() and torch.equal(emb(ids), want)
    head = QuantizedLinear.tied_to(emb)
    assert head.packed and head.blocks is emb.blocks


def test_pack_quantized_keeps_a_tied_head_on_one_buffer(tmp_path):
    import headwise
    from headwise.models.linear import pack_quantized
    from headwise.models.quantized_load import save

    from .test_gguf import write_tiny_llama

    write_tiny_llama(tmp_path / "t.gguf", tied=True)
    model = headwise.load(tmp_path / "t.gguf", weights="q8_0", pack=False)  # the file's row order
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        before = model(ids)
    assert pack_quantized(model) == 1 + 4 * model.config.num_layers
    assert model.lm_head.blocks is model.embed.blocks and model.embed.packed
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), before, rtol=0, atol=1e-3 * before.abs().max().item())
    back = headwise.load(save(model, tmp_path / "saved"), pack=False)  # saved in the file's layout
    assert not back.embed.packed and torch.equal(back.embed.blocks, model.embed.file_blocks())


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0"])
def test_mixed_fused_parts_become_q8_0_of_the_same_values(fmt):
    """q | k | v in Q5_0, Q5_0, Q8_0 (llama.cpp's Q4_K_M where widths are not multiples of 256):
    fused as Q8_0 blocks whose values gguf decodes exactly as it decodes the parts; a mix Q8_0
    cannot hold (Q4_1's offsets) stays fp32."""
    from headwise.models.quantized_load import QuantTensor, fuse_rows, mixed

    parts = [QuantTensor(make_blocks(f, O, 96, seed=O), f, (O, 96)) for f, O in ((fmt, 9), (fmt, 3), ("q8_0", 3))]
    fused = fuse_rows(parts)
    assert mixed(parts) is None and fused.fmt == "q8_0" and fused.shape == (15, 96)
    want = torch.cat([reference_weight(p.blocks, p.fmt, *p.shape) for p in parts])
    assert torch.equal(reference_weight(fused.blocks, "q8_0", 15, 96), want)
    odd = [parts[0], QuantTensor(make_blocks("q4_1", 3, 96), "q4_1", (3, 96))]
    assert mixed(odd) == f"{fmt}|q4_1" and fuse_rows(odd).dtype == torch.float32
