"""A decoder model's step runs on one of two executors, chosen once per step by `choose`.

    executor = choose(model, x, step)      # REFERENCE, or the model's FusedPlan
    x = executor.layers(model.layers, x, step)
    logits = executor.head(model.norm, model.lm_head, x)

- REFERENCE: the modules as written (blocks.DecoderBlock.forward, the norm, the head). Exact against
  transformers; every forward hook and analysis hook point (MultiHeadAttention.hook, as
  TransformerLens's HookPoints) runs; any dtype, gradients, torch.compile.
- fused (`FusedPlan`): headwise's kernels, the same numbers up to fp32 summation order. A decode
  step (one new token per sequence) runs each run of consecutive layers that have a C plan in one
  kernel call (layer_step.py: the whole stack at once where the cache books it, its descriptors
  reused); any other layer or step (a prefill, a cache that books outside the model, a backend
  asked for by name) runs blocks.fused_layer, ~10 kernel calls a layer; the head with its norm
  folded in.

`choose` reads declared facts only: inference (no grad, eval mode, not traced; blocks.route_allowed),
the step's rows (blocks.ROUTE_ROWS), no hook registered on any module of the model nor set in an
attention's analysis slot, and whether the model's FusedPlan still describes the model. The plan
(the modules each layer's fused step calls, the C layers' plans) is made once and kept in one place,
`_PLANS`, next to what invalidates it:
  - `invalidate(model)`, for a change torch does not see;
  - `_CHANGES`: torch's registration hooks count every module, parameter or buffer assigned to any
    module (a projection pruned or replaced, unfuse, tensor-parallel sharding, kv_map, a weight
    replaced by another tensor), so none of them is looked for per step;
  - torch's hook handle counter (RemovableHandle.next_id) moves on every hook registration: then,
    and only then, the model's hook dicts are looked at (a hook sends the step to REFERENCE; once
    removed, the next step is fused again);
  - the attention settings a caller may set by hand (the analysis hook slot, the backend) and the
    version counters of the fp32 weights the plan holds blocked copies of (in-place edits bump
    them), read each step in one C-level pass: ~30 + ~120 reads for SmolLM2;
  - the kernels' switches (kernels_unavailable, MAX_ROWS, KERNEL_ROWS).
"""

from __future__ import annotations

import operator
import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from .. import kernels
from ..kernels import layer as kernel_layer
from .blocks import Parts, fused_layer, fused_linear, parts_of, route_allowed
from .layer_step import WholeStack, claim, layer_plan

# Whether the fused executor runs decode steps' layers in the C stack; False: blocks.fused_layer for
# every layer, the same kernels one by one (tests and benchmarks compare the two).
STACK = True

_CHANGES = [0]  # modules, parameters and buffers assigned anywhere since import


def _count_change(module, name, value) -> None:
    _CHANGES[0] += 1


torch_module.register_module_module_registration_hook(_count_change)
torch_module.register_module_parameter_registration_hook(_count_change)
torch_module.register_module_buffer_registration_hook(_count_change)

# What a caller may set on an attention by hand (plain attributes, read from its __dict__: C-level
# lookups, half the time of getattr through nn.Module's class chain)
_ATTN_SETTINGS = operator.itemgetter("hook", "backend")
_VERSION = operator.attrgetter("_version")


class _Reference:
    """The modules as written."""

    name = "reference"

    @staticmethod
    def layers(layers: nn.ModuleList, x: Tensor, step) -> Tensor:
        for i, layer in enumerate(layers):
            x = layer(x, step, i)
        return x

    @staticmethod
    def head(norm: nn.Module, head: nn.Module, x: Tensor) -> Tensor:
        return head(norm(x))


REFERENCE = _Reference()


class _Layer(NamedTuple):
    parts: Parts | None  # None: a block fused_layer cannot run (it runs its own forward)
    plan: kernel_layer.StepPlan | None  # the C layer, None where it does not apply


