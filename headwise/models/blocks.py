"""Pieces the model families share: norms, MLPs, the pre-norm decoder block and its fused layer.

Dims as everywhere: B batch, T tokens, N = B*T rows, C model width, F MLP hidden width.

A decoder block's step runs on one of two executors (models/executors.py chooses, once per step):
- reference: `DecoderBlock.forward`, the modules as written, x + attn(norm(x)), then x + mlp(norm(x));
- fused: the same numbers (fp32 rounding aside) from headwise's kernels. A decode step's layers go
  to the C layer stack (kernels/layer.py, models/layer_step.py); any other step runs `fused_layer`,
  the same matmuls with what surrounds them folded in, ~10 calls a layer instead of ~40. Decoding
  one token at batch 1 reads every weight once (~540 MB for SmolLM2-135M in fp32) and does little
  else, so every call around the matmuls is a visible share of the step:

      qkv = linear(rmsnorm(x))          one small-row kernel call (norm folded into the matmul)
      q|k = qk @ R                      RoPE of all heads as one matmul with each row's rotation
      o   = cache.update(k, v).attend(q)    the cache and attention backend as in the reference
      x   = linear(o) + x               residual folded into the kernel
      x   = linear(swiglu(linear(rmsnorm(x)))) + x

  Each linear kind folds these in its own `fused_forward` (models/fused_ops.py): the small-row
  kernel for up to kernels.MAX_ROWS rows (64: kernels.KERNELS_OVER_ONEDNN, measured on AMD and
  Intel); above that (a prefill) the matmuls go to oneDNN, with RMSNorm, SwiGLU and RoPE as the
  kernels' own row-parallel calls and the residual as oneDNN's post-op: SmolLM2's fp32 prefill of
  512 tokens 1.115x (paired 1.063x) the speed of 2f9c09b, where prefills took the modules
  (benchmarks/compare_commits.py; AMD EPYC Zen 5, 2 threads).
Tests force each executor: tests/models/test_block_route.py, tests/models/test_executors.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import MultiHeadAttention
from ..attention.step import PlainStep, Step
from ..core.config import ModelConfig
from .fused_ops import fused_linear, fused_norm, qk_norm_rope  # fused_linear: also imported from here

# Steps of at most this many rows (B*T) may take the fused executor; None: every step, 0 turns it off.
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

    def rms_args(self) -> tuple[Tensor, float] | None:
        """(weight, eps) for a kernel's RMSNorm prologue (fused_ops), None for a weight it cannot read."""
        w = self._parameters["weight"]
        return (w, self.eps) if w.dtype is torch.float32 else None

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


def make_attention(cfg: ModelConfig, *, layer: int = 0, rope=None, backend: str = "auto") -> MultiHeadAttention:
    """Layer `layer`'s attention as cfg says: its window, score scale and soft-cap, qk-norm (RMSNorm
    over each head's D, before RoPE). Only what differs from plain attention is passed."""
    block = dict(window=cfg.window(layer), softcap=cfg.attn_softcap, scale=cfg.attn_scale)
    if cfg.qk_norm:  # Qwen3, Gemma 3 (their (1 + w) weights are stored as 1 + w at load)
        block |= dict(q_norm=RMSNorm(cfg.head_dim, eps=cfg.norm_eps), k_norm=RMSNorm(cfg.head_dim, eps=cfg.norm_eps))
    return MultiHeadAttention(
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        bias=cfg.attn_bias,
        out_bias=cfg.out_bias,
        rope=rope,
        backend=backend,
        **{k: v for k, v in block.items() if v is not None},
    )


