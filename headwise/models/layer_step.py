"""The decoder block's few-rows route for a decode step in one kernel call (kernels/layer.py).

When every new row is one token of its own sequence over an fp32 cache that hands out its
buffers (`claim_decode`: a contiguous cache's rows, or a packed paged step's pool with each
sequence's run start or block table), and the layer is the pre-norm SwiGLU kind whose four
linears all run on headwise's kernels (fp32 blocked or quantized), blocks.DecoderBlock._few_rows
hands the whole layer to `kernels.layer.run_stack`: the same kernels it would call one by one,
without ~40 Python-level operations between them. Anything else (a prefill, an int8 or static
cache, ALiBi, a forced attention backend, uneven GQA groups, another norm or MLP) returns None and
the route continues as written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..kernels import attention as kernel_attention
from ..kernels import layer as kernel_layer
from .linear import QuantizedLinear
from .packing import PackedLinear


def claim_step(block, p, h: Tensor, step, cache) -> tuple | None:
    """The layer's one-call step for h (N, C), its new keys booked in the cache: (plan, cos, sin,
    K, V, rows), one layer's entry of kernel_layer.run_stack; or None, with nothing booked, where
    the one call does not apply."""
    N = h.shape[0]
    claim = getattr(cache, "claim_decode", None)
    if claim is None or step.num_real is not None or N > kernels.KERNEL_ROWS:
        return None
    plan = _cached_plan(block, p, h)
    if plan is None:
        return None
    cos, sin = step.rope_rows(p.rope)
    claimed = claim(N)
    if claimed is None:
        return None
    return (plan, cos, sin, *claimed)


def stack_step(layers, x: Tensor, step) -> tuple[Tensor, int]:
    """x (B, T, C) of a step through `layers` (DecoderBlocks; the caller checked route_allowed) ->
    (the output of the first n layers, n): the longest run of leading layers whose one-call step
    applies, all in one kernel call (kernel_layer.run_stack), or (x, 0). The model runs the rest
    (from layer n) one by one: a layer that does not apply has booked nothing."""
    B, T, C = x.shape
    h = x.reshape(B * T, C)
    claims = []
    for i, layer in enumerate(layers):
        one_call = getattr(layer, "one_call_claim", None)  # another kind of block (tensor-parallel) has none
        if one_call is None or layer._forward_hooks or layer._forward_pre_hooks or not layer._route_ok():
            break
        claimed = one_call(h, step, step.layer(i), B, T)
        if claimed is None:
            break
        claims.append(claimed)
    if not claims:
        return x, 0
    return kernel_layer.run_stack(claims, h).view(B, T, C), len(claims)


def _weights_watch(p) -> tuple:
    """What the plan depends on besides the modules themselves (p changes when one is replaced):
    per weight, (the dict it sits in, its name, the tensor, its version outside inference mode:
    in-place edits bump it; None for an inference tensor, which has none)."""
    watch = []
    for m in (p.qkv, p.out, *p.mlp._modules.values(), p.attn_norm, p.mlp_norm):
        d, name = m._buffers, "blocks"
        t = d.get(name)
        if t is None:  # a plain weight, or a module of neither kind (parallel's RowParallelLinear): None
            d, name = m._parameters, "weight"
            t = d.get(name)
        watch.append((d, name, t, None if t is None or t.is_inference() else t._version))
    return tuple(watch)


def _weights_unchanged(watch: tuple) -> bool:
    for d, name, t, version in watch:
        if d.get(name) is not t or (version is not None and t._version != version):
            return False
    return True


def _cached_plan(block, p, h: Tensor):
    """_plan, checked again only when the parts, a weight, the row count or the kernels' state change."""
    attn = p.attn
    # what a caller may change between steps: the attention backend, a kernel switched off (tests do)
    kv_map, off = attn._buffers.get("kv_map"), kernels.kernels_unavailable
    state = (id(p), h.shape[0], attn.backend, kv_map is None, id(off), kernels.MAX_ROWS)
    memo = block.__dict__.get("_step_memo")
    if memo is not None and memo[0] == state and _weights_unchanged(memo[1]):
        return memo[2]
    plan = _plan(block, p, h)
    block.__dict__["_step_memo"] = (state, _weights_watch(p), plan)
    return plan


def _linear_plan(module, h: Tensor, rows: int):
    kind = type(module)
    if kind is QuantizedLinear:
        return module.route_plan(h)  # x is only checked for dtype / rows: any fp32 (N, in) says the same
    if kind is PackedLinear and module.weight.dtype is torch.float32 and rows <= kernels.MAX_ROWS:
        return module.kernel_plan() if kernels.kernels_unavailable() is None else None
    return None


def _plan(block, p, h: Tensor):
    """The layer's kernel_layer.StepPlan, remade when a module or a weight changes; None if it cannot run."""
    attn, rope, mm = p.attn, p.rope, p.mlp._modules
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if not (
        p.swiglu
        and rope is not None
        and not rope.interleaved
        and rope.dim == D
        and attn.alibi_slopes is None
        and attn.backend == "auto"
        and attn._buffers.get("kv_map") is None
        and H % Hkv == 0
        and kernel_attention.fits(H // Hkv, D)
        and p.attn_norm.eps == p.mlp_norm.eps
        and p.attn_norm.weight.dtype is torch.float32
        and p.mlp_norm.weight.dtype is torch.float32
        and kernel_attention.decode_attention_unavailable() is None
    ):
        return None
    plans = tuple(_linear_plan(m, h, h.shape[0]) for m in (p.qkv, p.out, mm["gate_up"], mm["down"]))
    if any(pl is None for pl in plans):
        return None
    key = (*map(id, plans), p.attn_norm.weight.data_ptr(), p.mlp_norm.weight.data_ptr(), H, Hkv, D)
    cached = block.__dict__.get("_step_plan")
    if cached is None or cached[0] != key:
        norms = (p.attn_norm.weight.detach(), p.mlp_norm.weight.detach())
        cached = (key, kernel_layer.plan_step(plans, *norms, p.attn_norm.eps, H, Hkv, D))
        block.__dict__["_step_plan"] = cached
    return cached[1]
