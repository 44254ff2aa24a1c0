"""The one decoder of every RoPE family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3), built from a ModelConfig.

A family is data (families/<name>.py: config_from_hf + its HF weight table); this model reads
the config's block fields and nothing else:

    x = embed(ids) * embed_scale                          Gemma: sqrt(C), rounded to the dtype as HF does
    per layer i (blocks.DecoderBlock):
      a = attn(norm(x)); x = x + post_norm(a)            post norms: Gemma 2/3; qk-norm inside attn (Qwen3, Gemma 3)
      m = mlp(norm(x));  x = x + post_norm(m)            gated MLP, act = SiLU (SwiGLU) or tanh GELU (GeGLU)
      attention window cfg.window(i) (None = global), scores * attn_scale, soft-capped by attn_softcap
      RoPE: `rope_local` on windowed layers where rope_local_theta is set (Gemma 3), else `rope`;
            over the first rotary_dim channels of each head (Phi-3's partial rotary)
    logits = head(norm(x)), then final_softcap * tanh(logits / final_softcap)   (Gemma 2)

RoPE's scaling variants (HF's ROPE_INIT_FUNCTIONS: linear, dynamic NTK, llama3) are here too.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ...attention import RotaryEmbedding
from ...attention.step import Step, make_step
from ...core.config import ModelConfig, RopeScaling
from ..blocks import DecoderBlock, RMSNorm, check_input_ids, logits_rows
from .. import executors
from ..linear import Embedding, QuantizedEmbedding, QuantizedLinear

# ---------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig, *, local: bool = False) -> Tensor:
    """(dim/2,) fp32 inverse frequencies, dim = rotary_dim or D, scaled as cfg.rope_scaling says
    (as HF's ROPE_INIT_FUNCTIONS); local: the windowed layers' base rope_local_theta, unscaled."""
    D = cfg.rotary_dim or cfg.head_dim
    theta, s = (cfg.rope_local_theta, None) if local else (cfg.rope_theta, cfg.rope_scaling)
    # on the CPU even inside a meta-device build: meta ops without a C++ kernel import torch._dynamo
    # (~1.5 s per process) for D/2 numbers that init_buffers computes again next to the weights
    exponent = torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D
    inv_freq = 1.0 / (theta**exponent)  # (D/2,)
    if s is None or s.kind == "dynamic":  # dynamic depends on the sequence: DynamicNTKRotary
        return inv_freq
    if s.kind == "linear":  # positions / factor == inv_freq / factor
        return inv_freq / s.factor
    return _llama3(inv_freq, s)


def _llama3(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Long wavelengths (> original / low) slow down by `factor`, short ones (< original / high) stay,
    and a linear ramp in original/wavelength blends between (Llama 3.1, Meta's reference code)."""
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


def make_rope(cfg: ModelConfig, *, local: bool = False) -> RotaryEmbedding:
    """The global layers' RoPE (every layer's without rope_local_theta), or with local=True the
    windowed layers' (Gemma 3: base rope_local_theta, unscaled)."""
    dim, s = cfg.rotary_dim or cfg.head_dim, cfg.rope_scaling
    if not local and s is not None and s.kind == "dynamic":
        return DynamicNTKRotary(dim, cfg.rope_theta, s.factor, cfg.max_positions)
    base = cfg.rope_local_theta if local else cfg.rope_theta
    return RotaryEmbedding(dim, base, inv_freq=rope_inv_freq(cfg, local=local))


# ---------------------------------------------------------------------------- model


class Decoder(nn.Module):
    """A RoPE decoder LM as its ModelConfig describes it (the module docstring)."""

    def __init__(self, config: ModelConfig, *, backend: str = "auto"):
        super().__init__()
        self.config = config
        C, V = config.d_model, config.vocab_size
        self.embed = Embedding(V, C)  # (V, C)
        self.rope = make_rope(config)  # shared by the layers that use it
        self.rope_local = make_rope(config, local=True) if config.rope_local_theta is not None else None
        self.layers = nn.ModuleList(
            DecoderBlock(config, layer=i, rope=self.rope_of(i), backend=backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(C, eps=config.norm_eps)
        self.lm_head = nn.Linear(C, V, bias=False)  # (V, C)
        self.tie_weights()
        self.tokenizer = None  # set by headwise.load

    ties_quantized = True  # tie_weights shares a QuantizedEmbedding's blocks with the head

    def rope_of(self, layer: int) -> RotaryEmbedding:
        """Layer `layer`'s RoPE: the local one on a windowed layer where there is one (Gemma 3)."""
        if self.rope_local is not None and self.config.window(layer) is not None:
            return self.rope_local
        return self.rope

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
        device = self.norm.weight.device  # embed.weight may be a dequantized copy
        self.rope.inv_freq = make_rope(self.config).inv_freq.to(device)
        if self.rope_local is not None:
            self.rope_local.inv_freq = make_rope(self.config, local=True).inv_freq.to(device)

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
        cfg = self.config
        x = self.embed(input_ids)  # (B, T, C)
        if cfg.embed_scale is not None:  # HF multiplies by sqrt(C) as a tensor of the stream's dtype
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        executor = executors.choose(self, x, step)  # the modules as written, or headwise's kernels
        x = logits_rows(executor.layers(self.layers, x, step), step)  # (B, T, C) or (R, C)
        logits = executor.head(self.norm, self.lm_head, x).float()  # (B, T, V) or (R, V)
        if cfg.final_softcap is not None:  # Gemma 2: logits kept within +-cap
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits
