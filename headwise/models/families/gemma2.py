"""Gemma 2 (Gemma Team 2024, arXiv:2408.00118): local sliding-window and global layers alternating
(HF layer_types; by default layer 0 local), a norm before *and after* attention and the MLP, GeGLU
(gated tanh GELU), scores scaled by query_pre_attn_scalar**-0.5 and soft-capped (50), final logits
soft-capped (30), embeddings times sqrt(C), tied head.

Norm weights: Gemma's RMSNorm computes x / rms(x) * (1 + w) and HF stores w; the table adds 1
(To.add), so headwise's RMSNorm holds 1 + w and stays x / rms(x) * weight."""

from __future__ import annotations

from ...core.config import ModelConfig
from ..loading import To
from .decoder import Decoder
from .hf import FULL, SLIDING, decoder_fields, layer_windows, refuse
from .llama import ignored  # noqa: F401

Model = Decoder


def gemma_fields(hf: dict, default_types: list[str]) -> dict:
    """What Gemma 2 and 3 read alike: the block around the decoder's fields."""
    refuse(hf, use_bidirectional_attention=bool)  # EmbeddingGemma's encoder mode
    return decoder_fields(hf, tie_default=True, act_key="hidden_activation", act_default="gelu_pytorch_tanh") | dict(
        post_norms=True,
        embed_scale=hf["hidden_size"] ** 0.5,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        **layer_windows(hf, hf.get("sliding_window"), default_types),
    )


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF Gemma2Config dict -> ModelConfig."""
    n = hf.get("num_hidden_layers", 0)
    return ModelConfig(**gemma_fields(hf, [SLIDING if i % 2 == 0 else FULL for i in range(n)]))


# fmt: off
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """HF name -> headwise name and the HF shape; every norm weight w arrives as 1 + w (add=1)."""
    C, V, F, D = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.head_dim
    Q, KV = cfg.num_heads * D, cfg.num_kv_heads * D
    hf, hw = "model.layers.{i}.", "layers.{i}."
    table = {
        "model.embed_tokens.weight":              To("embed.weight", (V, C)),
        hf + "input_layernorm.weight":            To(hw + "attn_norm.weight", (C,), add=1.0),
        hf + "self_attn.q_proj.weight":           To(hw + "attn.qkv_proj.weight[0]", (Q, C)),
        hf + "self_attn.k_proj.weight":           To(hw + "attn.qkv_proj.weight[1]", (KV, C)),
        hf + "self_attn.v_proj.weight":           To(hw + "attn.qkv_proj.weight[2]", (KV, C)),
        hf + "self_attn.o_proj.weight":           To(hw + "attn.out_proj.weight", (C, Q)),
        hf + "post_attention_layernorm.weight":   To(hw + "attn_post_norm.weight", (C,), add=1.0),
        hf + "pre_feedforward_layernorm.weight":  To(hw + "mlp_norm.weight", (C,), add=1.0),
        hf + "mlp.gate_proj.weight":              To(hw + "mlp.gate_up.weight[0]", (F, C)),
        hf + "mlp.up_proj.weight":                To(hw + "mlp.gate_up.weight[1]", (F, C)),
        hf + "mlp.down_proj.weight":              To(hw + "mlp.down.weight", (C, F)),
        hf + "post_feedforward_layernorm.weight": To(hw + "mlp_post_norm.weight", (C,), add=1.0),
        "model.norm.weight":                      To("norm.weight", (C,), add=1.0),
    }
    if cfg.attn_bias:
        table |= {
            hf + "self_attn.q_proj.bias":         To(hw + "attn.qkv_proj.bias[0]", (Q,)),
            hf + "self_attn.k_proj.bias":         To(hw + "attn.qkv_proj.bias[1]", (KV,)),
            hf + "self_attn.v_proj.bias":         To(hw + "attn.qkv_proj.bias[2]", (KV,)),
            hf + "self_attn.o_proj.bias":         To(hw + "attn.out_proj.bias", (C,)),
        }
    if not cfg.tie_embeddings:
        table["lm_head.weight"] =                 To("lm_head.weight", (V, C))
    return table
# fmt: on
