"""The fused executor's decode step: a run of decoder layers in one kernel call (kernels/layer.py).

When every new row is one token of its own sequence over an fp32 or int8 cache that hands out
its buffers (`claim_decode`: a contiguous cache's rows, or a packed paged step's pool with each
sequence's run start or block table), and the layer's four linears all run on headwise's kernels
(fp32 blocked or quantized), the layer has a `layer_plan` and `kernels.layer.run_stack` runs it:
the same kernels `blocks.fused_layer` would call one by one, without ~40 Python-level operations
between them (an int8 cache's keys quantized and read by the kernel, as the cache's quantize_int8 /
dequantize_int8 do). The block's spec is the plan's data, one kernel for every family: RMSNorms,
QK-norm (Qwen3, Gemma 3), post-norms (Gemma), SwiGLU or GeGLU, the layer's window, scale, soft-cap
(Gemma 2) and rotary (partial rotary too: Phi-3).
Consecutive such layers go in one call. Anything else (a prefill, a static cache, ALiBi, a forced
attention backend, uneven GQA groups, interleaved RoPE, another norm or MLP) has no plan
or books nothing, and runs `blocks.fused_layer`.
"""

from __future__ import annotations

import weakref

from torch import Tensor

from ..kernels import attention as kernel_attention
from ..kernels import layer as kernel_layer


def layer_plan(p) -> kernel_layer.StepPlan | None:
    """The layer's kernel_layer.StepPlan for blocks.Parts p, None where the one call cannot run it.
    Each linear kind says whether its kernel can (`stack_plan`); the block's spec (QK-norm,
    post-norms, GeGLU, window, scale) goes into the plan as data."""
    attn, rope = p.attn, p.rope
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    norms = (p.attn_norm, p.mlp_norm, *(p.post_norms or ()))
    qk_norms = [n for n in p.qk_norms if n is not None]
    if not (
        p.glu in kernel_layer.GLU_PROLOGUES
        and rope is not None
        and not rope.interleaved
        and rope.dim <= D
        and rope.dim % 2 == 0
        and attn.alibi_slopes is None
        and attn.backend == "auto"
        and attn._buffers.get("kv_map") is None
        and H % Hkv == 0
        and kernel_attention.fits(H // Hkv, D)
        and all(_rms_weight(n, p.attn_norm.eps) is not None for n in norms)
        and len({n.eps for n in qk_norms}) <= 1
        and all(_rms_weight(n, n.eps) is not None for n in qk_norms)
        and kernel_attention.decode_attention_unavailable() is None
    ):
        return None
    flat = []
    for m in p.linears:
        stack_plan = getattr(type(m), "stack_plan", None)
        plan = stack_plan(m) if stack_plan is not None else None
        if plan is None:
            return None
        flat.append(plan)
    qkv = tuple(flat[:3]) if len(flat) == 6 else flat[0]  # q, k, v apart (MultiHeadAttention.unfuse), or one
    post = tuple(_rms_weight(n, p.attn_norm.eps) for n in p.post_norms) if p.post_norms else (None, None)
    return kernel_layer.plan_step(
        (qkv, *flat[-3:]),
        _rms_weight(p.attn_norm, p.attn_norm.eps),
        _rms_weight(p.mlp_norm, p.attn_norm.eps),
        p.attn_norm.eps,
        H,
        Hkv,
        D,
        qk_norms=tuple(None if n is None else _rms_weight(n, n.eps) for n in p.qk_norms),
        qk_eps=qk_norms[0].eps if qk_norms else 0.0,
        post_norms=post,
        glu=p.glu,
        window=getattr(attn, "window", None),
        scale=getattr(attn, "scale", None),
        softcap=getattr(attn, "softcap", None),
        rotary_dim=rope.dim,
    )


def _rms_weight(norm, eps: float) -> Tensor | None:
    """An fp32 RMSNorm's weight (a norm with `rms_args`) of this eps, for the kernel; None otherwise."""
    rms = getattr(type(norm), "rms_args", None)
    args = rms(norm) if rms is not None else None
    if args is None or args[1] != eps:
        return None
    return args[0].detach()


def claim(plan: kernel_layer.StepPlan, rope, step, i: int, N: int) -> tuple | None:
    """Layer i's entry of kernel_layer.run_stack for N new rows, its new keys booked in its cache:
    (plan, cos, sin, K, V, rows); None, with nothing booked, where its cache cannot hand them out."""
    book = getattr(step.layer(i), "claim_decode", None)
    if book is None:
        return None
    cos, sin = step.rope_rows(rope)
    claimed = book(N)
    if claimed is None:
        return None
    return (plan, cos, sin, *claimed)


class WholeStack:
    """Every layer's step in one call where the step books the whole stack at once (claim_stack:
    a contiguous cache with every layer at the same lengths, or a packed paged step of one token per
    sequence): the descriptors are built once per cache's buffers (kernel_layer.StackCall) and only
    the step's rows and RoPE rows written into them. `ropes`: each layer's rotary (Gemma 3's local
    and global layers have two)."""

    def __init__(self, plans: list, ropes: list):
        self.plans = plans
        ids = list(dict.fromkeys(id(r) for r in ropes))  # the distinct rotaries, in order
        self.ropes = [next(r for r in ropes if id(r) == i) for i in ids]
        self.rope_of = [ids.index(id(r)) for r in ropes]  # each layer's among them
        # (a weak reference to the cache's StackParts, the kernel_layer.StackCall built on its buffers)
        self.built = None

    def run(self, step, h: Tensor) -> Tensor | None:
        """h (N, C) through every layer; None, with nothing booked, where the step cannot book them all."""
        book = step.claim_stack
        if book is None:
            return None
        got = book(h.shape[0], len(self.plans))
        if got is None:
            return None
        parts, rows = got
        built = self.built  # read once: another thread may step this model over another cache
        if built is None or built[0]() is not parts:  # a weak reference: the plan keeps no cache alive
            entries = [(p, *kv) for p, kv in zip(self.plans, parts.layers)]
            built = self.built = (weakref.ref(parts), kernel_layer.StackCall(entries))
        ropes = self.ropes
        if len(ropes) == 1:
            cos, sin = step.rope_rows(ropes[0])
        else:
            tables = [step.rope_rows(r) for r in ropes]
            cos, sin = [tables[i][0] for i in self.rope_of], [tables[i][1] for i in self.rope_of]
        return kernel_layer.run_stack(built[1].at(rows, cos, sin), h)
