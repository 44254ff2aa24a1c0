"""One decode step of a pre-norm SwiGLU decoder layer in one kernel call (decoder_step.c).

`run_stack(steps, x)`, per layer (plan, cos, sin, k_cache, v_cache, rows): RMSNorm + QKV + RoPE,
the new K/V written into the cache at each row's slot, attention over every key up to it,
out-projection + residual, RMSNorm + gate/up, SwiGLU + down + residual: the decoder block's
few-rows route (models/blocks.py) for a step of one new token per sequence, with its ~40
Python-level operations per layer (~350 us here at batch 1, more than the layer's matmuls) down
to one call for all the consecutive layers it applies to (one layer: a stack of one). The
linears are the same kernels' plans: `kernels.LinearPlan` (fp32) or `kernels.quant.QuantPlan`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import LinearPlan, _ext


class StepPlan(NamedTuple):
    """A layer's four linear plans and norms, checked once."""

    head: tuple[int, ...]  # a descriptor's fixed head: (fmt, weight, bias) per linear, the two norms' pointers
    plans: tuple  # the four plans (they keep the weights alive)
    norms: tuple[Tensor, Tensor]
    eps: float
    dims: tuple[int, int, int, int, int]  # C, H, Hkv, D, F
    scale: float


def plan_step(plans: tuple, attn_norm: Tensor, mlp_norm: Tensor, eps: float, H: int, Hkv: int, D: int) -> StepPlan:
    """plans: (qkv, out, gate_up, down), each a LinearPlan or QuantPlan of the matching shape."""
    qkv, out, gate_up, down = plans
    C, F = out.out_features, down.in_features
    want = [((H + 2 * Hkv) * D, C), (C, H * D), (2 * F, C), (C, F)]
    got = [(p.out_features, p.in_features) for p in plans]
    if got != want or H % Hkv:
        raise ValueError(f"decoder step: linear shapes {got} do not make a layer of H={H}, Hkv={Hkv}, D={D}: {want}")
    for n in (attn_norm, mlp_norm):
        if not (n.dtype is torch.float32 and n.is_contiguous() and n.numel() == C):
            raise ValueError(
                f"decoder step: norm weights must be contiguous fp32 ({C},); got {n.dtype} {tuple(n.shape)}"
            )
    lin = []
    for p in plans:
        fmt = -1 if isinstance(p, LinearPlan) else p.fmt_id
        lin += [fmt, p.weight_ptr, p.bias_ptr or 0]
    lin += [attn_norm.data_ptr(), mlp_norm.data_ptr()]
    return StepPlan(tuple(lin), plans, (attn_norm, mlp_norm), eps, (C, H, Hkv, D, F), D**-0.5)


def _descriptor(plan: StepPlan, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, rows: tuple) -> list[int]:
    """One layer's int64s for decoder_stack (decoder_step.c's ST_* order): the plan's fixed head,
    then what the step's cache and positions give."""
    C, H, Hkv, D, F = plan.dims
    base, pos, s_h, s_t, *paged = rows
    table, bs = paged if paged else (None, 0)
    return [
        *plan.head,
        k.data_ptr(),
        v.data_ptr(),
        0 if base is None else base.data_ptr(),
        s_h,
        s_t,
        pos.data_ptr(),
        0 if table is None else table.data_ptr(),
        0 if table is None else table.shape[1],
        bs,
        H,
        Hkv,
        D,
        F,
        cos.data_ptr(),
        sin.data_ptr(),
    ]


def run_stack(steps: list[tuple], x: Tensor) -> Tensor:
    """steps: consecutive layers' (plan, cos, sin, k, v, rows); x (M, C) -> the last layer's output,
    each layer reading the one before: the layers one by one in a single kernel call
    (decoder_stack), so that no Python runs between them. rows = (base, pos, head stride, key
    stride[, table, block size]), what a cache's `claim_decode` returns beside k and v: row m's keys
    start at k[base[m]] (floats from k's first element) and it writes key pos[m], then attends over
    keys 0 .. pos[m]. With a block table (M, width) int64 (a paged pool, base None), row m's key t
    is key row table[m, t // bs] * bs + t % bs of k's head planes instead. For the block's route,
    which has checked dtypes, contiguity and limits (M <= 64, the decode kernel's G and D); cos,
    sin (M, D / 2)."""
    M, C = x.shape
    desc, fl = [], []
    for plan, cos, sin, k, v, rows in steps:
        if plan.dims[0] != C:
            raise ValueError(f"decoder stack: a layer of width {plan.dims[0]} in a stack of width {C}")
        desc += _descriptor(plan, cos, sin, k, v, rows)
        fl += (plan.eps, plan.scale)
    y = torch.empty(M, C)
    rc, failed = _ext()[0].decoder_stack(desc, fl, x.data_ptr(), y.data_ptr(), M, C)
    if rc:
        raise RuntimeError(
            f"decoder stack kernel failed at its layer {failed} (code {rc}: -1 no memory, else a kernel's "
            "shape/format check)"
        )
    return y
