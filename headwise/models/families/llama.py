"""Llama 1/2/3 and SmolLM2 (Touvron et al. 2023, arXiv:2302.13971): the plain block every other
decoder family varies. Pre-norm RMSNorm, RoPE (with HF's scaling variants), SwiGLU with gate and
up fused into one matmul, GQA/MQA, tied or untied head; no window."""

from __future__ import annotations

from ...core.config import ModelConfig
from ..loading import To
from .decoder import Decoder
from .hf import decoder_fields, refuse

Model = Decoder


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF LlamaConfig dict -> ModelConfig."""
    refuse(hf, pretraining_tp=lambda tp: tp not in (None, 1))  # a training-time split: all 1 in fp32
    return ModelConfig(**decoder_fields(hf))


# the weight table stays a visible, aligned table
# fmt: off
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """HF name -> headwise name and the HF shape. {i} = layer; `name[k]` = k-th row block of a
    tensor fused along dim 0 (qkv_proj rows [Q | K | V], gate_up rows [gate | up]). Mistral, Qwen2
    and Qwen3 name their weights the same way."""
    C, V, F, D = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.head_dim
    Q, KV = cfg.num_heads * D, cfg.num_kv_heads * D
    hf, hw = "model.layers.{i}.", "layers.{i}."
    table = {
        "model.embed_tokens.weight":             To("embed.weight", (V, C)),
        hf + "input_layernorm.weight":           To(hw + "attn_norm.weight", (C,)),
        hf + "self_attn.q_proj.weight":          To(hw + "attn.qkv_proj.weight[0]", (Q, C)),
        hf + "self_attn.k_proj.weight":          To(hw + "attn.qkv_proj.weight[1]", (KV, C)),
        hf + "self_attn.v_proj.weight":          To(hw + "attn.qkv_proj.weight[2]", (KV, C)),
        hf + "self_attn.o_proj.weight":          To(hw + "attn.out_proj.weight", (C, Q)),
        hf + "post_attention_layernorm.weight":  To(hw + "mlp_norm.weight", (C,)),
        hf + "mlp.gate_proj.weight":             To(hw + "mlp.gate_up.weight[0]", (F, C)),
        hf + "mlp.up_proj.weight":               To(hw + "mlp.gate_up.weight[1]", (F, C)),
        hf + "mlp.down_proj.weight":             To(hw + "mlp.down.weight", (C, F)),
        "model.norm.weight":                     To("norm.weight", (C,)),
    }
    if cfg.attn_bias:  # Llama attention_bias=True, Qwen2
        table |= {
            hf + "self_attn.q_proj.bias":        To(hw + "attn.qkv_proj.bias[0]", (Q,)),
            hf + "self_attn.k_proj.bias":        To(hw + "attn.qkv_proj.bias[1]", (KV,)),
            hf + "self_attn.v_proj.bias":        To(hw + "attn.qkv_proj.bias[2]", (KV,)),
        }
    if cfg.out_bias:
        table[hf + "self_attn.o_proj.bias"] =    To(hw + "attn.out_proj.bias", (C,))
    if cfg.mlp_bias:
        table |= {
            hf + "mlp.gate_proj.bias":           To(hw + "mlp.gate_up.bias[0]", (F,)),
            hf + "mlp.up_proj.bias":             To(hw + "mlp.gate_up.bias[1]", (F,)),
            hf + "mlp.down_proj.bias":           To(hw + "mlp.down.bias", (C,)),
        }
    if not cfg.tie_embeddings:
        table["lm_head.weight"] =                To("lm_head.weight", (V, C))
    return table
# fmt: on


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    """HF tensors that are not weights of this model (fnmatch patterns)."""
    return (
        "model.layers.*.self_attn.rotary_emb.inv_freq",  # a buffer older transformers saved
        *(("lm_head.weight",) if cfg.tie_embeddings else ()),  # a tied copy some checkpoints keep
    )