class DecoderBlock(nn.Module):
    """Pre-norm residual block (GPT-2, Llama): x + attn(norm(x)), then x + mlp(norm(x)); with
    cfg.post_norms (Gemma 2/3) each branch's output is normed again before its add:
    x + post(attn(norm(x))), x + post(mlp(norm(x))). Layer `layer`'s window, RoPE (`rope`, which the
    model picks per layer), qk-norm, scale and soft-cap are its attention's (make_attention).

    `block(x, step, i)`: x (B, T, C) of a step (`headwise.attention.step.Step`) whose layer-i
    cache this block writes and reads; without a step, the T tokens attend causally to
    each other. This is the reference executor's layer; the fused one runs `fused_layer`."""

    def __init__(self, cfg: ModelConfig, *, layer: int = 0, rope=None, backend: str = "auto"):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = make_attention(cfg, layer=layer, rope=rope, backend=backend)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.attn_post_norm = make_norm(cfg)  # HF Gemma: post_attention_layernorm
            self.mlp_post_norm = make_norm(cfg)  # HF Gemma: post_feedforward_layernorm

    def forward(self, x: Tensor, step: Step | None = None, layer: int = 0) -> Tensor:
        if step is None:
            step = PlainStep(x.shape[0], x.shape[1], x.device)
        attn = self.attn
        cs = step.rope_cos_sin(attn.rope) if attn.rope is not None else None
        a = attn(
            self.attn_norm(x),
            is_causal=True,
            cache=step.layer(layer),
            key_padding_mask=step.key_padding_mask,
            rope_cos_sin=cs,
            num_new=step.num_real,
        )  # (B, T, C)
        if self.post_norms:
            x = x + self.attn_post_norm(a)
            return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))
        x = x + a
        return x + self.mlp(self.mlp_norm(x))


class SplitQKV(NamedTuple):
    """The q | k | v of an attention that holds them apart (MultiHeadAttention.unfuse) as one
    linear kind of the fused executor: three calls side by side, RoPE on each of q's and k's heads."""

    q: nn.Module
    k: nn.Module
    v: nn.Module

    def fused_forward(self, h: Tensor, *, norm=None, rope=None, residual=None, swiglu=False) -> Tensor:
        def part(m, roped):
            return fused_linear(m, h, norm=norm, rope=(*rope[:3], m.out_features) if roped and rope else None)

        return torch.cat([part(self.q, True), part(self.k, True), part(self.v, False)], dim=1)  # (N, (H + 2 Hkv) D)


class Parts(NamedTuple):
    """The modules a block's fused step calls by hand, looked up once per fused plan
    (models/executors.py): nn.Module's attribute lookup costs ~0.5 us a name."""

    attn: nn.Module
    qkv: nn.Module  # qkv_proj, or SplitQKV(q_proj, k_proj, v_proj)
    out: nn.Module
    rope: nn.Module | None  # this layer's (Gemma 3: local layers' and global layers' differ)
    attn_norm: nn.Module
    mlp_norm: nn.Module
    mlp: nn.Module
    # a GatedMLP whose activation the kernels fold between gate_up and down: "silu" (SwiGLU),
    # "gelu_tanh" (GeGLU); None: another MLP, run as its module
    glu: str | None
    qk_norms: tuple[nn.Module | None, nn.Module | None] = (None, None)  # Qwen3, Gemma 3: per-head, before RoPE
    post_norms: tuple[nn.Module, nn.Module] | None = None  # Gemma: x + norm(attn), x + norm(mlp)

    @property
    def linears(self) -> tuple[nn.Module, ...]:
        """Every linear the step calls, q, k, v apart where they are."""
        qkv = tuple(self.qkv) if type(self.qkv) is SplitQKV else (self.qkv,)
        return (*qkv, self.out, *self.mlp._modules.values())


_GLUS = ("silu", "gelu_tanh")  # the gate activations the kernels fold (fused_ops.GLU_KINDS)


