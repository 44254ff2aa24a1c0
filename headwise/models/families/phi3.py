"""Phi-3 (Abdin et al. 2024, arXiv:2404.14219): Llama's block with q|k|v and gate|up each stored as
one fused matrix (qkv_proj, gate_up_proj), RoPE over the first partial_rotary_factor of each head,
and a window on every layer where sliding_window is set (Phi-3-mini: 2047).

longrope / su / yarn scaling (the 128k variants) is not implemented: a CheckpointError names it."""

from __future__ import annotations

from ...core.config import ModelConfig
from ..loading import To
from .decoder import Decoder
from .hf import decoder_fields, rotary_dim
from .llama import ignored  # noqa: F401

Model = Decoder


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF Phi3Config dict -> ModelConfig (no biases anywhere: Phi3Attention has none)."""
    fields = decoder_fields(hf) | dict(attn_bias=False, out_bias=False, mlp_bias=False)
    rotary = rotary_dim(hf, fields["head_dim"])
    return ModelConfig(**fields, rotary_dim=rotary, sliding_window=hf.get("sliding_window"))


# fmt: off
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """HF name -> headwise name and the HF shape; the fused matrices go over as they are: qkv_proj
    rows [Q | K | V] and gate_up_proj rows [gate | up] are headwise's own layouts."""
    C, V, F, D = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.head_dim
    Q, KV = cfg.num_heads * D, cfg.num_kv_heads * D
    hf, hw = "model.layers.{i}.", "layers.{i}."
    table = {
        "model.embed_tokens.weight":             To("embed.weight", (V, C)),
        hf + "input_layernorm.weight":           To(hw + "attn_norm.weight", (C,)),
        hf + "self_attn.qkv_proj.weight":        To(hw + "attn.qkv_proj.weight", (Q + 2 * KV, C)),
        hf + "self_attn.o_proj.weight":          To(hw + "attn.out_proj.weight", (C, Q)),
        hf + "post_attention_layernorm.weight":  To(hw + "mlp_norm.weight", (C,)),
        hf + "mlp.gate_up_proj.weight":          To(hw + "mlp.gate_up.weight", (2 * F, C)),
        hf + "mlp.down_proj.weight":             To(hw + "mlp.down.weight", (C, F)),
        "model.norm.weight":                     To("norm.weight", (C,)),
    }
    if not cfg.tie_embeddings:
        table["lm_head.weight"] =                To("lm_head.weight", (V, C))
    return table
# fmt: on
