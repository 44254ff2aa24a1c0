"""The decoder block's few-rows route for a decode step in one kernel call (kernels/layer.py).

When every new row is one token of its own sequence over an fp32 or int8 cache that hands out
its buffers (`claim_decode`: a contiguous cache's rows, or a packed paged step's pool with each
sequence's run start or block table), and the layer is the pre-norm SwiGLU kind whose four
linears all run on headwise's kernels (fp32 blocked or quantized), blocks.DecoderBlock._few_rows
hands the whole layer to `kernels.layer.run_stack`: the same kernels it would call one by one,
without ~40 Python-level operations between them (an int8 cache's keys quantized and read by the
kernel, as the route's quantize_int8 / dequantize_int8 do). Anything else (a prefill, a static
cache, ALiBi, a forced attention backend, uneven GQA groups, another norm or MLP) returns None and
the route continues as written.
"""

from __future__ import annotations

import operator
import weakref
from itertools import repeat

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .. import kernels
from ..kernels import attention as kernel_attention
from ..kernels import layer as kernel_layer
from .linear import QuantizedLinear
from .packing import PackedLinear

_ATTN_STATE = operator.attrgetter("hook", "fused", "backend")  # what _route_ok and _plan read of an attention
_VERSION = operator.attrgetter("_version")


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
    (from layer n) one by one: a layer that does not apply has booked nothing.

    Once every layer has taken the one call, what made each one apply is remembered for the whole
    stack (_StackMemo) and checked again in one pass per step; only the caches' claims run per
    layer then."""
    B, T, C = x.shape
    h = x.reshape(B * T, C)
    memo = layers.__dict__.get("_stack_memo")
    if memo is not None and memo.holds(layers, h, step, B, T):
        y = memo.run(step, h)
        if y is not None:
            return y.view(B, T, C), len(memo.plans)
        claims = memo.claims(step, h.shape[0])
    else:
        claims = []
        for i, layer in enumerate(layers):
            one_call = getattr(layer, "one_call_claim", None)  # another kind of block (tensor-parallel) has none
            if one_call is None or layer._forward_hooks or layer._forward_pre_hooks or not layer._route_ok():
                break
            claimed = one_call(h, step, step.layer(i), B, T)
            if claimed is None:
                break
            claims.append(claimed)
        memo = _StackMemo(layers, h) if claims and len(claims) == len(layers) else None
        if memo is not None:
            memo.vouched = step.model_vouch  # built from the model as this step found it
        layers.__dict__["_stack_memo"] = memo
    if not claims:
        return x, 0
    return kernel_layer.run_stack(claims, h).view(B, T, C), len(claims)


class _StackMemo:
    """Why every layer of a stack took its one call at N rows, in flat columns checked in one pass
    of C-level maps (each layer's own checks, _route_ok, one_call_claim and _cached_plan, cost
    ~20 us a layer inside a decode step, where the weights streamed through the cache evict the
    interpreter's: ~0.6 ms of a 4-5 ms SmolLM2 token): the same layer and part modules, no hook on
    any of them, the attention's settings, each weight unchanged (the blocks' plan memos'
    watches), the kernels' state, and claim_step itself (tests swap it out)."""

    def __init__(self, layers, h: Tensor):
        from . import blocks  # the name the blocks call claim_step by

        self.layers = tuple(layers._modules.values())
        parts = [layer._parts() for layer in self.layers]
        self.dicts = [
            d for layer, p in zip(self.layers, parts) for d in (layer._modules, p.attn._modules, p.mlp._modules)
        ]
        self.copies = [dict(d) for d in self.dicts]  # compared whole: modules have no __eq__, so by identity
        self.hooks = tuple(
            d
            for layer, p in zip(self.layers, parts)
            for d in (layer._forward_hooks, layer._forward_pre_hooks, *p.hook_dicts)
        )
        self.attns = [p.attn for p in parts]
        self.attn_ok = [(None, True, "auto")] * len(self.attns)  # each attention's hook, fused, backend
        self.buffers = [a._buffers for a in self.attns]
        watch = [w for layer in self.layers for w in layer.__dict__["_step_memo"][1]]
        self.weight_dicts, self.weight_names, self.weights = ([w[k] for w in watch] for k in range(3))
        self.versioned = [t for _, _, t, v in watch if v is not None]
        self.versions = [v for *_, v in watch if v is not None]
        self.plans = tuple((layer.__dict__["_step_memo"][2], p.rope) for layer, p in zip(self.layers, parts))
        ropes = {id(p.rope) for p in parts}
        self.rope = parts[0].rope if len(ropes) == 1 else None  # one RoPE for all: one pair of rows a step
        self.stack_call = None  # (weak ref to a cache's StackParts, the kernel_layer.StackCall built on them)
        self.state = (h.shape[0], id(kernels.kernels_unavailable), kernels.MAX_ROWS, kernels.KERNEL_ROWS)
        self.blocks, self.claim_fn = blocks, blocks.claim_step
        self.handles = RemovableHandle.next_id  # no hook on any of them now (every layer took the call)
        self.vouched = None  # the Step.model_vouch of the run whose step last checked all this

    def holds(self, layers, h: Tensor, step, B: int, T: int) -> bool:
        """Whether each layer would take its one call again (their caches' claims aside). The
        modules are looked at once per run whose caller vouches that nothing changes the model
        while it runs (Step.model_vouch: a whole generate(), a server's engine), not at each of
        its steps (~0.2 ms of a 4 ms SmolLM2 token, all cache misses after the weight stream)."""
        vouch = step.model_vouch
        n = len(self.attns)
        if not (
            (T == 1 or B == 1)
            and h.dtype is torch.float32
            and step.num_real is None
            and self.state == (h.shape[0], id(kernels.kernels_unavailable), kernels.MAX_ROWS, kernels.KERNEL_ROWS)
            and self.blocks.claim_step is self.claim_fn
        ):
            return False
        if vouch is not None and vouch is self.vouched:
            return True
        if not (
            tuple(layers._modules.values()) == self.layers
            and self.dicts == self.copies  # C-level dict comparisons, 4x faster than tuples of their values
            and (RemovableHandle.next_id == self.handles or self._no_hooks())
            and list(map(_ATTN_STATE, self.attns)) == self.attn_ok
            and all(map(operator.is_, map(dict.get, self.buffers, repeat("kv_map", n)), repeat(None, n)))
            and all(map(operator.is_, map(dict.get, self.weight_dicts, self.weight_names), self.weights))
            and list(map(_VERSION, self.versioned)) == self.versions
        ):
            return False
        self.vouched = vouch  # the run whose word covers the steps after this one
        return True

    def _no_hooks(self) -> bool:
        """Every hook is added through a handle (torch.utils.hooks.RemovableHandle), whose id counts
        them: while it stands still, no module got one; when it moved, look at each dict."""
        if any(self.hooks):
            return False
        self.handles = RemovableHandle.next_id
        return True

    def run(self, step, h: Tensor) -> Tensor | None:
        """Every layer's step in one call where the step books the whole stack at once
        (claim_stack: a contiguous cache with every layer at the same lengths, or a packed paged
        step of one token per sequence): the descriptors built for the cache's buffers are
        reused, only the step's rows and RoPE rows written into them. None, with nothing booked,
        where that does not apply."""
        claim = step.claim_stack
        if claim is None or self.rope is None:
            return None
        got = claim(h.shape[0], len(self.plans))
        if got is None:
            return None
        parts, rows = got
        built = self.stack_call  # read once: another thread may step this model over another cache
        if built is None or built[0]() is not parts:
            entries = [(plan, *layer) for (plan, _), layer in zip(self.plans, parts.layers)]
            built = self.stack_call = (weakref.ref(parts), kernel_layer.StackCall(entries))
        cos, sin = step.rope_rows(self.rope)
        return kernel_layer.run_stack(built[1].at(rows, cos, sin), h)

    def claims(self, step, N: int) -> list[tuple]:
        """Each layer's entry of run_stack, its new keys booked, up to the first whose cache cannot
        take them (as claim_step: nothing booked for that one)."""
        claims = []
        for i, (plan, rope) in enumerate(self.plans):
            claim = getattr(step.layer(i), "claim_decode", None)
            if claim is None:
                break
            cos, sin = step.rope_rows(rope)
            claimed = claim(N)
            if claimed is None:
                break
            claims.append((plan, cos, sin, *claimed))
        return claims


