"""BERT family (Devlin et al. 2018): bidirectional post-norm encoder with learned positions
and token types; sentence embeddings by mean or [CLS] pooling (Reimers & Gurevych 2019,
Sentence-BERT; all-MiniLM-L6-v2 is mean pooling + L2 normalization).

Post-norm: x = norm(x + attn(x)), then x = norm(x + mlp(x)), and one LayerNorm on the
embeddings. The model ends at hidden states, as HF's BertModel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.config import ModelConfig
from ..attention.step import padding_mask
from .blocks import check_input_ids, check_length, make_attention, make_mlp
from .linear import Embedding
from .loading import CheckpointError, To, hf_activation, need


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF BertConfig dict -> ModelConfig. The pooler is built when the checkpoint has one."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(
            f"BERT position_embedding_type={hf['position_embedding_type']!r} is not supported (absolute only)"
        )
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise CheckpointError("BERT as a decoder (is_decoder / add_cross_attention) is not supported")
    return ModelConfig(
        name=hf.get("_name_or_path") or "bert",
        arch="bert",
        vocab_size=need(hf, "vocab_size"),
        d_model=need(hf, "hidden_size"),
        num_layers=need(hf, "num_hidden_layers"),
        num_heads=need(hf, "num_attention_heads"),
        d_ff=need(hf, "intermediate_size"),
        max_positions=need(hf, "max_position_embeddings"),
        mlp="gelu",
        norm="layernorm",
        norm_placement="post",
        positions="learned",
        tie_embeddings=True,
        attn_bias=True,
        mlp_bias=True,
        type_vocab_size=hf.get("type_vocab_size", 2),
        pooler="pooler.dense.weight" in names,
        causal=False,
        lm_head=False,
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        activation=hf_activation(hf.get("hidden_act", "gelu")),
    )


class EncoderBlock(nn.Module):
    """Post-norm residual block: norm(x + attn(x)), then norm(x + mlp(x))."""

    def __init__(self, cfg: ModelConfig, *, backend: str = "auto"):
        super().__init__()
        self.attn = make_attention(cfg, backend=backend)
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = make_mlp(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        x = self.attn_norm(x + self.attn(x, key_padding_mask=key_padding_mask))  # (B, T, C)
        return self.mlp_norm(x + self.mlp(x))


class Bert(nn.Module):
    def __init__(self, config: ModelConfig, *, backend: str = "auto"):
        super().__init__()
        self.config = config
        C = config.d_model
        self.embed = Embedding(config.vocab_size, C)  # (V, C)
        self.pos_embed = Embedding(config.max_positions, C)  # (max_positions, C)
        self.type_embed = Embedding(max(1, config.type_vocab_size), C)  # (types, C)
        self.embed_norm = nn.LayerNorm(C, eps=config.norm_eps)
        self.layers = nn.ModuleList(EncoderBlock(config, backend=backend) for _ in range(config.num_layers))
        self.pooler = nn.Linear(C, C) if config.pooler else None  # dense + tanh over [CLS]
        self.tokenizer = None  # set by headwise.load

    def tie_weights(self) -> None:
        pass

    def init_buffers(self) -> None:
        pass

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """input_ids (B, T) -> hidden states (B, T, C). attention_mask (B, T): 1 = token,
        0 = padding (padded keys are ignored; padded rows still get values). token_type_ids
        (B, T): segment A = 0 / B = 1; None = all 0."""
        B, T = check_input_ids(input_ids)
        check_length(T, self.config.max_positions, "BERT")
        if token_type_ids is None:
            types = self.type_embed.weight[0]  # (C,): segment A everywhere
        elif token_type_ids.shape != input_ids.shape:
            raise ValueError(
                f"token_type_ids has shape {tuple(token_type_ids.shape)} but input_ids has {tuple(input_ids.shape)}"
            )
        else:
            types = self.type_embed(token_type_ids)  # (B, T, C)
        x = self.embed_norm(self.embed(input_ids) + types + self.pos_embed.weight[:T])  # (B, T, C), HF's order
        kpm = padding_mask(attention_mask, B, T)
        for layer in self.layers:
            x = layer(x, kpm)
        return x

    def pool(
        self, hidden: Tensor, attention_mask: Tensor | None = None, mode: str = "mean", *, normalize: bool = False
    ) -> Tensor:
        """(B, T, C) hidden states -> (B, C) sentence embeddings.

        mean: average over real tokens (attention_mask 1), as sentence-transformers does;
        cls: the [CLS] hidden state; pooler: HF's dense + tanh over [CLS] (pooler_output).
        normalize: L2-normalize (all-MiniLM-L6-v2 does, so cosine = dot product).
        """
        if mode == "mean":
            if attention_mask is None:
                out = hidden.mean(dim=1)
            else:
                m = attention_mask.to(hidden.dtype)[..., None]  # (B, T, 1)
                out = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        elif mode == "cls":
            out = hidden[:, 0]
        elif mode == "pooler":
            if self.pooler is None:
                raise ValueError("this checkpoint has no pooler weights (pooler.dense.*); use mode='cls' or 'mean'")
            out = torch.tanh(self.pooler(hidden[:, 0]))
        else:
            raise ValueError(f"pool mode {mode!r} is not one of mean, cls, pooler")
        return F.normalize(out, p=2, dim=-1) if normalize else out


def hf_name(name: str) -> str:
    """BertFor* checkpoints prefix the encoder with `bert.`; TF-era ones name LayerNorm gamma/beta."""
    name = name.removeprefix("bert.")
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


# fmt: off  (the weight table stays a visible, aligned table)
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """HF name -> headwise name and the HF shape; `name[k]` = k-th row block of qkv_proj ([Q | K | V])."""
    C, F_, P = cfg.d_model, cfg.d_ff, cfg.max_positions
    hf, hw = "encoder.layer.{i}.", "layers.{i}."
    table = {
        "embeddings.word_embeddings.weight": To("embed.weight", (cfg.vocab_size, C)),
        "embeddings.position_embeddings.weight": To("pos_embed.weight", (P, C)),
        "embeddings.token_type_embeddings.weight": To("type_embed.weight", (max(1, cfg.type_vocab_size), C)),
        "embeddings.LayerNorm.weight": To("embed_norm.weight", (C,)),
        "embeddings.LayerNorm.bias": To("embed_norm.bias", (C,)),
        hf + "attention.self.query.weight": To(hw + "attn.qkv_proj.weight[0]", (C, C)),
        hf + "attention.self.key.weight": To(hw + "attn.qkv_proj.weight[1]", (C, C)),
        hf + "attention.self.value.weight": To(hw + "attn.qkv_proj.weight[2]", (C, C)),
        hf + "attention.self.query.bias": To(hw + "attn.qkv_proj.bias[0]", (C,)),
        hf + "attention.self.key.bias": To(hw + "attn.qkv_proj.bias[1]", (C,)),
        hf + "attention.self.value.bias": To(hw + "attn.qkv_proj.bias[2]", (C,)),
        hf + "attention.output.dense.weight": To(hw + "attn.out_proj.weight", (C, C)),
        hf + "attention.output.dense.bias": To(hw + "attn.out_proj.bias", (C,)),
        hf + "attention.output.LayerNorm.weight": To(hw + "attn_norm.weight", (C,)),
        hf + "attention.output.LayerNorm.bias": To(hw + "attn_norm.bias", (C,)),
        hf + "intermediate.dense.weight": To(hw + "mlp.up.weight", (F_, C)),
        hf + "intermediate.dense.bias": To(hw + "mlp.up.bias", (F_,)),
        hf + "output.dense.weight": To(hw + "mlp.down.weight", (C, F_)),
        hf + "output.dense.bias": To(hw + "mlp.down.bias", (C,)),
        hf + "output.LayerNorm.weight": To(hw + "mlp_norm.weight", (C,)),
        hf + "output.LayerNorm.bias": To(hw + "mlp_norm.bias", (C,)),
    }
    if cfg.pooler:
        table |= {"pooler.dense.weight": To("pooler.weight", (C, C)), "pooler.dense.bias": To("pooler.bias", (C,))}
    return table


# fmt: on


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    """HF tensors that are not weights of this model (fnmatch patterns)."""
    return (
        "embeddings.position_ids",  # buffers older transformers saved
        "embeddings.token_type_ids",
        "cls.*",
    )  # BertForPreTraining's MLM / NSP heads: we end at hidden states


Model = Bert
