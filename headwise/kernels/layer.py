"""One decode step of a decoder layer in one kernel call (decoder_step.c), any family's block.

`run_stack(steps, x)`, per layer (plan, cos, sin, k_cache, v_cache, rows): RMSNorm + QKV (+ QK-norm)
+ RoPE, the new K/V written into the cache at each row's slot, attention over every key up to it
(or the layer's window of them), out-projection + residual (or Gemma's post-norm and residual),
RMSNorm + gate/up, SwiGLU or GeGLU + down + residual (or post-norm): the decoder block's
few-rows route (models/blocks.py) for a step of one new token per sequence, with its ~40
Python-level operations per layer (~350 us here at batch 1, more than the layer's matmuls) down
to one call for all the consecutive layers it applies to (one layer: a stack of one). The
linears are the same kernels' plans: `kernels.LinearPlan` (fp32) or `kernels.quant.QuantPlan`.
A layer is described by data (`plan_step`'s keywords: the family's spec), not by a kernel per family.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import PRO_GEGLU, PRO_SWIGLU, LinearPlan, _ext
from .attention import KV_KINDS

# The MLP's gate activation -> the kernels' prologue between gate_up and down
GLU_PROLOGUES = {"silu": PRO_SWIGLU, "gelu_tanh": PRO_GEGLU}


class StepPlan(NamedTuple):
    """A layer's four linear plans and norms, checked once."""

    head: tuple[int, ...]  # a descriptor's fixed head: (fmt, weight, bias) per linear, the two norms' pointers
    plans: tuple  # the four plans (they keep the weights alive)
    norms: tuple[Tensor, ...]  # every norm weight the descriptor points into (kept alive)
    eps: float
    dims: tuple[int, int, int, int, int]  # C, H, Hkv, D, F
    scale: float
    split: tuple[int, ...] = (-2, 0, 0, -2, 0, 0)  # k's and v's (fmt, weight, bias) when q, k, v are apart
    # q_norm, k_norm, post-attention norm, post-MLP norm (pointers, 0: none), the GLU prologue, the window
    # (0: every key), the rotated channels of a head (dims' D but with partial rotary)
    spec: tuple[int, ...] = (0, 0, 0, 0, PRO_SWIGLU, 0, 0)
    qk_eps: float = 0.0
    softcap: float = 0.0  # 0: none, else Gemma 2's cap of the scores


def plan_step(
    plans: tuple,
    attn_norm: Tensor,
    mlp_norm: Tensor,
    eps: float,
    H: int,
    Hkv: int,
    D: int,
    *,
    qk_norms: tuple[Tensor | None, Tensor | None] = (None, None),
    qk_eps: float = 0.0,
    post_norms: tuple[Tensor | None, Tensor | None] = (None, None),
    glu: str = "silu",
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    rotary_dim: int | None = None,
) -> StepPlan:
    """plans: (qkv, out, gate_up, down), each a LinearPlan or QuantPlan of the matching shape; qkv
    may be a (q, k, v) tuple of three (an attention that holds them apart: MultiHeadAttention.unfuse).
    The keywords are the block's spec where it is not a Llama's: qk_norms (D,) weights of RMSNorms over
    each q and k head before RoPE (eps qk_eps); post_norms (C,) weights of RMSNorms on the attention's
    and the MLP's outputs before their residuals (eps `eps`); glu, the gate's activation ("silu",
    "gelu_tanh"); window W (each row attends to the W keys ending at its own); scale of the scores
    (None: D**-0.5); softcap c of the scores (c tanh(s / c): Gemma 2); rotary_dim, the first channels
    of each q and k head RoPE rotates (None: all D; fewer: partial rotary, cos/sin then (M, rotary_dim / 2))."""
    qkv, out, gate_up, down = plans
    C, F = out.out_features, down.in_features
    parts = qkv if type(qkv) is tuple else (qkv,)
    want_qkv = [(H * D, C), (Hkv * D, C), (Hkv * D, C)] if len(parts) == 3 else [((H + 2 * Hkv) * D, C)]
    want = [*want_qkv, (C, H * D), (2 * F, C), (C, F)]
    got = [(p.out_features, p.in_features) for p in (*parts, out, gate_up, down)]
    if got != want or H % Hkv:
        raise ValueError(f"decoder step: linear shapes {got} do not make a layer of H={H}, Hkv={Hkv}, D={D}: {want}")
    sized = [(n, C) for n in (attn_norm, mlp_norm, *post_norms) if n is not None]
    for n, size in sized + [(n, D) for n in qk_norms if n is not None]:
        if not (n.dtype is torch.float32 and n.is_contiguous() and n.numel() == size):
            raise ValueError(
                f"decoder step: norm weights must be contiguous fp32 ({size},); got {n.dtype} {tuple(n.shape)}"
            )
    rd = D if rotary_dim is None else rotary_dim
    if glu not in GLU_PROLOGUES or (window is not None and window < 1) or not (0 < rd <= D and rd % 2 == 0):
        raise ValueError(
            f"decoder step: glu {glu!r} (one of {sorted(GLU_PROLOGUES)}), window {window} (None or >= 1), "
            f"rotary_dim {rotary_dim} (even, <= {D})"
        )
    lin, split = [], []
    for p in (parts[0], out, gate_up, down):
        lin += _linear_ints(p)
    for p in parts[1:]:
        split += _linear_ints(p)
    lin += [attn_norm.data_ptr(), mlp_norm.data_ptr()]
    extra = (*qk_norms, *post_norms)
    spec = (*(0 if n is None else n.data_ptr() for n in extra), GLU_PROLOGUES[glu], window or 0, rd)
    norms = (attn_norm, mlp_norm, *(n for n in extra if n is not None))
    scale = D**-0.5 if scale is None else float(scale)
    plan = StepPlan(tuple(lin), plans, norms, eps, (C, H, Hkv, D, F), scale, spec=spec, qk_eps=float(qk_eps))
    plan = plan._replace(softcap=float(softcap or 0.0))
    return plan._replace(split=tuple(split)) if split else plan


