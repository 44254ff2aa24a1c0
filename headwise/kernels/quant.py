"""Linear layers from GGML-quantized weights as stored in a GGUF file (issue 14): quant_linear.c.

`run_quant(plan_quant(blocks, "q4_1", O, I), x)` is `F.linear(x, W)` for up to KERNEL_ROWS rows
of fp32 x, computed from W's blocks (a uint8 tensor (O, row_bytes), the bytes the file holds)
without an fp32 copy: each row of x is quantized to int8 per 32 values and dotted with the
weight blocks in integers, llama.cpp's method (ggml_vec_dot_q4_1_q8_1), so the result carries
that rounding of x (about 0.4% of a block's largest |x|) on top of the weight's own. The
keywords are `run_linear`'s: an RMSNorm / SwiGLU prologue, a residual and a RoPE epilogue.

`dequantize` gives the fp32 matrix (prefill: a fp32 GEMM on it) and `quantize` makes Q8_0 /
Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks from fp32 (int8 / int4 weights at load time), both bit for bit what
the `gguf` package computes, and Q4_K / Q5_K / Q6_K blocks by ggml's reference quantizers (which gguf
lacks). `quant_unavailable(fmt)` says why the kernel cannot run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..core.formats import PACKABLE, QUANT_FORMATS
from . import PRO_NONE, _ext, check_call
from .hugepages import huge_empty

FORMATS = QUANT_FORMATS  # name -> (GGML type id, values per block, bytes per block): headwise/core/formats.py
QUANTIZE_FORMATS = tuple(FORMATS)  # what `quantize` makes: every format
# PACKABLE (headwise/core/formats.py): the formats `pack_rows` stores in groups of 8 rows, the layout the
# kernel reads fastest (benchmarks/packed_formats.py: 1.4-7.7x at 1 row of x, AMD EPYC Zen 5).
_X8 = 0x100  # quant_linear.c's X8: a format id | _X8 is that format packed


def _format(fmt: str) -> tuple[int, int, int]:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; headwise computes from {', '.join(FORMATS)}")
    return FORMATS[fmt]


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one weight row of in_features values (a whole number of blocks)."""
    _, values, nbytes = _format(fmt)
    if in_features <= 0 or in_features % values:
        raise ValueError(f"{fmt}: in_features={in_features} is not a positive multiple of its {values}-value block")
    return in_features // values * nbytes


def quant_unavailable(fmt: str) -> str | None:
    """None when run_quant can compute from `fmt` weights here, else why not."""
    if fmt not in FORMATS:
        return f"unknown quantized format {fmt!r} (headwise's kernels: {', '.join(FORMATS)})"
    mod, why = _ext()
    if why is not None:
        return why
    if not hasattr(mod, "quant_linear"):
        return f"{mod.__name__} was built without the quantized kernels (quant_linear.c); reinstall headwise"
    return None


def _module():
    mod, why = _ext()
    why = why or (None if hasattr(mod, "quant_linear") else "the extension lacks quant_linear.c; reinstall headwise")
    if why is not None:
        raise RuntimeError(f"the quantized kernels are unavailable: {why}")
    return mod


