"""GPT-2 family (Radford et al. 2019): learned positions, pre-norm LayerNorm, tanh-GELU MLP,
MHA with biases, output head tied to the token embedding.

HF stores GPT-2's projections as Conv1D, weight (in, out): the table transposes them
to nn.Linear's (out, in). c_attn is already fused [Q | K | V], like our qkv_proj.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..core.config import ModelConfig
from ..attention.step import Step, make_step
from .blocks import DecoderBlock, check_input_ids, check_length, logits_rows
from .executors import choose
from .linear import Embedding
from .loading import CheckpointError, To, hf_activation, hf_eos, need


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """HF GPT2Config dict -> ModelConfig."""
    unsupported = [
        k
        for k, bad in (
            ("scale_attn_by_inverse_layer_idx", True),
            ("scale_attn_weights", False),
            ("add_cross_attention", True),
        )
        if hf.get(k, not bad) == bad
    ]
    if unsupported:
        raise CheckpointError(
            f"GPT-2 options {', '.join(f'{k}={hf[k]}' for k in unsupported)} are not supported "
            f"(attention scale is 1/sqrt(D), self-attention only)"
        )
    C = need(hf, "n_embd")
    return ModelConfig(
        name=hf.get("_name_or_path") or "gpt2",
        arch="gpt2",
        vocab_size=need(hf, "vocab_size"),
        d_model=C,
        num_layers=need(hf, "n_layer"),
        num_heads=need(hf, "n_head"),
        d_ff=hf.get("n_inner") or 4 * C,
        max_positions=need(hf, "n_positions"),
        mlp="gelu",
        norm="layernorm",
        norm_placement="pre",
        positions="learned",
        tie_embeddings=True,  # GPT2LMHeadModel always ties lm_head to wte
        attn_bias=True,
        mlp_bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=hf_activation(hf.get("activation_function", "gelu_new")),
        eos_token_ids=hf_eos(hf),
    )


class GPT2(nn.Module):
    def __init__(self, config: ModelConfig, *, backend: str = "auto"):
        super().__init__()
        self.config = config
        C, V = config.d_model, config.vocab_size
        self.embed = Embedding(V, C)  # (V, C) wte
        self.pos_embed = Embedding(config.max_positions, C)  # (max_positions, C) wpe
        self.layers = nn.ModuleList(DecoderBlock(config, backend=backend) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(C, eps=config.norm_eps)  # ln_f
        self.lm_head = nn.Linear(C, V, bias=False)
        self.tie_weights()
        self.tokenizer = None  # set by headwise.load

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed.weight

    def init_buffers(self) -> None:
        pass  # no buffers

    def forward(
        self, input_ids: Tensor, step: Step | None = None, *, cache=None, attention_mask: Tensor | None = None
    ) -> Tensor:
        """input_ids (B, T) -> logits (B, T, V) fp32, or (R, V) for the step's logits_indices.
        step, cache and attention_mask as in `Llama.forward`."""
        B, T = check_input_ids(input_ids)
        step = make_step(step, cache, attention_mask, B, T, input_ids.device)
        first = step.layer(0)
        if first is None:
            check_length(T, self.config.max_positions, "GPT-2")
        else:
            held = getattr(first, "max_seq_len", None)  # host-side: no sync per step
            if held is not None and held > self.config.max_positions:
                raise ValueError(
                    f"the cache holds up to max_seq_len={held} tokens but this GPT-2 model has "
                    f"{self.config.max_positions} learned positions; build the cache with "
                    f"max_seq_len <= {self.config.max_positions}"
                )
        x = self.embed(input_ids) + self.pos_embed(step.input_positions)  # (B, T, C)
        x = choose(self, x, step).layers(self.layers, x, step)  # the modules, or headwise's kernels (executors.py)
        return self.lm_head(self.norm(logits_rows(x, step))).float()  # (B, T, V) or (R, V)


def hf_name(name: str) -> str:
    """GPT2Model checkpoints (openai's original upload) lack GPT2LMHeadModel's `transformer.` prefix."""
    return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"


# fmt: off  (the weight table stays a visible, aligned table)
def weight_table(cfg: ModelConfig) -> dict[str, To]:
    """HF name -> headwise name and the HF shape; transpose=True: Conv1D (in, out) -> Linear (out, in)."""
    C, V, F = cfg.d_model, cfg.vocab_size, cfg.d_ff
    hf, hw = "transformer.h.{i}.", "layers.{i}."
    return {
        "transformer.wte.weight": To("embed.weight", (V, C)),
        "transformer.wpe.weight": To("pos_embed.weight", (cfg.max_positions, C)),
        hf + "ln_1.weight": To(hw + "attn_norm.weight", (C,)),
        hf + "ln_1.bias": To(hw + "attn_norm.bias", (C,)),
        hf + "attn.c_attn.weight": To(hw + "attn.qkv_proj.weight", (C, 3 * C), transpose=True),  # [Q | K | V]
        hf + "attn.c_attn.bias": To(hw + "attn.qkv_proj.bias", (3 * C,)),
        hf + "attn.c_proj.weight": To(hw + "attn.out_proj.weight", (C, C), transpose=True),
        hf + "attn.c_proj.bias": To(hw + "attn.out_proj.bias", (C,)),
        hf + "ln_2.weight": To(hw + "mlp_norm.weight", (C,)),
        hf + "ln_2.bias": To(hw + "mlp_norm.bias", (C,)),
        hf + "mlp.c_fc.weight": To(hw + "mlp.up.weight", (C, F), transpose=True),
        hf + "mlp.c_fc.bias": To(hw + "mlp.up.bias", (F,)),
        hf + "mlp.c_proj.weight": To(hw + "mlp.down.weight", (F, C), transpose=True),
        hf + "mlp.c_proj.bias": To(hw + "mlp.down.bias", (C,)),
        "transformer.ln_f.weight": To("norm.weight", (C,)),
        "transformer.ln_f.bias": To("norm.bias", (C,)),
    }


# fmt: on


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    """HF tensors that are not weights of this model (fnmatch patterns)."""
    return (
        "transformer.h.*.attn.bias",  # causal-mask buffers older transformers saved
        "transformer.h.*.attn.masked_bias",
        "lm_head.weight",
    )  # tied to wte; some checkpoints keep a copy


Model = GPT2