def _linear_ints(p) -> list[int]:
    """A linear's (fmt, weight, bias) for the descriptor: fmt -1 for fp32 blocked weights."""
    return [-1 if isinstance(p, LinearPlan) else p.fmt_id, p.weight_ptr, p.bias_ptr or 0]


def _descriptor(plan: StepPlan, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, rows: tuple) -> list[int]:
    """One layer's int64s for decoder_stack (decoder_step.c's ST_* order): the plan's fixed head,
    then what the step's cache and positions give. rows = (base, pos, head stride, key stride[,
    table, block size[, ring]]): a ring of R rows (key p at row p % R) after an empty table."""
    base, pos, s_h, s_t, *paged = rows
    ring = paged.pop() if len(paged) == 3 else 0
    return _descriptor_ints(plan, k, v, s_h, s_t, _step_ints((base, pos, *paged), cos, sin), ring)


def _plane(x) -> tuple[int, int, int]:
    """A cache's K or V plane -> (values pointer, scales pointer or 0, element kind): an fp32, bf16 or
    fp16 tensor, or an int8 cache's (int8 values, fp32 scales (..., 1)) pair (cache/quantized.py), read
    by the kernel as is (kernels.h's KV_* kinds)."""
    if type(x) is tuple:
        return x[0].data_ptr(), x[1].data_ptr(), KV_KINDS[torch.int8]
    return x.data_ptr(), 0, KV_KINDS[x.dtype]


def _step_ints(rows: tuple, cos: Tensor, sin: Tensor) -> tuple[int, ...]:
    """rows = (base, pos[, table, block size]) and the RoPE rows -> the descriptor's per-step
    values: base, pos, table, table width, block size, cos, sin (pointers, or 0 where absent)."""
    base, pos, *paged = rows
    table, bs = paged if paged else (None, 0)
    return (
        0 if base is None else base.data_ptr(),
        pos.data_ptr(),
        0 if table is None else table.data_ptr(),
        0 if table is None else table.shape[1],
        bs,
        cos.data_ptr(),
        sin.data_ptr(),
    )


def _descriptor_ints(plan: StepPlan, k, v, s_h: int, s_t: int, step: tuple, ring: int = 0) -> list[int]:
    C, H, Hkv, D, F = plan.dims
    base, pos, table, width, bs, cos, sin = step
    (k, ks, kind), (v, vs, _) = _plane(k), _plane(v)
    return [*plan.head, k, v, ks, vs, base, s_h, s_t, pos, table, width, bs, H, Hkv, D, F, cos, sin, *plan.split] + [
        *plan.spec,
        ring,
        kind,
    ]


def _floats(plan: StepPlan) -> tuple[float, float, float, float]:
    """A layer's floats for decoder_stack (decoder_step.c's FL_* order)."""
    return (plan.eps, plan.scale, plan.qk_eps, plan.softcap)


