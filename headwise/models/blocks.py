"""Pieces the model families share: norms, MLPs, the pre-norm decoder block and its fused route.

Dims as everywhere: B batch, T tokens, N = B*T rows, C model width, F MLP hidden width.

A decoder block runs a step one of two ways, with the same numbers (fp32 rounding aside):
- general: the modules as written, x + attn(norm(x)), then x + mlp(norm(x));
- fused, "few rows" in the code (decode steps, the engine's packed steps, prompts): the same matmuls
  with what surrounds them folded in, ~10 calls a layer instead of ~40. Decoding one token at
  batch 1 reads every weight once (~540 MB for SmolLM2-135M in fp32) and does little else, so
  every call around the matmuls is a visible share of the step:

      qkv = linear(rmsnorm(x))          one small-row kernel call (norm folded into the matmul)
      q|k = qk @ R                      RoPE of all heads as one matmul with each row's rotation
      o   = cache.update(k, v).attend(q)    the cache and attention backend as in the general route
      x   = linear(o) + x               residual folded into the kernel
      x   = linear(swiglu(linear(rmsnorm(x)))) + x

  The kernel (headwise.kernels.small_linear, through PackedLinear) runs for up to
  kernels.MAX_ROWS rows (64: kernels.KERNELS_OVER_ONEDNN, measured on AMD and Intel); above that
  (a prefill) the matmuls go to the modules (oneDNN), with RMSNorm, SwiGLU and RoPE as the kernels' own
  row-parallel calls and the residual as oneDNN's post-op: SmolLM2's fp32 prefill of 512 tokens
  1.115x (paired 1.063x) the speed of 2f9c09b, where prefills took the general route
  (benchmarks/compare_commits.py; AMD EPYC Zen 5, 2 threads).
The route runs in inference (no grad, eval mode, not under torch.compile) for steps of at most
ROUTE_ROWS rows (None: any), when no hook would be bypassed: forward hooks on the modules it calls by hand,
global module hooks, and the analysis hook of `MultiHeadAttention` all send a step to the
general route. Tests force each route: tests/models/test_block_route.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..attention import MultiHeadAttention
from ..attention.step import PlainStep, Step
from ..core.config import ModelConfig
from .linear import QuantizedLinear
from ..kernels import layer as kernel_layer
from .layer_step import claim_step
from .packing import PackedLinear

# Steps of at most this many rows (B*T) take the fused route; None: every step, 0 turns it off.
ROUTE_ROWS: int | None = None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (Zhang & Sennrich 2019, arXiv:1910.07467).

    Cast back to the input dtype *before* the weight multiply, as HF Llama does, so
    bf16 models round where the reference rounds.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # nothing to round: one fused op
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "silu": F.silu,
    "relu": F.relu,
}


class MLP(nn.Module):
    """up -> activation -> down (GPT-2, BERT)."""

    def __init__(self, C: int, hidden: int, *, bias: bool, activation: str):
        super().__init__()
        self.up = nn.Linear(C, hidden, bias=bias)  # (F, C)
        self.down = nn.Linear(hidden, C, bias=bias)  # (C, F)
        self.activation = activation
        self.act = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (Shazeer 2020,
    "GLU variants improve transformer", arXiv:2002.05202; SwiGLU when act is SiLU).

    gate_up.weight is (2F, C), rows [gate | up].
    """

    def __init__(self, C: int, hidden: int, *, bias: bool, activation: str):
        super().__init__()
        self.gate_up = nn.Linear(C, 2 * hidden, bias=bias)  # (2F, C): rows [gate | up]
        self.down = nn.Linear(hidden, C, bias=bias)  # (C, F)
        self.activation = activation
        self.act = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, F) each
        return self.down(self.act(gate) * up)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


def make_mlp(cfg: ModelConfig) -> nn.Module:
    cls = GatedMLP if cfg.mlp == "swiglu" else MLP
    return cls(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias, activation=cfg.activation)


def make_attention(cfg: ModelConfig, *, rope=None, backend: str = "auto") -> MultiHeadAttention:
    return MultiHeadAttention(
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        bias=cfg.attn_bias,
        out_bias=cfg.out_bias,
        rope=rope,
        backend=backend,
    )


