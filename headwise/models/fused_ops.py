"""What a fused linear folds around its matmul, for the fused executor (models/executors.py).

    y = module(prologue(x)) + residual, RoPE on y's first `columns` outputs

prologue: an RMSNorm (a norm with `rms_args`) or a gated activation of x's two halves (`swiglu`:
True or "silu" for SwiGLU, "gelu_tanh" for GeGLU, GLU_KINDS); rope: (a
RotaryEmbedding over whole heads of D, cos, sin (N, D/2), columns), each row at its own position.
Each linear kind owns its fused forward (`fused_forward`: PackedLinear, QuantizedLinear, the
blocks' SplitQKV) and calls `kernel_args` to fold these into one small-row kernel call, or
`composed` where its kernel does not take the rows (a prefill: oneDNN's matmul, or any other
module) to run them as the kernels' own row-parallel calls around it. `fused_linear` is the one
entry point: a module without a fused forward of its own (nn.Linear where packing is off,
parallel's row-parallel linear) is composed.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels

# A gated MLP's activation -> the kernels' prologue that computes act(gate) * up
GLU_KINDS = {True: kernels.PRO_SWIGLU, "silu": kernels.PRO_SWIGLU, "gelu_tanh": kernels.PRO_GEGLU}
_TORCH_ACTS = {kernels.PRO_SWIGLU: F.silu, kernels.PRO_GEGLU: lambda g: F.gelu(g, approximate="tanh")}


def fused_linear(
    module: nn.Module,
    x: Tensor,
    *,
    residual: Tensor | None = None,
    norm: nn.Module | None = None,
    swiglu: bool | str = False,
    rope: tuple | None = None,
) -> Tensor:
    """module(prologue(x)) + residual, x (N, in) -> (N, out): the module's own fused forward, else
    `composed`. For the fused executor, which has checked grad mode and tracing."""
    own = getattr(type(module), "fused_forward", None)  # on the class: no nn.Module.__getattr__
    if own is not None:
        return own(module, x, residual=residual, norm=norm, swiglu=swiglu, rope=rope)
    return composed(module, x, residual=residual, norm=norm, swiglu=swiglu, rope=rope)


def kernel_args(x: Tensor, norm, swiglu: bool | str, rope) -> tuple[Tensor, dict]:
    """(x, the small-row kernels' keyword arguments) for a fused call: the prologue folded in where
    the kernel has it (an fp32 RMSNorm, SwiGLU, GeGLU), else the norm run first; RoPE as the kernel's
    (cos, sin, columns, head_dim)."""
    prologue, norm_weight, eps = kernels.PRO_NONE, None, 0.0
    if norm is not None:
        rms = getattr(type(norm), "rms_args", None)
        args = rms(norm) if rms is not None else None
        if args is not None:
            prologue, (norm_weight, eps) = kernels.PRO_RMSNORM, args
        else:
            x = norm(x)
    elif swiglu:
        prologue = GLU_KINDS[swiglu]
    if rope is not None:
        rope = (rope[1], rope[2], rope[3], rope[0].dim)  # (cos, sin, columns, head_dim)
    return x, dict(prologue=prologue, norm_weight=norm_weight, eps=eps, rope=rope)


def composed(
    module: nn.Module,
    x: Tensor,
    *,
    residual: Tensor | None = None,
    norm: nn.Module | None = None,
    swiglu: bool | str = False,
    rope: tuple | None = None,
    add=None,
) -> Tensor:
    """Rows the kernel does not take (a prefill: oneDNN's matmul), or a module without a kernel:
    the same prologue (RMSNorm, SwiGLU, GeGLU) and RoPE epilogue as the kernels' own calls; the residual
    through `add(x, residual)` where the module has one (PackedLinear.forward_add: oneDNN's post-op)."""
    if norm is not None:
        if getattr(type(norm), "rms_args", None) is not None and kernels.rows_kernels_take(x, norm.weight):
            x = kernels.rms_norm(x, norm.weight, norm.eps)
        else:
            x = norm(x)
    elif swiglu:
        kind = GLU_KINDS[swiglu]
        if kernels.rows_kernels_take(x):
            x = kernels.swiglu(x, kind)
        else:
            gate, up = x.chunk(2, dim=-1)
            x = _TORCH_ACTS[kind](gate) * up
    if rope is None and residual is not None and add is not None:
        return add(x, residual)
    y = module(x)
    if rope is not None:
        module_rope, cos, sin, cols = rope
        if kernels.rows_kernels_take(y, cos, sin):
            kernels.rope_(y, cos, sin, cols, module_rope.dim)
        else:  # the module, each row as a sequence of one token at its position
            N, D = len(y), module_rope.dim
            heads = y[:, :cols].view(N, cols // D, 1, D)  # (B=N, heads, T=1, D)
            y[:, :cols] = module_rope(heads, cos_sin=(cos[:, None, None], sin[:, None, None])).view(N, cols)
    return y if residual is None else y + residual


def fused_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """norm(x) for x (N, C): the kernels' RMSNorm where it is an fp32 one (a norm with `rms_args`),
    else the module (Gemma's post-norms in a prefill)."""
    rms = getattr(type(norm), "rms_args", None)
    args = rms(norm) if rms is not None else None
    if args is not None and kernels.rows_kernels_take(x, args[0]):
        return kernels.rms_norm(x, *args)
    return norm(x)


def qk_norm_rope(norms: tuple, qkv: Tensor, heads: tuple[int, int, int], cos=None, sin=None, rotary_dim=None) -> bool:
    """QK-norm (norms: the (q_norm, k_norm) modules, either None), then RoPE over each head's first
    rotary_dim channels (None: all) where cos, sin (N, rotary_dim/2) are given, in place on qkv
    (N, (H + 2 Hkv) D) in one kernel call (kernels.qk_norm_rope_) where the norms are fp32 RMSNorms
    of one eps; False, with nothing done, where not."""
    args = []
    for n in norms:
        rms = None if n is None else getattr(type(n), "rms_args", None)
        args.append(None if rms is None else rms(n))
        if n is not None and args[-1] is None:
            return False
    given = [a for a in args if a is not None]
    rows = [qkv, *(w for w, _ in given), *(() if cos is None else (cos, sin))]
    if len({eps for _, eps in given}) > 1 or not kernels.rows_kernels_take(*rows):
        return False
    eps = given[0][1] if given else 0.0
    kernels.qk_norm_rope_(qkv, heads, *(None if a is None else a[0] for a in args), eps, cos, sin, rotary_dim)
    return True