class FusedPlan:
    """The fused executor of one model as it is now: each layer's Parts and C plan, and what tells
    when they no longer describe it (`current`)."""

    name = "fused"

    def __init__(self, model: nn.Module, layers: nn.ModuleList):
        self.changes = _CHANGES[0]
        self.kernels = _kernel_state()
        self.hook_dicts = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.handles = RemovableHandle.next_id
        self.hooked = any(self.hook_dicts)
        self.steps = []
        for block in layers:
            p = parts_of(block)
            self.steps.append(_Layer(p, None if p is None else layer_plan(p)))
        self.attn_dicts = [s.parts.attn.__dict__ for s in self.steps if s.parts is not None]
        self.settings = list(map(_ATTN_SETTINGS, self.attn_dicts))
        self.slot_hooked = any(hook is not None for hook, _ in self.settings)  # an analysis run's hook slot
        copied = [m.weight for s in self.steps if s.plan is not None for m in s.parts.linears if m.copies_weight]
        self.versioned = [w for w in copied if not w.is_inference()]  # an inference tensor has no version
        self.versions = list(map(_VERSION, self.versioned))
        stacked = [s for s in self.steps if s.plan is not None]
        linears = [m for s in stacked for m in s.parts.linears]
        self.rows = min([kernels.KERNEL_ROWS, *(m.kernel_rows() for m in linears)])  # the C stack's row limit
        ropes = {id(s.parts.rope) for s in self.steps if s.parts is not None}
        whole = stacked and len(stacked) == len(self.steps) and len(ropes) == 1
        self.whole = WholeStack([s.plan for s in self.steps], self.steps[0].parts.rope) if whole else None

    def current(self) -> bool:
        """Whether the plan still describes the model (the module docstring's list)."""
        return (
            self.changes == _CHANGES[0]
            and self.kernels == _kernel_state()
            and list(map(_ATTN_SETTINGS, self.attn_dicts)) == self.settings
            and list(map(_VERSION, self.versioned)) == self.versions
        )

    def has_hooks(self) -> bool:
        """Whether a hook sits on one of the model's modules or in an attention's analysis slot. The
        modules' hook dicts are looked at only when a hook was registered anywhere since the last
        look (removals do not move the counter, so a hooked model keeps looking)."""
        if RemovableHandle.next_id != self.handles or self.hooked:
            self.hooked = any(self.hook_dicts)
            self.handles = RemovableHandle.next_id
        return self.hooked or self.slot_hooked

    def layers(self, layers: nn.ModuleList, x: Tensor, step) -> Tensor:
        """x (B, T, C) through every layer: C stacks where they apply, else fused_layer."""
        B, T, C = x.shape
        N = B * T
        h = x.reshape(N, C)
        decode = STACK and (T == 1 or B == 1) and step.num_real is None and N <= self.rows and h.dtype is torch.float32
        if decode and self.whole is not None:
            y = self.whole.run(step, h)
            if y is not None:
                return y.view(B, T, C)
        L, i = len(self.steps), 0
        while i < L:
            claims = []
            while decode and i + len(claims) < L:  # the run of layers from i whose caches book the step
                s = self.steps[i + len(claims)]
                got = None if s.plan is None else claim(s.plan, s.parts.rope, step, i + len(claims), N)
                if got is None:
                    break
                claims.append(got)
            if claims:
                h = kernel_layer.run_stack(claims, h)
                i += len(claims)
                continue
            s = self.steps[i]
            if s.parts is None:
                h = layers[i](h.view(B, T, C), step, i).reshape(N, C)
            else:
                h = fused_layer(s.parts, h.view(B, T, C), step, step.layer(i)).reshape(N, C)
            i += 1
        return h.view(B, T, C)

    @staticmethod
    def head(norm: nn.Module, head: nn.Module, x: Tensor) -> Tensor:
        """head(norm(x)) for x (..., C), the norm folded into the head's kernel."""
        return fused_linear(head, x.reshape(-1, x.shape[-1]), norm=norm).view(*x.shape[:-1], -1)


def _kernel_state() -> tuple:
    return (id(kernels.kernels_unavailable), kernels.MAX_ROWS, kernels.KERNEL_ROWS)


# The one place fused plans live: model -> its FusedPlan, made at its first fused step and made
# again when `current` says it no longer describes the model. Weak: a model that goes takes its plan.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def invalidate(model: nn.Module) -> None:
    """Drop the model's fused plan: its next fused step makes a new one. For changes torch's counters
    do not see (settings of the model's modules written into their __dict__ by hand)."""
    _PLANS.pop(model, None)


def choose(model: nn.Module, x: Tensor, step) -> _Reference | FusedPlan:
    """The executor of this step of x (B, T, C) through `model` (its `layers`): the module
    docstring's facts, read once here."""
    if not route_allowed(model, x.shape[0] * x.shape[1]):
        return REFERENCE
    plan = _PLANS.get(model)
    if plan is None or not plan.current():
        plan = _PLANS[model] = FusedPlan(model, model.layers)
    return REFERENCE if plan.has_hooks() else plan
