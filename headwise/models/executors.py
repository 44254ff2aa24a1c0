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
`_PLANS`, next to what invalidates it, all counters read in O(1) per step (a decode step streams
every weight through the caches; reading ~150 module attributes after it cost ~0.1 ms of a 4 ms
SmolLM2 token):
  - `_CHANGES`: torch's registration hooks count every module, parameter or buffer assigned to any
    module (a projection pruned or replaced, unfuse, tensor-parallel sharding, kv_map, a weight
    replaced by another tensor);
  - torch's hook handle counter (RemovableHandle.next_id) moves on every hook registration: then,
    and only then, the model's hook dicts are looked at (a hook sends the step to REFERENCE; once
    removed, the next step is fused again);
  - MultiHeadAttention.settings_changes: every setting of an attention's analysis hook slot or
    backend (headwise.analysis.hooks fills and empties the slots for one run);
  - the kernels' switches (kernels_unavailable, MAX_ROWS, KERNEL_ROWS);
  - an fp32 weight edited in place (`weight.mul_()`) after the plan was made, whose blocked copy
    (PackedLinear) the C stack reads, is seen by `check_weights(model)` (O(parameters): the runtime
    calls it when requests start, so each generate() call and each new request sees the weights
    as they are), or dropped at once by `invalidate(model)`. Quantized blocks and
    norm weights are read through their own pointers, so their in-place edits need nothing.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from .. import kernels
from ..attention import MultiHeadAttention
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
        self.changes, self.settings = _CHANGES[0], MultiHeadAttention.settings_changes
        self.kernels = _kernel_state()
        self.hook_dicts = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.handles = RemovableHandle.next_id
        self.hooked = any(self.hook_dicts)
        self.steps = []
        for block in layers:
            p = parts_of(block)
            self.steps.append(_Layer(p, None if p is None else layer_plan(p)))
        self.slot_hooked = any(s.parts.attn.hook is not None for s in self.steps if s.parts is not None)
        stacked = [s for s in self.steps if s.plan is not None]
        linears = [m for s in stacked for m in s.parts.linears]
        self.rows = min([kernels.KERNEL_ROWS, *(m.kernel_rows() for m in linears)])  # the C stack's row limit
        self.versions = _param_versions(model)  # PackedLinear's blocked copies are of these weights
        whole = stacked and len(stacked) == len(self.steps)
        self.whole = WholeStack([s.plan for s in self.steps], [s.parts.rope for s in self.steps]) if whole else None

    def current(self) -> bool:
        """Whether the plan still describes the model (the module docstring's list)."""
        return (
            self.changes == _CHANGES[0]
            and self.settings == MultiHeadAttention.settings_changes
            and self.kernels == _kernel_state()
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
    """Drop the model's fused plan: its next fused step makes a new one. For a change no counter sees
    (the module docstring): an fp32 weight edited in place after the plan was made."""
    _PLANS.pop(model, None)


# model -> (the registration count when listed, its modules, its parameters with a version): model_version's
# lists, remade after any module, parameter or buffer assignment
_MEMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _members(model: nn.Module) -> tuple[list, list]:
    """-> (the model's modules, its parameters that keep a version), listed again only after a registration."""
    held = _MEMBERS.get(model)
    if held is None or held[0] != _CHANGES[0]:
        held = _MEMBERS[model] = (
            _CHANGES[0],
            list(model.modules()),
            [p for p in model.parameters() if not p.is_inference()],
        )
    return held[1], held[2]


def _param_versions(model: nn.Module) -> int:
    """The sum of the parameters' tensor versions: moves with every in-place edit of one."""
    return sum(p._version for p in _members(model)[1])


def model_version(model: nn.Module) -> tuple:
    """A value that moves whenever what the model computes may have: a module, parameter or buffer
    assigned anywhere, a hook registered, an attention's hook slot or backend set, the hooks now on
    its modules, a parameter edited in place. ~50 us on SmolLM2 (276 modules): for the moments K/V computed
    earlier would be reused (a prefix cache's lookups), not for every step."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in _members(model)[0])
    return (_CHANGES[0], RemovableHandle.next_id, MultiHeadAttention.settings_changes, hooks, _param_versions(model))


def check_weights(model: nn.Module) -> None:
    """Drop the model's fused plan if a parameter was edited in place since it was made (the blocked
    fp32 copies it reads would be stale): O(parameters), when requests start, not per step."""
    plan = _PLANS.get(model)
    if plan is not None and plan.versions != _param_versions(model):
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