class StackCall:
    """run_stack for a stack that steps again and again over the same cache buffers: the
    descriptors are built once, and each step writes in only what it changes, the same in every
    layer: its rows (key offsets or block tables, new key positions) and RoPE rows. `layers`:
    per layer (plan, k, v, head stride, key stride[, base, ring]), as run_stack's entries without
    the step's parts; a layer with its own base (M,) int64 and ring size R keeps them (a windowed
    layer's ring of R rows a sequence, beside layers of every key). Any number of rows."""

    _MARKS = (-101, -102, -103, -104, -105, -106, -107)  # where base, pos, table, width, bs, cos, sin go

    def __init__(self, layers: list[tuple]):
        desc, fl, own = [], [], []
        C = layers[0][0].dims[0]
        for i, (plan, k, v, s_h, s_t, *ring) in enumerate(layers):
            if plan.dims[0] != C:
                raise ValueError(f"decoder stack: a layer of width {plan.dims[0]} in a stack of width {C}")
            desc += _descriptor_ints(plan, k, v, s_h, s_t, self._MARKS, ring[1] if ring else 0)
            fl += _floats(plan)
            if ring:
                own.append((i, ring[0]))
        n = len(desc) // len(layers)
        self.fields = [slice(desc.index(m), None, n) for m in self._MARKS]
        base_at = desc.index(self._MARKS[0])
        self.own_bases = [(base_at + i * n, base) for i, base in own]  # (where, tensor): kept as built
        self.desc, self.fl, self.width, self.num_layers = desc, fl, C, len(layers)
        self.plans = [layer[0] for layer in layers]  # the weights the descriptors point into stay alive

    def at(self, rows: tuple, cos, sin) -> BoundStack:
        """The step's entry for run_stack. rows = (base, pos[, table, block size]) as a cache's
        claim_decode gives them without the strides: base (M,) int64 or None where table (M,
        width) int64 is given, pos (M,) int64; cos, sin (M, D / 2) contiguous fp32 (the callers'
        checked types: the cache, Step.rope_rows), or a list of them per layer (layers of several
        rotaries: Gemma's local and global layers)."""
        base, pos, *paged = rows
        table, bs = paged if paged else (None, 0)
        M, L = pos.shape[0], self.num_layers
        each = type(cos) is list
        coss, sins = (cos, sin) if each else ([cos], [sin])
        ok = pos.shape == (M,) and all(c.shape[0] == M for c in coss) and all(t.shape[0] == M for t in sins)
        ok = ok and (base.shape == (M,) if table is None else base is None and table.shape[0] == M)
        ok = ok and (not each or len(coss) == len(sins) == L)
        if not ok:
            got = [None if t is None else tuple(t.shape) for t in (base, pos, table, coss[0], sins[0])]
            raise ValueError(f"decoder stack rows: base, pos, table, cos, sin {got} do not give {M} rows of {L} layers")
        values = _step_ints(rows, coss[0], sins[0])
        desc = self.desc.copy()  # a copy: two threads may step one model
        for field, value in zip(self.fields, values):
            desc[field] = [value] * L
        for at, own in self.own_bases:
            desc[at] = own.data_ptr()
        if each:
            desc[self.fields[5]] = [c.data_ptr() for c in coss]
            desc[self.fields[6]] = [t.data_ptr() for t in sins]
        return BoundStack(self, desc, M, (base, pos, table, coss, sins))


class BoundStack:
    """A StackCall's descriptors for one step (StackCall.at), what run_stack takes in place of
    the layers' entries; its length is the layer count, as theirs."""

    __slots__ = ("call", "desc", "rows", "tensors")

    def __init__(self, call: StackCall, desc: list[int], rows: int, tensors: tuple):
        self.call, self.desc, self.rows = call, desc, rows
        self.tensors = tensors  # alive until the call

    def __len__(self) -> int:
        return self.call.num_layers


def run_stack(steps: list[tuple], x: Tensor) -> Tensor:
    """steps: consecutive layers' (plan, cos, sin, k, v, rows); x (M, C) -> the last layer's output,
    each layer reading the one before: the layers one by one in a single kernel call
    (decoder_stack), so that no Python runs between them. rows = (base, pos, head stride, key
    stride[, table, block size[, ring]]), what a cache's `claim_decode` returns beside k and v: row
    m's keys start at k[base[m]] (floats from k's first element) and it writes key pos[m], then
    attends over keys 0 .. pos[m] (the plan's window: the last W of them). With a block table (M,
    width) int64 (a paged pool, base None), row m's key t is key row table[m, t // bs] * bs + t % bs
    of k's head planes instead; with a ring R (a windowed layer's ring: table None, bs 0), key t is
    row t % R. For the block's route, which has checked dtypes, contiguity and limits (M <= 64, the
    decode kernel's G and D); cos, sin (M, rotary dim / 2). `steps` may be a StackCall's BoundStack
    instead (the same layers' entries, built once for a cache's buffers)."""
    M, C = x.shape
    if type(steps) is BoundStack:
        if (M, C) != (steps.rows, steps.call.width):
            raise ValueError(f"decoder stack of {steps.rows} rows x {steps.call.width}: x {tuple(x.shape)}")
        return _call_stack(steps.desc, steps.call.fl, x)
    desc, fl = [], []
    for plan, cos, sin, k, v, rows in steps:
        if plan.dims[0] != C:
            raise ValueError(f"decoder stack: a layer of width {plan.dims[0]} in a stack of width {C}")
        desc += _descriptor(plan, cos, sin, k, v, rows)
        fl += _floats(plan)
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