def _weights_watch(p) -> tuple:
    """What the plan depends on besides the modules themselves (p changes when one is replaced):
    per weight, (the dict it sits in, its name, the tensor, its version outside inference mode:
    in-place edits bump it). The version only where the plan holds a copy made from the weight
    (a PackedLinear's blocked weight); a quantized linear's blocks and the norms' weights are read
    through their own pointers (QuantPlan, StepPlan keep the tensors), so an in-place edit reaches
    the kernel as it is, and reading 180 versions per SmolLM2 step (cache misses after the weight
    stream, ~0.1 ms) buys nothing. None for those and for an inference tensor, which has none."""
    watch = []
    qkv = p.qkv if type(p.qkv) is tuple else (p.qkv,)
    for m in (*qkv, p.out, *p.mlp._modules.values(), p.attn_norm, p.mlp_norm):
        d, name = m._buffers, "blocks"
        t = d.get(name)
        if t is None:  # a plain weight, or a module of neither kind (parallel's RowParallelLinear): None
            d, name = m._parameters, "weight"
            t = d.get(name)
        by_pointer = type(m) is QuantizedLinear or m is p.attn_norm or m is p.mlp_norm
        watch.append((d, name, t, None if t is None or by_pointer or t.is_inference() else t._version))
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
    qkv = p.qkv if type(p.qkv) is tuple else (p.qkv,)  # q, k, v apart (MultiHeadAttention.unfuse), or one
    flat = tuple(_linear_plan(m, h, h.shape[0]) for m in (*qkv, p.out, mm["gate_up"], mm["down"]))
    if any(pl is None for pl in flat):
        return None
    plans = (flat[:3] if len(qkv) == 3 else flat[0], *flat[len(qkv) :])
    key = (*map(id, flat), p.attn_norm.weight.data_ptr(), p.mlp_norm.weight.data_ptr(), H, Hkv, D)
    cached = block.__dict__.get("_step_plan")
    if cached is None or cached[0] != key:
        norms = (p.attn_norm.weight.detach(), p.mlp_norm.weight.detach())
        cached = (key, kernel_layer.plan_step(plans, *norms, p.attn_norm.eps, H, Hkv, D))
        block.__dict__["_step_plan"] = cached
    return cached[1]