def _blocks_ok(blocks: Tensor, fmt: str, out_features: int, in_features: int, packed: bool = False) -> None:
    if packed and fmt not in PACKABLE:
        raise ValueError(f"{fmt} has no packed layout; pack_rows takes {', '.join(PACKABLE)}")
    nbytes = row_bytes(fmt, in_features)
    want = (-(-out_features // 8), 8 * nbytes) if packed else (out_features, nbytes)
    if not (blocks.dtype is torch.uint8 and blocks.is_cpu and blocks.is_contiguous() and tuple(blocks.shape) == want):
        what = "pack_rows() groups" if packed else "blocks"
        raise ValueError(
            f"{fmt} weight of ({out_features}, {in_features}) needs contiguous uint8 CPU {what} of shape {want} "
            f"(row bytes = in_features / block values * block bytes); got {blocks.dtype} {tuple(blocks.shape)}"
            f"{'' if blocks.is_contiguous() else ' strided'} on {blocks.device}"
        )


def pack_rows(blocks: Tensor, fmt: str, out_features: int, in_features: int) -> Tensor:
    """Q4_0 / Q4_1 / Q8_0 blocks (O, row_bytes) -> the same bytes in groups of 8 rows, (ceil(O / 8),
    8 row_bytes) (the last group padded with zero rows), the layout run_quant reads fastest:
    plan it with `plan_quant(..., packed=True)`. `unpack_rows` undoes it bit for bit. The groups sit
    in 2 MiB pages where the OS allows (kernels/hugepages.py): a decode step reads all of them."""
    _blocks_ok(blocks, fmt, out_features, in_features)
    if fmt not in PACKABLE:
        raise ValueError(f"{fmt} has no packed layout; pack_rows takes {', '.join(PACKABLE)}")
    groups = -(-out_features // 8)
    out = huge_empty(groups * 8 * blocks.shape[1]).view(groups, 8 * blocks.shape[1])  # read every token: 2 MiB pages
    _module().repack8(FORMATS[fmt][0], blocks.data_ptr(), out.data_ptr(), out_features, in_features, 1)
    return out


def unpack_rows(packed: Tensor, fmt: str, out_features: int, in_features: int) -> Tensor:
    """`pack_rows`' groups -> the file's (O, row_bytes) blocks."""
    _blocks_ok(packed, fmt, out_features, in_features, packed=True)
    out = torch.empty(out_features, row_bytes(fmt, in_features), dtype=torch.uint8)
    _module().repack8(FORMATS[fmt][0], packed.data_ptr(), out.data_ptr(), out_features, in_features, 0)
    return out


class QuantPlan(NamedTuple):
    """A quantized weight checked once for run_quant: its blocks (kept alive here), sizes, pointers."""

    blocks: Tensor
    fmt: str
    out_features: int
    in_features: int
    bias: Tensor | None
    packed: bool
    fmt_id: int
    weight_ptr: int
    bias_ptr: int | None


def plan_quant(
    blocks: Tensor, fmt: str, out_features: int, in_features: int, bias: Tensor | None = None, *, packed: bool = False
) -> QuantPlan:
    """Check a weight's blocks (uint8 (O, row_bytes), as the GGUF stores them; with packed=True
    `pack_rows()` of them) and bias once."""
    fmt_id = _format(fmt)[0] | (_X8 if packed else 0)
    _blocks_ok(blocks, fmt, out_features, in_features, packed)
    if bias is not None and not (_ok(bias) and bias.numel() == out_features):
        raise ValueError(
            f"{fmt} linear needs a contiguous fp32 CPU bias of {out_features}; got {bias.dtype} {tuple(bias.shape)}"
        )
    bias_ptr = None if bias is None else bias.data_ptr()
    return QuantPlan(blocks, fmt, out_features, in_features, bias, packed, fmt_id, blocks.data_ptr(), bias_ptr)


def run_quant(
    plan: QuantPlan,
    x: Tensor,
    *,
    residual: Tensor | None = None,
    prologue: int = PRO_NONE,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    rope: tuple[Tensor, Tensor, int, int] | None = None,
) -> Tensor:
    """prologue(x) @ W.T + bias + residual (+ RoPE) from a planned quantized W, x (..., I) fp32
    (or (..., 2I) = [gate | up] with PRO_SWIGLU), at most KERNEL_ROWS rows. The keywords are
    kernels.run_linear's. No autograd: for inference."""
    mod = _module()
    O, I = plan.out_features, plan.in_features
    M, cos, sin, cols, head_dim = check_call(f"{plan.fmt} linear", O, I, x, residual, prologue, norm_weight, rope)
    y = torch.empty(*x.shape[:-1], O)
    mod.quant_linear(
        plan.fmt_id,
        plan.weight_ptr,
        x.data_ptr(),
        plan.bias_ptr,
        None if residual is None else residual.data_ptr(),
        y.data_ptr(),
        M,
        O,
        I,
        prologue,
        None if norm_weight is None else norm_weight.data_ptr(),
        eps,
        None if cos is None else cos.data_ptr(),
        None if sin is None else sin.data_ptr(),
        cols,
        head_dim,
    )
    return y


def dequantize(
    blocks: Tensor, fmt: str, out_features: int, in_features: int, out: Tensor | None = None, *, packed: bool = False
) -> Tensor:
    """Blocks (O, row_bytes) uint8 (packed=True: `pack_rows()` of them) -> the weight (O, I) fp32,
    bit for bit gguf.quants.dequantize. `out`: an (O, I) fp32 buffer to write instead of a new
    tensor (a prefill's temporary: a fresh 7 MB tensor costs more in page faults than the 0.3 ms
    of decoding it, 3072 x 576 here)."""
    fmt_id = _format(fmt)[0] | (_X8 if packed else 0)
    _blocks_ok(blocks, fmt, out_features, in_features, packed)
    if out is None:
        out = torch.empty(out_features, in_features)
    elif not (_ok(out) and tuple(out.shape) == (out_features, in_features)):
        raise ValueError(
            f"dequantize: out must be a contiguous fp32 CPU ({out_features}, {in_features}); got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    _module().dequantize(fmt_id, blocks.data_ptr(), out.data_ptr(), out_features, in_features)
    return out


def quantize(weight: Tensor, fmt: str) -> Tensor:
    """weight (O, I) fp32 -> its blocks (O, row_bytes) uint8: q4_0 / q4_1 / q5_0 / q5_1 / q8_0 bit
    for bit gguf.quants.quantize, q4_k / q5_k / q6_k as ggml's quantize_row_q{4,5,6}_K_ref
    (llama-quantize without an importance matrix) in their float order, without FMA."""
    fmt_id = _format(fmt)[0]
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize makes {', '.join(QUANTIZE_FORMATS)}, not {fmt!r}")
    if not (_ok(weight) and weight.dim() == 2):
        raise ValueError(
            f"quantize needs a contiguous fp32 CPU weight (O, I); got {weight.dtype} {tuple(weight.shape)} "
            f"on {weight.device}"
        )
    O, I = weight.shape
    out = torch.empty(O, row_bytes(fmt, I), dtype=torch.uint8)
    _module().quantize(fmt_id, weight.data_ptr(), out.data_ptr(), O, I)
    return out


def _ok(t: Tensor) -> bool:
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()
