"""Prepacked linears for CPU inference: the weight reordered once into oneDNN's blocked layout.

A one-token decode step is a chain of matrix-vector products, so its speed is how fast the
weights stream from memory. PyTorch's `F.linear` on a plain (out, in) fp32 weight does that
at about half the bandwidth oneDNN reaches on the same weight reordered for it (measured
here, 2 threads, the 49152x576 output layer of SmolLM2: 11.5 ms plain vs 6.1 ms packed;
whole decode step, every linear packed: 1.46x tokens/s). Inductor does the same reorder
when it freezes a compiled graph; this gets it without compiling.

`PackedLinear` *is* an `nn.Linear` (same parameters, state_dict, hooks, `isinstance`): only
its forward changes, and only when nothing needs gradients. The packed copy is made on
first use and remade whenever the weight changes (in-place edits bump the tensor's version
counter; pruning swaps the module). Cost: a second copy of each packed weight (+1x weight
memory), which `unpack_linears` gives back. Forwards of at most `kernels.MAX_ROWS` rows (a
decode step of a small batch) go to `headwise.kernels.small_linear` instead where it runs, on
a second copy in its blocked layout (made on the first such forward): for so few rows it
streams the weight faster than oneDNN does. A model that prefills and decodes holds three
copies of each weight: the parameter, oneDNN's and the blocked one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from .fused_ops import composed, kernel_args

PACKED_DTYPES = (torch.float32,)  # bf16 without native bf16 units is slower than fp32 here anyway
# oneDNN's batch-size hint when packing: any number of rows works, but a hint of 16 made the
# 8-row decode step 1.3x faster than a hint of 1 here, and left prefill unchanged.
PACK_HINT = 16


@functools.cache
def packing_available() -> str | None:
    """None if oneDNN prepacked linears run (and agree with F.linear) here, else why not."""
    try:
        w, x = torch.randn(8, 4), torch.randn(2, 3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 1), None, "none", [], "")
        if not torch.allclose(y, F.linear(x, w), atol=1e-5):
            return "oneDNN's linear disagrees with F.linear"
        return None
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # no mkldnn build, or the ops moved
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


class PackedLinear(nn.Linear):
    """nn.Linear with prepacked copies of its weight for gradient-free CPU forwards: oneDNN's
    for many rows, headwise.kernels' blocked one for a few (a decode step)."""

    _packed: Tensor | None = None
    _packed_key: tuple | None = None
    _blocked: Tensor | None = None
    _blocked_key: tuple | None = None
    _plan: kernels.LinearPlan | None = None
    _plan_key: tuple | None = None

    def _key(self) -> tuple:
        w = self._parameters["weight"]
        # Weights made under inference_mode keep no version counter (they can only be edited
        # inside inference_mode): for them a new tensor, not an in-place edit, is what repacks.
        return (w.data_ptr(), None if w.is_inference() else w._version, w.dtype, tuple(w.shape))

    def _prepacked_ok(self, x: Tensor) -> bool:
        """Whether a prepacked copy may serve x: a CPU forward in a packed dtype, no gradient
        wanted, not being traced by torch.compile (inductor packs on its own when freezing)."""
        w = self.weight
        return (
            x.is_cpu
            and x.dtype == w.dtype
            and w.dtype in PACKED_DTYPES
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not torch.compiler.is_compiling()
        )

    def _few_rows(self, x: Tensor) -> bool:
        """Whether x (already past _prepacked_ok) goes to the small-row kernel."""
        return (
            x.dtype is torch.float32
            and x.is_contiguous()
            and x.numel() <= kernels.MAX_ROWS * x.shape[-1]
            and kernels.kernels_unavailable() is None
        )

    def route_plan(self, x: Tensor) -> kernels.LinearPlan | None:
        """kernel_plan() when x goes to the small-row kernel from the decoder block's few-rows
        route, else None. The route runs only without grad and outside torch.compile
        (blocks.route_allowed), so only x and the weight are checked here: the per-call cost
        is paid ~120 times a decode step."""
        ok = x.is_cpu and self._parameters["weight"].dtype is torch.float32 and self._few_rows(x)
        return self.kernel_plan() if ok else None

    def fused_forward(self, x: Tensor, *, residual=None, norm=None, swiglu=False, rope=None) -> Tensor:
        """fused_ops.fused_linear for this kind: one small-row kernel call with the prologue and
        epilogue folded in where route_plan allows, else composed around oneDNN's matmul."""
        plan = self.route_plan(x)
        if plan is None:
            return composed(self, x, residual=residual, norm=norm, swiglu=swiglu, rope=rope, add=self.forward_add)
        x, epilogue = kernel_args(x, norm, swiglu, rope)
        return kernels.run_linear(plan, x, residual=residual, **epilogue)

    def stack_plan(self) -> kernels.LinearPlan | None:
        """kernel_plan() for the C layer stack (models/layer_step.py), None where its kernel cannot run.
        The stack keeps this plan, the blocked copy, until models.executors.invalidate(model): after an
        in-place edit of the weight (no counter sees it), call that."""
        w = self._parameters["weight"]
        if w.dtype is torch.float32 and w.is_cpu and kernels.kernels_unavailable() is None:
            return self.kernel_plan()
        return None

    @staticmethod
    def kernel_rows() -> int:
        """The most rows stack_plan's kernel takes in one call."""
        return kernels.MAX_ROWS

    def kernel_plan(self) -> kernels.LinearPlan:
        """The blocked weight and bias checked for kernels.run_linear, remade after any change."""
        b = self._parameters["bias"]
        key = (*self._key(), None if b is None else b.data_ptr())
        if key != self._plan_key:
            self._plan = kernels.plan_linear(self.blocked_weight(), self.out_features, b)
            self._plan_key = key
        return self._plan

    def blocked_weight(self) -> Tensor:
        """The weight in kernels.block_weight's layout, made on first use and after any change."""
        key = self._key()
        if key != self._blocked_key:
            with torch.no_grad():
                self._blocked = kernels.block_weight(self.weight)
            self._blocked_key = key
        return self._blocked

    def forward(self, x: Tensor) -> Tensor:
        if not self._prepacked_ok(x):
            return F.linear(x, self.weight, self.bias)
        if self._few_rows(x):
            return kernels.run_linear(self.kernel_plan(), x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, "none", [], "")

    def forward_add(self, x: Tensor, residual: Tensor) -> Tensor:
        """self(x) + residual, the add done by oneDNN's matmul (a post-op, no second pass over the
        output) where the packed path runs. Bypasses forward hooks: for callers that checked there
        are none (the decoder block's fused route)."""
        if (
            self._prepacked_ok(x)
            and not self._few_rows(x)
            and residual.dtype == x.dtype
            and residual.shape == (*x.shape[:-1], self.out_features)
            and residual.is_contiguous()
        ):
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight(), self.bias, "add")
        return self(x) + residual

    def packed_weight(self) -> Tensor:
        """oneDNN's reordered copy of the weight, made on first use and after any change."""
        key = self._key()
        if key != self._packed_key:
            with torch.no_grad():
                # PACK_HINT: the batch-size hint; the packed weight serves any number of rows.
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_HINT)
            self._packed_key = key
        return self._packed


