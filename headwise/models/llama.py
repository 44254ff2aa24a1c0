"""Llama family: Llama 1/2/3, Mistral, Qwen2, SmolLM2 (Touvron et al. 2023, arXiv:2302.13971).

Pre-norm decoder: RMSNorm, RoPE (with HF's scaling variants), SwiGLU with gate and
up fused into one matmul, GQA/MQA through `MultiHeadAttention`, tied or untied
output head. Read top to bottom: RoPE -> config -> model -> HF weight table.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from ..attention import RotaryEmbedding
from ..attention.step import Step, make_step
from ..core.config import ModelConfig, RopeScaling
from .linear import Embedding, QuantizedEmbedding, QuantizedLinear
from .blocks import DecoderBlock, RMSNorm, check_input_ids, logits_rows
from .executors import choose
from .loading import CheckpointError, To, hf_activation, hf_eos, need

# ---------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """(D/2,) fp32 inverse frequencies, scaled as cfg.rope_scaling says (as HF's ROPE_INIT_FUNCTIONS)."""
    D, s = cfg.head_dim, cfg.rope_scaling
    # on the CPU even inside a meta-device build: meta ops without a C++ kernel import torch._dynamo
    # (~1.5 s per process) for D/2 numbers that init_buffers computes again next to the weights
    exponent = torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D
    inv_freq = 1.0 / (cfg.rope_theta**exponent)  # (D/2,)
    if s is None or s.kind == "dynamic":  # dynamic depends on the sequence: DynamicNTKRotary
        return inv_freq
    if s.kind == "linear":  # positions / factor == inv_freq / factor
        return inv_freq / s.factor
    # llama3: long wavelengths (> original / low) slow down by `factor`, short ones (< original / high)
    # stay, and a linear ramp in original/wavelength blends between (Llama 3.1, Meta's reference code).
    L = s.original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > L / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (L / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < L / s.high_freq_factor) & ~(wavelen > L / s.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


class DynamicNTKRotary(RotaryEmbedding):
    """RoPE whose base grows once the sequence passes max_positions ("dynamic NTK").

    base' = base * (factor * S / M - (factor - 1)) ** (D / (D - 2)), S = last position + 1
    of this call (at least M), computed on device: no host sync. HF keeps the largest S
    seen in module state; we recompute it per call, which is the same for any call
    sequence whose lengths do not shrink (a prefill then decode steps). As in HF,
    cached keys keep the rotation they were written with.
    """

    def __init__(self, dim: int, base: float, factor: float, max_positions: int):
        super().__init__(dim, base)
        self.factor, self.max_positions = factor, max_positions

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if positions.dim() == 1:
            positions = positions[None]  # (1, T)
        S = torch.clamp(positions.max() + 1, min=self.max_positions)  # () long, on device
        base = self.base * (self.factor * S / self.max_positions - (self.factor - 1)) ** (self.dim / (self.dim - 2))
        exponent = torch.arange(0, self.dim, 2, dtype=torch.int64, device=positions.device).float() / self.dim
        inv_freq = 1.0 / (base**exponent)  # (D/2,)
        angles = positions[:, None, :, None].float() * inv_freq  # (B|1, 1, T, D/2)
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dynamic NTK factor={self.factor}, max_positions={self.max_positions}"


def make_rope(cfg: ModelConfig) -> RotaryEmbedding:
    s = cfg.rope_scaling
    if s is not None and s.kind == "dynamic":
        return DynamicNTKRotary(cfg.head_dim, cfg.rope_theta, s.factor, cfg.max_positions)
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, inv_freq=rope_inv_freq(cfg))


# ---------------------------------------------------------------------------- config


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF LlamaConfig / MistralConfig / Qwen2Config dict -> ModelConfig."""
    kind = hf.get("model_type", "llama")
    C, H = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(
            f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported (RoPE over the whole head only)"
        )
    if kind == "qwen2":  # Qwen2Attention: q/k/v biased, o not; no flag in the config
        attn_bias, out_bias = True, False
    else:
        attn_bias = out_bias = bool(hf.get("attention_bias", False))
    window = hf.get("sliding_window") if (kind != "qwen2" or hf.get("use_sliding_window")) else None
    max_positions = need(hf, "max_position_embeddings")
    if window is not None and window < max_positions:
        warnings.warn(
            f"{kind}: sliding_window={window} is not applied; outputs are exact for contexts up to "
            f"{window} tokens and attend to every earlier key beyond that",
            stacklevel=3,
        )
    theta, scaling = _rope_params(hf, max_positions)
    return ModelConfig(
        name=hf.get("_name_or_path") or kind,
        arch="llama",
        vocab_size=need(hf, "vocab_size"),
        d_model=C,
        num_layers=need(hf, "num_hidden_layers"),
        num_heads=H,
        num_kv_heads=hf.get("num_key_value_heads") or H,
        head_dim=hf.get("head_dim") or C // H,
        d_ff=need(hf, "intermediate_size"),
        max_positions=max_positions,
        mlp="swiglu",
        norm="rmsnorm",
        norm_placement="pre",
        positions="rope",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # HF's default for all three
        attn_bias=attn_bias,
        out_bias=out_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation=hf_activation(hf.get("hidden_act", "silu")),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        eos_token_ids=hf_eos(hf),
    )


def _rope_params(hf: dict, max_positions: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    p = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(p.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "dynamic", "llama3"):
        raise CheckpointError(
            f"rope scaling type {kind!r} is not supported; supported: default, linear, dynamic, llama3"
        )
    return theta, RopeScaling(
        kind,
        float(p["factor"]),
        original_max_positions=p.get("original_max_position_embeddings", max_positions) if kind == "llama3" else None,
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
    )


# ---------------------------------------------------------------------------- model


class Llama(nn.Module):
    def __init__(self, config: ModelConfig, *, backend: str = "auto"):
        super().__init__()
        self.config = config
        C, V = config.d_model, config.vocab_size
        self.embed = Embedding(V, C)  # (V, C)
        self.rope = make_rope(config)  # one module, shared by every layer
        self.layers = nn.ModuleList(
            DecoderBlock(config, rope=self.rope, backend=backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(C, eps=config.norm_eps)
        self.lm_head = nn.Linear(C, V, bias=False)  # (V, C)
        self.tie_weights()
        self.tokenizer = None  # set by headwise.load

    ties_quantized = True  # tie_weights shares a QuantizedEmbedding's blocks with the head

    def tie_weights(self) -> None:
        if not self.config.tie_embeddings:
            return
        if isinstance(self.embed, QuantizedEmbedding):  # one buffer of blocks for both
            self.lm_head = QuantizedLinear.tied_to(self.embed)
        else:
            self.lm_head.weight = self.embed.weight

    def init_buffers(self) -> None:
        """Recompute RoPE's inv_freq (a non-persistent buffer) next to the weights, in fp32:
        after a meta-device build it is still on meta."""
        fresh = make_rope(self.config)
        self.rope.inv_freq = fresh.inv_freq.to(self.norm.weight.device)  # embed.weight may be a dequantized copy

    def forward(
        self, input_ids: Tensor, step: Step | None = None, *, cache=None, attention_mask: Tensor | None = None
    ) -> Tensor:
        """input_ids (B, T) -> logits (B, T, V) fp32, or (R, V) for the step's logits_indices.

        step: what this step runs over (`headwise.attention.step`): from `cache.step(T)`,
        `cache.batch(...)` or `cache.packed(...)`; None = a plain forward of the T tokens.
        Older form: cache= a multi-layer cache (the T tokens follow what it holds) or a paged
        step, and attention_mask (B, T): 1 = token, 0 = padding. Without a cache positions
        are 0..T-1 whatever the padding (as HF without position_ids); with one, 0s mark right
        padding of a ragged step, which the cache does not keep.
        """
        B, T = check_input_ids(input_ids)
        step = make_step(step, cache, attention_mask, B, T, input_ids.device)
        x = self.embed(input_ids)  # (B, T, C)
        executor = choose(self, x, step)  # the modules as written, or headwise's kernels (executors.py)
        x = logits_rows(executor.layers(self.layers, x, step), step)  # (B, T, C) or (R, C)
        return executor.head(self.norm, self.lm_head, x).float()  # (B, T, V) or (R, V)


# ---------------------------------------------------------------------------- HF weights


# fmt: off  (the weight table stays a visible, aligned table)
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """HF name -> headwise name and the HF shape. {i} = layer; `name[k]` = k-th row block of a
    tensor fused along dim 0 (qkv_proj rows [Q | K | V], gate_up rows [gate | up])."""
    C, V, F, D = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.head_dim
    Q, KV = cfg.num_heads * D, cfg.num_kv_heads * D
    hf, hw = "model.layers.{i}.", "layers.{i}."
    table = {
        "model.embed_tokens.weight": To("embed.weight", (V, C)),
        hf + "input_layernorm.weight": To(hw + "attn_norm.weight", (C,)),
        hf + "self_attn.q_proj.weight": To(hw + "attn.qkv_proj.weight[0]", (Q, C)),
        hf + "self_attn.k_proj.weight": To(hw + "attn.qkv_proj.weight[1]", (KV, C)),
        hf + "self_attn.v_proj.weight": To(hw + "attn.qkv_proj.weight[2]", (KV, C)),
        hf + "self_attn.o_proj.weight": To(hw + "attn.out_proj.weight", (C, Q)),
        hf + "post_attention_layernorm.weight": To(hw + "mlp_norm.weight", (C,)),
        hf + "mlp.gate_proj.weight": To(hw + "mlp.gate_up.weight[0]", (F, C)),
        hf + "mlp.up_proj.weight": To(hw + "mlp.gate_up.weight[1]", (F, C)),
        hf + "mlp.down_proj.weight": To(hw + "mlp.down.weight", (C, F)),
        "model.norm.weight": To("norm.weight", (C,)),
    }
    if cfg.attn_bias:  # Llama attention_bias=True, Qwen2
        table |= {
            hf + "self_attn.q_proj.bias": To(hw + "attn.qkv_proj.bias[0]", (Q,)),
            hf + "self_attn.k_proj.bias": To(hw + "attn.qkv_proj.bias[1]", (KV,)),
            hf + "self_attn.v_proj.bias": To(hw + "attn.qkv_proj.bias[2]", (KV,)),
        }
    if cfg.out_bias:
        table[hf + "self_attn.o_proj.bias"] = To(hw + "attn.out_proj.bias", (C,))
    if cfg.mlp_bias:
        table |= {
            hf + "mlp.gate_proj.bias": To(hw + "mlp.gate_up.bias[0]", (F,)),
            hf + "mlp.up_proj.bias": To(hw + "mlp.gate_up.bias[1]", (F,)),
            hf + "mlp.down_proj.bias": To(hw + "mlp.down.bias", (C,)),
        }
    if not cfg.tie_embeddings:
        table["lm_head.weight"] = To("lm_head.weight", (V, C))
    return table


# fmt: on


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    """HF tensors that are not weights of this model (fnmatch patterns)."""
    return (
        "model.layers.*.self_attn.rotary_emb.inv_freq",  # a buffer older transformers saved
        *(("lm_head.weight",) if cfg.tie_embeddings else ()),
    )  # a tied copy some checkpoints keep


Model = Llama