class DecoderBlock(nn.Module):
    """Pre-norm residual block (GPT-2, Llama): x + attn(norm(x)), then x + mlp(norm(x)).

    `block(x, step, i)`: x (B, T, C) of a step (`headwise.attention.step.Step`) whose layer-i
    cache this block writes and reads; without a step, the T tokens attend causally to
    each other. Steps of few rows take the route in the module docstring."""

    def __init__(self, cfg: ModelConfig, *, rope=None, backend: str = "auto"):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = make_attention(cfg, rope=rope, backend=backend)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)

    def forward(self, x: Tensor, step: Step | None = None, layer: int = 0, few_rows: bool = False) -> Tensor:
        """few_rows: the caller's check that the step as a whole may take the route (`route_allowed`)."""
        if step is None:
            step = PlainStep(x.shape[0], x.shape[1], x.device)
        cache = step.layer(layer)
        if few_rows and self._route_ok():
            return self._few_rows(x, step, cache)
        attn = self.attn
        cs = step.rope_cos_sin(attn.rope) if attn.rope is not None else None
        x = x + attn(
            self.attn_norm(x),
            is_causal=True,
            cache=cache,
            key_padding_mask=step.key_padding_mask,
            rope_cos_sin=cs,
            num_new=step.num_real,
        )  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))

    def _route_ok(self) -> bool:
        """No hook of a module the route calls by hand (checked every step: hooks come and go)."""
        parts = self._parts()
        return parts.attn.hook is None and parts.qkv is not None and not any(parts.hook_dicts)

    def _parts(self) -> "_Parts":
        """The modules the route calls, looked up once and again only when one is replaced
        (pruning replaces projections): nn.Module's attribute lookup costs ~0.5 us a name, and
        a decode step would look up ~1,000 of them."""
        m = self._modules
        attn, mlp = m["attn"], m["mlp"]
        key = (attn, mlp, m["attn_norm"], m["mlp_norm"], *attn._modules.values(), *mlp._modules.values())
        cached = self.__dict__.get("_route_parts")
        if cached is not None and cached[0] == key:
            return cached[1]
        swiglu = type(mlp) is GatedMLP and mlp.activation == "silu"
        parts = _Parts(
            attn,
            _qkv_of(attn),
            attn._modules["out_proj"],
            attn._modules.get("rope"),
            m["attn_norm"],
            m["mlp_norm"],
            mlp,
            swiglu,
            tuple(d for mod in key for d in (mod._forward_hooks, mod._forward_pre_hooks)),  # key: every module it calls
        )
        self.__dict__["_route_parts"] = (key, parts)
        return parts

    def one_call_claim(self, h: Tensor, step: Step, cache, B: int, T: int) -> tuple | None:
        """h (B T, C) of a step of B sequences x T tokens: layer_step.claim_step's claim (the new
        keys booked) where the layer runs in one kernel call, else None with nothing booked. For
        the few-rows route (the caller checked route_allowed and _route_ok)."""
        p = self._parts()
        if (
            (T == 1 or B == 1)  # a decode step, or a packed one (the cache says whether each row is a sequence)
            and cache is not None
            and h.dtype is torch.float32
            and type(p.attn_norm) is type(p.mlp_norm) is RMSNorm
        ):
            return claim_step(self, p, h, step, cache)
        return None

    def _few_rows(self, x: Tensor, step: Step, cache) -> Tensor:
        p = self._parts()
        attn = p.attn
        B, T, C = x.shape
        N, H, Hkv, D = B * T, attn.num_heads, attn.num_kv_heads, attn.head_dim  # per layer: pruning changes them
        h = x.reshape(N, C)
        # one new token per sequence: the layer in one kernel call where it applies (layer_step.py)
        claimed = self.one_call_claim(h, step, cache, B, T)
        if claimed is not None:
            return kernel_layer.run_stack([claimed], h).view(B, T, C)  # this layer alone
        rope = p.rope
        if rope is not None and not rope.interleaved and rope.dim == D and h.dtype == torch.float32:
            # RoPE of all q and k heads in the QKV call (the kernel's epilogue, or the module after it)
            cos, sin = step.rope_rows(rope)  # (N, D/2)
            qkv = qkv_linear(p.qkv, h, p.attn_norm, (rope, cos, sin, (H + Hkv) * D))
            rope = None
        else:
            qkv = qkv_linear(p.qkv, h, p.attn_norm)  # (N, (H + 2 Hkv) D)
        qk = qkv[:, : (H + Hkv) * D].view(B, T, H + Hkv, D)
        if rope is not None:  # partial, interleaved or low-precision RoPE: the module
            qk = rope(qk.transpose(1, 2), cos_sin=step.rope_cos_sin(rope)).transpose(1, 2)
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
        k = qk[:, :, H:].transpose(1, 2)  # (B, Hkv, T, D)
        v = qkv[:, (H + Hkv) * D :].view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        kwargs = dict(
            is_causal=True,
            alibi_slopes=attn.alibi_slopes,
            backend=attn.backend,
            key_padding_mask=step.key_padding_mask if cache is None else None,
        )
        o = attn.attend_heads(q, k, v, cache, step.num_real, kwargs)  # (B, H, T, D)
        h = fused_linear(p.out, o.transpose(1, 2).reshape(N, H * D), residual=h)  # (N, C)
        if p.swiglu:
            mm = p.mlp._modules
            gu = fused_linear(mm["gate_up"], h, norm=p.mlp_norm)  # (N, 2F)
            h = fused_linear(mm["down"], gu, residual=h, swiglu=True)
        else:
            h = h + p.mlp(p.mlp_norm(h))
        return h.view(B, T, C)


