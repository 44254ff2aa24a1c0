"""CPU kernels PyTorch lacks for small-batch decoding, compiled when the package is installed.

`small_linear(x, block_weight(w), ...)` is `F.linear` for a few rows of x (a decode step):
it streams the weight from memory once, in a blocked layout that reads as one run per 8
output rows, faster than oneDNN's prepacked matrix-vector product on this machine
(benchmarks/decode.py: floor_kernel vs floor_packed); from 5 rows (a batched decode, the
engine's steps) it computes 6 x 16 tiles (12 x 16 in the avx512 build) over 128 inputs at a
time, each weight tile read from memory once for all rows. It folds in the op before it (RMSNorm
or SwiGLU) and a residual add after it, which saves a PyTorch call each. Only fp32 on x86-64
with AVX2 + FMA. PackedLinear keeps the blocked copy of its weight (models/packing.py).

The C sources (csrc/generic: the drivers and module.c, the Python entry points; csrc/x86/avx2 and
csrc/x86/avx512: the vector code of each ISA, one file per kernel family) are a C extension that `pip install` builds (setup.py) in two variants,
`_cpu_avx2` and `_cpu_avx512`; `_ext()` imports the one this CPU runs, chosen at run time from
its flags (HEADWISE_ISA=avx2 / avx512 forces one), with the prefetch distances of its kernels set for
this core (cpu.tune: the tables of cpu.py; environment variables override them). Where none can run (not built at install, no
AVX2, torch not on OpenMP, or HEADWISE_KERNELS=0), `kernels_unavailable()` says why and callers
keep PyTorch's ops.
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu import cpu_flags, tune

PRO_NONE, PRO_RMSNORM, PRO_SWIGLU, PRO_GEGLU = 0, 1, 2, 3  # GeGLU: gelu_tanh(gate) * up (Gemma)
GATED = (PRO_SWIGLU, PRO_GEGLU)  # the prologues that read x = [gate | up] (..., 2I)
KERNEL_ROWS = 64  # the most rows one call takes (small_linear.c's MAX_PANEL_ROWS: its accumulators)
# Each variant and the CPU flags it needs (/proc/cpuinfo's names), best first: setup.py's VARIANTS.
ISA_VARIANTS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}


# Whether our kernels beat oneDNN's matmul at many rows: it sets MAX_ROWS (fp32: up to how many
# rows PackedLinear prefers the small-row kernel) and whether a prefill of packed quantized
# weights runs the integer kernel 64 rows at a time (models/linear.py) instead of a dequantized
# tile + GEMM. benchmarks/small_rows.py measures the fp32 half (SmolLM2's 30 layers, 2 threads);
# they did on every CPU measured so far, so it is no longer a rule by ISA or maker:
# - AMD EPYC Zen 3, AVX2 only: 16 rows 40 vs 62 ms, 64 rows 130 vs 139; integer prefill 0.65x the time;
# - AMD EPYC Zen 4, AVX-512 as two 256-bit halves: results/small_rows_zen4.txt, 16 rows 42 vs 51 ms,
#   32 rows 64 vs 68, 64 even; SmolLM2's Q4_1 prefill (512 tokens) 769 vs 472 tok/s;
# - Intel Xeon, AVX-512 + VNNI + AMX (two full 512-bit FMA units, where oneDNN's wider tiles were
#   expected to win; 2026-12-02): results/small_rows_intel.txt, 16 rows 28.0 vs 44.6 ms, 32 rows 42.9
#   vs 56.9, 64 rows 80.4 vs 76.7 (oneDNN 5% ahead); Q4_1 prefill 1181 vs 872 tok/s.
# - AMD EPYC Zen 5, full-width AVX-512, with the avx512 build's 12 x 32 zmm tiles (small_linear.c
#   quad_rows): results/small_rows_zen5.txt, oneDNN / kernel 1.59x at 16 rows, 1.37x at 32, 1.20x at 64.
# Before, Intel's AVX-512 kept oneDNN from 5 rows, a guess that the first measurement undid.
KERNELS_OVER_ONEDNN = True
MAX_ROWS = KERNEL_ROWS  # fp32 rows the small-row kernel takes from oneDNN (all it can: KERNELS_OVER_ONEDNN)


def pick_isa(flags: set[str] | None = None) -> tuple[str | None, str | None]:
    """(variant, None) for the best kernel variant this CPU runs, or (None, why not).
    HEADWISE_ISA=avx2 / avx512 asks for one (refused if the CPU lacks its flags)."""
    flags = cpu_flags() if flags is None else flags
    wanted = os.environ.get("HEADWISE_ISA", "").strip().lower()
    if wanted and wanted not in ISA_VARIANTS:
        return None, f"HEADWISE_ISA={wanted!r} is not one of {sorted(ISA_VARIANTS)}"
    for isa in [wanted] if wanted else ISA_VARIANTS:
        missing = [f for f in ISA_VARIANTS[isa] if f not in flags]
        if not missing:
            return isa, None
        if wanted:
            return None, f"HEADWISE_ISA={wanted}: this CPU lacks {', '.join(missing)}"
    return None, "the CPU lacks AVX2 + FMA + F16C"


def _omp_libraries() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}


@functools.cache
def _ext() -> tuple[ModuleType | None, str | None]:
    """(the kernel module for this CPU, None), or (None, why it cannot run here)."""
    if os.environ.get("HEADWISE_KERNELS", "1") == "0":
        return None, "disabled by HEADWISE_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"x86-64 only (this is {platform.machine()})"
    isa, why = pick_isa()
    if isa is None:
        return None, why
    if "OpenMP" not in torch.__config__.parallel_info():
        return None, "PyTorch is not built with OpenMP; the kernel would bring a second thread pool"
    before = _omp_libraries()
    try:
        mod = importlib.import_module(f"{__name__}._cpu_{isa}")
    except ImportError as e:
        return None, (
            f"the compiled kernels (headwise.kernels._cpu_{isa}) are not installed: {e}. They are built by "
            "`pip install` (setup.py); reinstall with a C compiler on PATH"
        )
    if len(_omp_libraries()) > max(1, len(before)):  # ours did not bind to torch's libgomp
        return None, f"the kernels loaded a second OpenMP runtime ({sorted(_omp_libraries())})"
    tune(mod)
    return mod, _self_check(mod)


def isa() -> str | None:
    """The kernel variant in use ("avx2" / "avx512"), or None where none runs."""
    mod, why = _ext()
    return None if why is not None else mod.__name__.rsplit("_", 1)[-1]


def _self_check(mod: ModuleType) -> str | None:
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((3, 37), (13, 37), (13,)))
    y, blocked = torch.empty(3, 13), block_weight(w)
    ptrs = (blocked.data_ptr(), x.data_ptr(), b.data_ptr(), None, y.data_ptr())
    mod.small_linear(*ptrs, 3, 13, 37, PRO_NONE, None, 0.0, None, None, 0, 0)
    if not torch.allclose(y, F.linear(x, w, b), atol=1e-4):
        return "the compiled kernel disagrees with F.linear"
    return None


def kernels_unavailable() -> str | None:
    """None when small_linear runs here, else why it does not."""
    return _ext()[1]


def block_weight(weight: Tensor) -> Tensor:
    """weight (O, I) -> the layout small_linear reads, (ceil(O/8), I, 8): block b holds rows
    8b..8b+7 interleaved, so each block streams from memory as one run (rows past O are 0)."""
    O, I = weight.shape
    w = weight.detach().float()
    if O % 8:
        w = F.pad(w, (0, 0, 0, 8 - O % 8))
    return w.reshape(-1, 8, I).transpose(1, 2).contiguous()


class LinearPlan(NamedTuple):
    """A weight checked once for the kernel: its blocked copy (kept alive here), pointers, sizes."""

    blocked: Tensor
    bias: Tensor | None
    weight_ptr: int
    bias_ptr: int | None
    out_features: int
    in_features: int


def plan_linear(blocked: Tensor, out_features: int, bias: Tensor | None = None) -> LinearPlan:
    """Check a `block_weight()` copy (and bias) once, for any number of `run_linear` calls."""
    O = out_features
    nblk, I, eight = blocked.shape if blocked.dim() == 3 else (0, 0, 0)
    if eight != 8 or nblk != -(-O // 8) or blocked.data_ptr() % 32 or not _ok(blocked):
        raise ValueError(
            f"small_linear: blocked weight {tuple(blocked.shape)} is not block_weight() of an "
            f"({O}, I) weight (or not 32-byte aligned, fp32, contiguous)"
        )
    if bias is not None and not (_ok(bias) and bias.numel() == O):
        raise ValueError(f"small_linear needs a contiguous fp32 CPU bias of {O}; got {bias.dtype} {tuple(bias.shape)}")
    return LinearPlan(blocked, bias, blocked.data_ptr(), None if bias is None else bias.data_ptr(), O, I)


def small_linear(x: Tensor, blocked: Tensor, out_features: int, bias: Tensor | None = None, **epilogue) -> Tensor:
    """prologue(x) @ W.T + bias + residual for fp32 CPU tensors and at most KERNEL_ROWS rows of x,
    with W given as `block_weight(W)` (made once per weight; W is (out_features, I)).

    x (..., I), or (..., 2I) = [gate | up] with PRO_SWIGLU; residual (..., out_features).
    `epilogue`: run_linear's keywords (residual, prologue, norm_weight, eps, rope).
    PRO_RMSNORM applies x / sqrt(mean(x^2) + eps) * norm_weight first. rope = (cos, sin,
    columns, head_dim), cos/sin (M, head_dim / 2) per row: RoPE (half-split, HF's rotate_half)
    on the first `columns` outputs in heads of head_dim, after the matmul (a QKV projection's
    q and k heads). No autograd: callers use it under no_grad / inference_mode. Check
    `kernels_unavailable()` first. A caller that calls it per step with the same weight keeps
    `plan_linear()`'s plan and calls `run_linear` (the checks of the weight, once).
    """
    return run_linear(plan_linear(blocked, out_features, bias), x, **epilogue)


def run_linear(
    plan: LinearPlan,
    x: Tensor,
    *,
    residual: Tensor | None = None,
    prologue: int = PRO_NONE,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    rope: tuple[Tensor, Tensor, int, int] | None = None,
) -> Tensor:
    """small_linear on a planned weight: checks x, residual, norm_weight and rope only."""
    mod, why = _ext()
    if why is not None:
        raise RuntimeError(f"small_linear is unavailable: {why}")
    O, I = plan.out_features, plan.in_features
    M, cos, sin, cols, head_dim = check_call("small_linear", O, I, x, residual, prologue, norm_weight, rope)
    y = torch.empty(*x.shape[:-1], O)
    rc = mod.small_linear(
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
    if rc:
        raise MemoryError("small_linear: could not allocate the prologue buffer")
    return y


def rows_kernels_take(*tensors: Tensor) -> bool:
    """Whether rms_norm / swiglu / rope_ run on these tensors here: the kernels load, all are contiguous fp32
    CPU tensors, and no gradient is wanted (the kernels record no autograd graph)."""
    grad = torch.is_grad_enabled()
    return _ext()[1] is None and all(_ok(t) and not (grad and t.requires_grad) for t in tensors)


def swiglu(x: Tensor, kind: int = PRO_SWIGLU) -> Tensor:
    """silu(gate) * up for x (..., 2I) = [gate | up] -> (..., I) (kind PRO_GEGLU: gelu_tanh(gate) *
    up): small_linear's SwiGLU / GeGLU prologue as a call of its own (rows over the OpenMP threads),
    for rows whose matmul oneDNN runs. Check `rows_kernels_take(x)` first."""
    mod = _ext()[0]
    if x.dim() == 0 or x.shape[-1] % 2 or not rows_kernels_take(x) or kind not in GATED:
        raise ValueError(
            f"swiglu needs contiguous fp32 CPU x (..., 2I) without grad and a gated kind {GATED}; got {x.dtype} "
            f"{tuple(x.shape)}, kind {kind}"
        )
    I = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], I)
    mod.rows_prologue(kind, x.data_ptr(), None, 0.0, out.data_ptr(), x.numel() // (2 * I) if I else 0, I)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over x's last dim, fp32 (the sum of squares in fp64):
    small_linear's RMSNorm prologue as a call of its own, rows over the OpenMP threads (on CPU,
    torch 2.13's F.rms_norm runs five ops: 6% of a 512-token prefill step). Check
    `rows_kernels_take(x, weight)` first."""
    I = x.shape[-1] if x.dim() else 0
    if not (rows_kernels_take(x, weight) and I and weight.shape == (I,)):
        raise ValueError(
            f"rms_norm needs contiguous fp32 CPU x (..., I) and weight (I,) without grad; got x {x.dtype} "
            f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
        )
    out = torch.empty_like(x)
    _ext()[0].rows_prologue(PRO_RMSNORM, x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), x.numel() // I, I)
    return out


def rope_(y: Tensor, cos: Tensor, sin: Tensor, columns: int, head_dim: int) -> Tensor:
    """RoPE in place on the first `columns` columns of y (M, O), in heads of head_dim (half-split,
    HF's rotate_half), cos/sin (M, head_dim / 2) each row's angles: small_linear's RoPE epilogue
    as a call of its own. Returns y. Check `rows_kernels_take(y, cos, sin)` first."""
    M, O = y.shape if y.dim() == 2 else (0, 0)
    if not (
        rows_kernels_take(y, cos, sin)
        and y.dim() == 2
        and head_dim > 0
        and head_dim % 2 == 0
        and 0 < columns <= O
        and columns % head_dim == 0
        and cos.shape == sin.shape == (M, head_dim // 2)
    ):
        raise ValueError(
            f"rope_ needs contiguous fp32 y (M, O) and cos/sin (M, head_dim / 2), whole heads in the first "
            f"columns; got y {tuple(y.shape)} {y.dtype}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, "
            f"columns {columns}, head_dim {head_dim}"
        )
    _ext()[0].rope_rows(y.data_ptr(), M, O, cos.data_ptr(), sin.data_ptr(), columns, head_dim)
    return y


def qk_norm_rope_(
    y: Tensor, heads: tuple[int, int, int], q_weight, k_weight, eps: float, cos=None, sin=None, rotary_dim=None
) -> Tensor:
    """QK-norm then RoPE in place on y (M, O) = [q heads | k heads | ...], heads = (H, Hkv, D): RMSNorm
    over each q head's D channels (q_weight (D,), None: not normed) and each k head's (k_weight), then
    RoPE (half-split) on the first rotary_dim (default D; fewer: partial rotary) channels of those
    H + Hkv heads with cos/sin (M, rotary_dim / 2) (None: no rotation). The decode stack's step, as
    a call of its own for a prefill's rows. Returns y."""
    H, Hkv, D = heads
    rd = D if rotary_dim is None else rotary_dim
    M, O = y.shape if y.dim() == 2 else (0, 0)
    norms = [w for w in (q_weight, k_weight) if w is not None]
    rope = [] if cos is None else [cos, sin]
    if not (
        rows_kernels_take(y, *norms, *rope)
        and 0 < rd <= D
        and rd % 2 == 0
        and (H + Hkv) * D <= O
        and all(w.shape == (D,) for w in norms)
        and all(t.shape == (M, rd // 2) for t in rope)
    ):
        raise ValueError(
            f"qk_norm_rope_ needs contiguous fp32 y (M, O) with {H} + {Hkv} heads of {D} first, weights ({D},), "
            f"cos/sin (M, {rd // 2}); got y {tuple(y.shape)} {y.dtype}, weights {[tuple(w.shape) for w in norms]}, "
            f"rope {[tuple(t.shape) for t in rope]}"
        )
    ptrs = [None if t is None else t.data_ptr() for t in (q_weight, k_weight, cos, sin)]
    _ext()[0].qk_norm_rope_rows(y.data_ptr(), M, O, H, Hkv, D, rd, ptrs[0], ptrs[1], eps, ptrs[2], ptrs[3])
    return y


def argmax_rows(logits: Tensor) -> Tensor:
    """logits.argmax(dim=-1) for logits (R, V): the kernel's where it runs (fp32 on the CPU, rows
    of contiguous values), else torch's. Same answer either way: the first index of each row's
    maximum; a row holding a NaN is torch's (it returns the NaN's index). ATen's CPU argmax is
    scalar (0.27 ms for (16, 49152) on 2 threads here, 2% of a 16-row decode step)."""
    mod, why = _ext()
    if (
        why is not None
        or logits.dim() != 2
        or logits.dtype is not torch.float32
        or not logits.is_cpu
        or logits.stride(-1) != 1
        or logits.shape[-1] == 0
    ):
        return logits.argmax(dim=-1)
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.long)
    if mod.argmax_rows(logits.data_ptr(), R, V, logits.stride(0), out.data_ptr()):
        return logits.argmax(dim=-1)  # a row with a NaN
    return out


def check_call(
    what: str,
    O: int,
    I: int,
    x: Tensor,
    residual: Tensor | None,
    prologue: int,
    norm_weight: Tensor | None,
    rope: tuple[Tensor, Tensor, int, int] | None,
) -> tuple[int, Tensor | None, Tensor | None, int, int]:
    """The checks every small-row linear kernel call needs (run_linear, quant.run_quant) against
    an (O, I) weight: x (M, I) (or (M, 2I) with PRO_SWIGLU / PRO_GEGLU), 1 <= M <= KERNEL_ROWS, residual (M, O),
    norm_weight (I,), rope = (cos, sin (M, head_dim / 2), columns, head_dim); all contiguous fp32
    on the CPU. Returns (M, cos, sin, columns, head_dim), the last four None / 0 without rope."""
    M = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if x.dim() == 0 or x.shape[-1] != (2 * I if prologue in GATED else I) or not 0 < M <= KERNEL_ROWS:
        raise ValueError(
            f"{what}: x {tuple(x.shape)} does not fit a ({O}, {I}) weight "
            f"(prologue {prologue}) or has not 1 to {KERNEL_ROWS} rows (no more than {KERNEL_ROWS})"
        )
    if not (
        _ok(x)
        and (residual is None or _ok(residual) and residual.numel() == M * O)
        and (norm_weight is None or _ok(norm_weight) and norm_weight.numel() == I)
    ):
        raise ValueError(
            f"{what} needs contiguous fp32 CPU tensors: x (M, I), residual (M, O), norm_weight (I,); got "
            + ", ".join(
                f"{n} {t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' strided'} on {t.device}"
                for n, t in (("x", x), ("residual", residual), ("norm_weight", norm_weight))
                if t is not None
            )
        )
    if rope is None:
        return M, None, None, 0, 0
    cos, sin, cols, head_dim = rope
    if not (
        head_dim > 0
        and head_dim % 2 == 0
        and 0 < cols <= O
        and cols % head_dim == 0
        and all(_ok(t) and t.shape == (M, head_dim // 2) for t in (cos, sin))
    ):
        raise ValueError(
            f"{what}: rope needs cos and sin (M, head_dim / 2) = ({M}, {head_dim // 2}) contiguous fp32 "
            f"and whole heads of {head_dim} in the first {cols} of {O} outputs; got cos "
            f"{tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}"
        )
    return M, cos, sin, cols, head_dim


def _ok(t: Tensor) -> bool:
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()
