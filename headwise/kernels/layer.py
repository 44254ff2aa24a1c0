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
    base, pos, s_h, s_t, *paged = rows
    table, bs = paged if paged else (None, 0)
    return _descriptor_ints(
        plan,
        k.data_ptr(),
        v.data_ptr(),
        0 if base is None else base.data_ptr(),
        s_h,
        s_t,
        pos.data_ptr(),
        0 if table is None else table.data_ptr(),
        0 if table is None else table.shape[1],
        bs,
        cos.data_ptr(),
        sin.data_ptr(),
    )


def _descriptor_ints(plan: StepPlan, k, v, base, s_h, s_t, pos, table, width, bs, cos, sin) -> list[int]:
    C, H, Hkv, D, F = plan.dims
    return [*plan.head, k, v, base, s_h, s_t, pos, table, width, bs, H, Hkv, D, F, cos, sin]


class StackCall:
    """run_stack for a stack that steps again and again over the same cache buffers (a contiguous
    cache's, every sequence at the same length in every layer): the descriptors are built once,
    and each call writes only what a step changes, the same in every layer: the tensor of the
    rows' new key positions and the RoPE rows. `layers`: per layer (plan, k, v, base, head stride,
    key stride), as run_stack's entries without pos, cos and sin."""

    _POS, _COS, _SIN = -101, -102, -103  # markers, where the per-step pointers go

    def __init__(self, layers: list[tuple], rows: int):
        desc, fl = [], []
        C = layers[0][0].dims[0]
        for plan, k, v, base, s_h, s_t in layers:
            if plan.dims[0] != C:
                raise ValueError(f"decoder stack: a layer of width {plan.dims[0]} in a stack of width {C}")
            if base.shape != (rows,):
                raise ValueError(f"decoder stack: {rows} rows with key offsets {tuple(base.shape)}")
            desc += _descriptor_ints(
                plan, k.data_ptr(), v.data_ptr(), base.data_ptr(), s_h, s_t, self._POS, 0, 0, 0, self._COS, self._SIN
            )
            fl += (plan.eps, plan.scale)
        n = len(desc) // len(layers)
        self.pos, self.cos, self.sin = (slice(desc.index(m), None, n) for m in (self._POS, self._COS, self._SIN))
        self.desc, self.fl, self.rows, self.width, self.num_layers = desc, fl, rows, C, len(layers)
        self.plans = [layer[0] for layer in layers]  # the weights the descriptors point into stay alive

    def at(self, pos: Tensor, cos: Tensor, sin: Tensor) -> BoundStack:
        """The step's entry for run_stack: pos (rows,) int64 each row's new key, cos, sin (rows,
        D / 2) contiguous fp32 (the callers' checked types: the cache, Step.rope_rows)."""
        M = self.rows
        if pos.shape != (M,) or cos.shape[0] != M or sin.shape[0] != M:
            raise ValueError(
                f"decoder stack of {M} rows: pos {tuple(pos.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
            )
        L, desc = self.num_layers, self.desc.copy()  # a copy: two threads may step one model
        desc[self.pos], desc[self.cos], desc[self.sin] = (
            [pos.data_ptr()] * L,
            [cos.data_ptr()] * L,
            [sin.data_ptr()] * L,
        )
        return BoundStack(self, desc, (pos, cos, sin))


class BoundStack:
    """A StackCall's descriptors for one step (StackCall.at), what run_stack takes in place of
    the layers' entries; its length is the layer count, as theirs."""

    __slots__ = ("call", "desc", "tensors")

    def __init__(self, call: StackCall, desc: list[int], tensors: tuple):
        self.call, self.desc, self.tensors = call, desc, tensors  # tensors: pos, cos, sin, alive until the call

    def __len__(self) -> int:
        return self.call.num_layers


def run_stack(steps: list[tuple], x: Tensor) -> Tensor:
    """steps: consecutive layers' (plan, cos, sin, k, v, rows); x (M, C) -> the last layer's output,
    each layer reading the one before: the layers one by one in a single kernel call
    (decoder_stack), so that no Python runs between them. rows = (base, pos, head stride, key
    stride[, table, block size]), what a cache's `claim_decode` returns beside k and v: row m's keys
    start at k[base[m]] (floats from k's first element) and it writes key pos[m], then attends over
    keys 0 .. pos[m]. With a block table (M, width) int64 (a paged pool, base None), row m's key t
    is key row table[m, t // bs] * bs + t % bs of k's head planes instead. For the block's route,
    which has checked dtypes, contiguity and limits (M <= 64, the decode kernel's G and D); cos,
    sin (M, D / 2). `steps` may be a StackCall's BoundStack instead (the same layers' entries,
    built once for a cache's buffers)."""
    M, C = x.shape
    if type(steps) is BoundStack:
        call = steps.call
        if (M, C) != (call.rows, call.width):
            raise ValueError(f"decoder stack of {call.rows} rows x {call.width}: x {tuple(x.shape)}")
        return _call_stack(steps.desc, call.fl, x)
    desc, fl = [], []
    for plan, cos, sin, k, v, rows in steps:
        if plan.dims[0] != C:
            raise ValueError(f"decoder stack: a layer of width {plan.dims[0]} in a stack of width {C}")
        desc += _descriptor(plan, cos, sin, k, v, rows)
        fl += (plan.eps, plan.scale)
    return _call_stack(desc, fl, x)


def _call_stack(desc: list[int], fl: list[float], x: Tensor) -> Tensor:
    M, C = x.shape
    y = torch.empty(M, C)
    rc, failed = _ext()[0].decoder_stack(desc, fl, x.data_ptr(), y.data_ptr(), M, C)
    if rc:
        raise RuntimeError(
            f"decoder stack kernel failed at its layer {failed} (code {rc}: -1 no memory, else a kernel's "
            "shape/format check)"
        )
    return y