def _qkv_of(attn) -> nn.Module | tuple | None:
    """The route's q | k | v: the fused qkv_proj, or (q_proj, k_proj, v_proj) of a self-attention
    that holds them apart (MultiHeadAttention.unfuse), None for one the route cannot take."""
    m = attn._modules
    if attn.fused:
        return m.get("qkv_proj")
    if attn.kdim == attn.vdim == attn.d_model:
        return m["q_proj"], m["k_proj"], m["v_proj"]
    return None


def qkv_linear(qkv, h: Tensor, norm: nn.Module, rope: tuple | None = None) -> Tensor:
    """fused_linear of the q | k | v projection(s) -> (N, (H + 2 Hkv) D): one call, or three (q, k
    and v apart: RoPE on each of q's and k's heads) side by side."""
    if type(qkv) is not tuple:
        return fused_linear(qkv, h, norm=norm, rope=rope)
    q, k, v = qkv
    return torch.cat(
        [
            fused_linear(q, h, norm=norm, rope=None if rope is None else (*rope[:3], q.out_features)),
            fused_linear(k, h, norm=norm, rope=None if rope is None else (*rope[:3], k.out_features)),
            fused_linear(v, h, norm=norm),
        ],
        dim=1,
    )


class _Parts(NamedTuple):
    attn: nn.Module
    qkv: nn.Module | tuple  # qkv_proj, or (q_proj, k_proj, v_proj) (_qkv_of)
    out: nn.Module
    rope: nn.Module | None
    attn_norm: nn.Module
    mlp_norm: nn.Module
    mlp: nn.Module
    swiglu: bool
    # _forward_hooks and _forward_pre_hooks of every module the route calls by hand (their hooks
    # would not run), dicts filled and emptied in place
    hook_dicts: tuple


def route_allowed(module: nn.Module, rows: int) -> bool:
    """Whether a step of `rows` rows through `module` (a model) may take the few-rows route:
    inference only, not traced, no global hooks (the blocks check their own)."""
    return (
        (ROUTE_ROWS is None or rows <= ROUTE_ROWS)
        and not module.training
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)
    )


def fused_linear(
    module: nn.Module,
    x: Tensor,
    *,
    residual: Tensor | None = None,
    norm: nn.Module | None = None,
    swiglu: bool = False,
    rope: tuple[nn.Module, Tensor, Tensor, int] | None = None,
) -> Tensor:
    """module(prologue(x)) + residual, x (N, in): one small-row kernel call where the module is a
    PackedLinear that takes x (prologue RMSNorm or SwiGLU folded in), else the modules and ops.
    For the few-rows route only (it has checked grad mode and tracing: PackedLinear.route_plan).
    rope = (a RotaryEmbedding over whole heads of D, cos, sin (N, D/2), columns): RoPE on the first
    `columns` outputs, in heads of D, each row at its own position."""
    kind = type(module)
    plan = module.route_plan(x) if kind is PackedLinear or kind is QuantizedLinear else None
    if plan is not None:
        prologue, norm_weight, eps = kernels.PRO_NONE, None, 0.0
        if norm is not None:
            if type(norm) is RMSNorm and norm.weight.dtype == torch.float32:
                prologue, norm_weight, eps = kernels.PRO_RMSNORM, norm.weight, norm.eps
            else:
                x = norm(x)
        elif swiglu:
            prologue = kernels.PRO_SWIGLU
        if rope is not None:
            rope = (rope[1], rope[2], rope[3], rope[0].dim)  # (cos, sin, columns, head_dim)
        run = kernels.run_linear if kind is PackedLinear else module.run  # QuantizedLinear: kernels.quant
        return run(plan, x, residual=residual, prologue=prologue, norm_weight=norm_weight, eps=eps, rope=rope)
    # rows the kernel does not take (a prefill: oneDNN's matmul): the same prologue (RMSNorm,
    # SwiGLU) and RoPE epilogue as their own kernel calls, the residual as oneDNN's post-op
    if norm is not None:
        if type(norm) is RMSNorm and kernels.rows_kernels_take(x, norm.weight):
            x = kernels.rms_norm(x, norm.weight, norm.eps)
        else:
            x = norm(x)
    elif swiglu:
        if kernels.rows_kernels_take(x):
            x = kernels.swiglu(x)
        else:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
    if rope is None and residual is not None and kind is PackedLinear:
        return module.forward_add(x, residual)
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


def logits_rows(x: Tensor, step: Step) -> Tensor:
    """x (B, T, C) -> the rows whose logits the step wants: (R, C) at step.logits_indices, else x."""
    if step.logits_indices is None:
        return x
    return x.reshape(-1, x.shape[-1]).index_select(0, step.logits_indices)


def check_input_ids(input_ids: Tensor) -> tuple[int, int]:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (B, T) integer tensor, got {got}")
    return input_ids.shape


def check_length(T: int, max_positions: int, family: str) -> None:
    if T > max_positions:
        raise ValueError(
            f"input_ids has {T} tokens but this {family} model has {max_positions} learned "
            f"positions (max_position_embeddings); truncate the input to {max_positions} tokens"
        )