def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear in `model` by a PackedLinear over the same parameters (ties
    kept; no weight is copied until its first forward). Returns how many; 0 where packing is
    unavailable."""
    if packing_available() is not None:
        return 0
    return _replace_linears(model, nn.Linear, PackedLinear)


def prepack(model: nn.Module) -> int:
    """Make every PackedLinear's copies now (oneDNN's, and the small-row kernel's where it
    runs) instead of in the first forwards that need them, e.g. before a server says ready.
    Returns how many linears were prepacked."""
    n = 0
    for module in model.modules():
        if type(module) is PackedLinear and module.weight.dtype in PACKED_DTYPES and module.weight.is_cpu:
            module.packed_weight()
            if kernels.kernels_unavailable() is None:
                module.blocked_weight()
            n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears`: plain nn.Linear again over the same parameters, the packed copies freed."""
    return _replace_linears(model, PackedLinear, nn.Linear)


def _replace_linears(model: nn.Module, old: type, new: type) -> int:
    """Put a `new` linear over the same parameters (and hooks) in place of each `old` one (exactly
    that class) in its parent: a module never changes its class. -> how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if type(child) is old:
                setattr(parent, name, _linear_as(new, child))
                n += 1
    return n


def _linear_as(cls: type, linear: nn.Linear) -> nn.Linear:
    """A `cls` (nn.Linear or PackedLinear) sharing `linear`'s parameters and hooks, built without
    nn.Linear's random init (the parameters are linear's)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.register_parameter("weight", linear.weight)
    new.register_parameter("bias", linear.bias)
    new.train(linear.training)
    for name, value in linear.__dict__.items():  # the hook dicts themselves: handles keep working
        if "hook" in name and isinstance(value, dict):
            new.__dict__[name] = value
    return new
