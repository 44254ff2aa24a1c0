"""Pieces the model families share: norms, MLPs, the pre-norm decoder block.

Dims as everywhere: B batch, T tokens, C model width, F MLP hidden width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import MultiHeadAttention
from ..config import ModelConfig


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
        if x.dtype == torch.float32 == self.weight.dtype:      # nothing to round: one fused op
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
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),   # GPT-2's "gelu_new"
    "silu": F.silu,
    "relu": F.relu,
}


class MLP(nn.Module):
    """up -> activation -> down (GPT-2, BERT)."""

    def __init__(self, C: int, hidden: int, *, bias: bool, activation: str):
        super().__init__()
        self.up = nn.Linear(C, hidden, bias=bias)         # (F, C)
        self.down = nn.Linear(hidden, C, bias=bias)       # (C, F)
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
        self.gate_up = nn.Linear(C, 2 * hidden, bias=bias)   # (2F, C): rows [gate | up]
        self.down = nn.Linear(hidden, C, bias=bias)          # (C, F)
        self.activation = activation
        self.act = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)      # (B, T, F) each
        return self.down(self.act(gate) * up)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


def make_mlp(cfg: ModelConfig) -> nn.Module:
    cls = GatedMLP if cfg.mlp == "swiglu" else MLP
    return cls(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias, activation=cfg.activation)


def make_attention(cfg: ModelConfig, *, rope=None, backend: str = "auto") -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias=cfg.attn_bias,
                              out_bias=cfg.out_bias, rope=rope, backend=backend)


class DecoderBlock(nn.Module):
    """Pre-norm residual block (GPT-2, Llama): x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rope=None, backend: str = "auto"):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = make_attention(cfg, rope=rope, backend=backend)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)

    def forward(self, x: Tensor, *, cache=None, key_padding_mask: Tensor | None = None,
                rope_cos_sin: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), is_causal=True, cache=cache, key_padding_mask=key_padding_mask,
                          rope_cos_sin=rope_cos_sin)                                   # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))


def padding_mask(attention_mask: Tensor | None, B: int, T: int) -> Tensor | None:
    """HF's attention_mask (B, T), 1 = token and 0 = padding -> key_padding_mask, True = padding."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask must be (B, T) = ({B}, {T}) like input_ids, "
                         f"got {tuple(attention_mask.shape)}")
    return attention_mask == 0


def check_input_ids(input_ids: Tensor) -> tuple[int, int]:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (B, T) integer tensor, got {got}")
    return input_ids.shape


def check_length(T: int, max_positions: int, family: str) -> None:
    if T > max_positions:
        raise ValueError(f"input_ids has {T} tokens but this {family} model has {max_positions} learned "
                         f"positions (max_position_embeddings); truncate the input to {max_positions} tokens")