def parts_of(block: nn.Module) -> Parts | None:
    """The block's Parts, None for a block the fused layer cannot run (another kind of block, an
    attention over other keys and values). Every option of the block's spec runs fused: QK-norm,
    post-norms, GeGLU here; a window, score scale and soft-cap in attention (attend_heads)."""
    if type(block) is not DecoderBlock:
        return None
    m = block._modules
    attn, mlp = m["attn"], m["mlp"]
    a = attn._modules
    if attn.fused:
        qkv = a.get("qkv_proj")
    elif attn.kdim == attn.vdim == attn.d_model:
        qkv = SplitQKV(a["q_proj"], a["k_proj"], a["v_proj"])
    else:
        return None
    if qkv is None:
        return None
    glu = mlp.activation if type(mlp) is GatedMLP and mlp.activation in _GLUS else None
    post = (m["attn_post_norm"], m["mlp_post_norm"]) if block.post_norms else None
    qk_norms = (a.get("q_norm"), a.get("k_norm"))
    return Parts(attn, qkv, a["out_proj"], a.get("rope"), m["attn_norm"], m["mlp_norm"], mlp, glu, qk_norms, post)


def fused_layer(p: Parts, x: Tensor, step: Step, cache) -> Tensor:
    """The fused executor's layer, one layer at a time: x (B, T, C) -> (B, T, C), the same numbers
    as DecoderBlock.forward (fp32 rounding aside) in ~10 calls (the module docstring)."""
    attn = p.attn
    B, T, C = x.shape
    N, H, Hkv, D = B * T, attn.num_heads, attn.num_kv_heads, attn.head_dim  # per layer: pruning changes them
    h = x.reshape(N, C)
    rope = p.rope
    qk_norm = p.qk_norms != (None, None)
    fold = rope is not None and not rope.interleaved and h.dtype == torch.float32  # RoPE by the kernels
    if fold and rope.dim == D and not qk_norm:
        # RoPE of all q and k heads in the QKV call (the kernel's epilogue, or the module after it)
        cos, sin = step.rope_rows(rope)  # (N, D/2)
        qkv = fused_linear(p.qkv, h, norm=p.attn_norm, rope=(rope, cos, sin, (H + Hkv) * D))
        rope = None
    else:
        qkv = fused_linear(p.qkv, h, norm=p.attn_norm)  # (N, (H + 2 Hkv) D)
    if qk_norm or (fold and rope is not None):  # QK-norm before RoPE, or partial RoPE: one kernel call
        cos, sin = step.rope_rows(rope) if fold else (None, None)  # (N, rotary dim / 2)
        if qk_norm_rope(p.qk_norms, qkv, (H, Hkv, D), cos, sin, rope.dim if fold else None):
            rope = None if fold else rope
        elif qk_norm:  # the modules
            q, k = attn.norm_qk(qkv[:, : H * D].view(N, H, D), qkv[:, H * D : (H + Hkv) * D].view(N, Hkv, D))
            qkv[:, : H * D], qkv[:, H * D : (H + Hkv) * D] = q.reshape(N, -1), k.reshape(N, -1)
    qk = qkv[:, : (H + Hkv) * D].view(B, T, H + Hkv, D)
    if rope is not None:  # interleaved or low-precision RoPE (or no kernels): the module
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
    o = attn.attend_heads(q, k, v, cache, step.num_real, kwargs)  # (B, H, T, D): its window, scale, soft-cap
    post = p.post_norms
    o = o.transpose(1, 2).reshape(N, H * D)
    if post is None:
        h = fused_linear(p.out, o, residual=h)  # (N, C)
    else:  # Gemma: the residual after the output's own norm
        h = h + fused_norm(post[0], fused_linear(p.out, o))
    if p.glu is not None:
        mm = p.mlp._modules
        gu = fused_linear(mm["gate_up"], h, norm=p.mlp_norm)  # (N, 2F)
        if post is None:
            h = fused_linear(mm["down"], gu, residual=h, swiglu=p.glu)
        else:
            h = h + fused_norm(post[1], fused_linear(mm["down"], gu, swiglu=p.glu))
    else:
        m = p.mlp(p.mlp_norm(h))
        h = h + (m if post is None else post[1](m))
    return h.view(B, T, C)


def route_allowed(module: nn.Module, rows: int) -> bool:
    """Whether a step of `rows` rows through `module` (a model) may take the fused executor:
    inference only, not traced, no global hooks (executors.choose checks the model's own)."""
    return (
        (ROUTE_ROWS is None or rows <= ROUTE_ROWS)
        and not module.training
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)
    )


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
