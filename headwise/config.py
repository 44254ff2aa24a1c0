"""Model and attention configs: small frozen dataclasses, plus named presets.

Dimension names follow DESIGN.md: C model width, H query heads, Hkv key/value
heads, G = H // Hkv queries per KV head, D head dim, F MLP hidden width.

Only fields that change a parameter count, a FLOP count or the KV-cache size
live here; serving limits belong to the engine's config. No torch import, so
`headwise plan` starts fast.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

ARCHES = ("bert", "gpt2", "gpt3", "llama")
MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
POSITIONS = ("learned", "rope")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")  # gelu = exact erf; gelu_tanh = GPT-2's "gelu_new"
ROPE_SCALINGS = ("linear", "dynamic", "llama3")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class AttentionConfig:
    """One attention layer: H query heads over Hkv shared key/value heads.

    >>> AttentionConfig(d_model=8192, num_heads=64, num_kv_heads=8).kind
    'GQA'
    """

    d_model: int  # C, width of the residual stream in and out
    num_heads: int  # H query heads
    num_kv_heads: int | None = None  # Hkv; None means H (plain MHA)
    head_dim: int | None = None  # D; None means C // H
    bias: bool = False  # biases on the Q, K, V and O projections
    dropout: float = 0.0  # on the attention weights, training only

    def __post_init__(self) -> None:
        _check_positive(d_model=self.d_model, num_heads=self.num_heads)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _check_positive(num_kv_heads=self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}; "
                "each KV head must serve the same number of query heads"
            )
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                    "pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        _check_positive(head_dim=self.head_dim)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def group_size(self) -> int:
        """G: query heads that read each KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def kind(self) -> str:
        """MHA (Hkv == H), MQA (Hkv == 1) or GQA (anything between)."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


@dataclass(frozen=True)
class RopeScaling:
    """How a RoPE model reads positions past its trained context (HF `rope_scaling`).

    linear: positions / factor (Chen et al. 2023, "Extending context window ... via
        positional interpolation", arXiv:2306.15595).
    dynamic: NTK-aware base that grows with the sequence once it passes
        max_positions (/u/bloc97 and /u/emozilla, 2023); no change below it.
    llama3: low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1).
    """

    kind: str  # one of ROPE_SCALINGS
    factor: float  # context stretch: 8.0 for Llama 3.1
    original_max_positions: int | None = None  # llama3: pretraining context (8192 for Llama 3.1)
    low_freq_factor: float = 1.0  # llama3: wavelengths above original/low are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept

    def __post_init__(self) -> None:
        _check_choice("rope_scaling kind", self.kind, ROPE_SCALINGS)
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor={self.factor} must be > 0")
        if self.kind == "llama3":
            if self.original_max_positions is None:
                raise ValueError("rope_scaling llama3 needs original_max_positions (8192 for Llama 3.1)")
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(f"rope_scaling llama3 needs high_freq_factor={self.high_freq_factor} > "
                                 f"low_freq_factor={self.low_freq_factor}")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder LM or a BERT-style encoder, as far as counts are concerned."""

    name: str
    arch: str  # one of ARCHES; picks the model family that loads it
    vocab_size: int  # V
    d_model: int  # C
    num_layers: int  # L
    num_heads: int  # H
    d_ff: int  # F, MLP hidden width (per branch for SwiGLU)
    max_positions: int  # trained context; the size of a learned position table
    num_kv_heads: int | None = None  # Hkv; None means H
    head_dim: int | None = None  # D; None means C // H
    mlp: str = "gelu"  # "gelu": up, down; "swiglu": gate, up, down
    norm: str = "layernorm"  # LayerNorm has weight + bias, RMSNorm weight only
    norm_placement: str = "pre"  # pre: 2/layer + final; post (BERT): embeddings + 2/layer
    positions: str = "learned"  # "learned" adds a (max_positions, C) table; "rope" adds none
    tie_embeddings: bool = True  # output head reuses the token embedding matrix
    attn_bias: bool = False
    mlp_bias: bool = False
    type_vocab_size: int = 0  # BERT segment (token type) embeddings
    pooler: bool = False  # BERT's dense + tanh over [CLS], (C, C) + bias
    causal: bool = True  # decoders keep a KV cache; encoders recompute K/V each pass
    lm_head: bool = True  # ends in a (C, V) projection; BertModel ends at hidden states
    out_bias: bool | None = None  # O projection bias; None = attn_bias. Qwen2 biases Q, K, V but not O
    # --- numerics the model code needs; they change no count ---
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon: GPT-2 and Llama 2 1e-5, BERT 1e-12
    activation: str | None = None  # None: the MLP's own (gelu: exact erf GELU; swiglu: SiLU)
    rope_theta: float = 10000.0  # RoPE base; Llama 3 uses 500000 to stretch wavelengths
    rope_scaling: RopeScaling | None = None  # None = plain RoPE
    sliding_window: int | None = None  # Mistral v0.1: keys older than this many tokens are not seen
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these

    def __post_init__(self) -> None:
        _check_choice("arch", self.arch, ARCHES)
        _check_choice("mlp", self.mlp, MLPS)
        if self.activation is None:
            object.__setattr__(self, "activation", "silu" if self.mlp == "swiglu" else "gelu")
        _check_choice("activation", self.activation, ACTIVATIONS)
        if self.out_bias is None:
            object.__setattr__(self, "out_bias", self.attn_bias)
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0")
        if self.sliding_window is not None:
            _check_positive(sliding_window=self.sliding_window)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _check_choice("positions", self.positions, POSITIONS)
        _check_positive(
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            d_ff=self.d_ff,
            max_positions=self.max_positions,
        )
        if self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size={self.type_vocab_size} must be >= 0")
        attn = AttentionConfig(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim)
        object.__setattr__(self, "num_kv_heads", attn.num_kv_heads)
        object.__setattr__(self, "head_dim", attn.head_dim)

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(
            self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, bias=self.attn_bias
        )

    def override(self, **changes) -> ModelConfig:
        """A copy with `changes` applied; derived fields follow their sources.

        head_dim was C // H and stays so when C or H changes; a model that was
        MHA stays MHA when H changes. Pass head_dim / num_kv_heads to pin them.
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown config field(s) {', '.join(unknown)}; valid: {', '.join(field_names())}")
        shape_changed = "d_model" in changes or "num_heads" in changes
        if shape_changed and "head_dim" not in changes and self.head_dim == self.d_model // self.num_heads:
            changes["head_dim"] = None
        if "num_heads" in changes and "num_kv_heads" not in changes and self.num_kv_heads == self.num_heads:
            changes["num_kv_heads"] = None
        mlp_default = "silu" if self.mlp == "swiglu" else "gelu"
        if "mlp" in changes and "activation" not in changes and self.activation == mlp_default:
            changes["activation"] = None  # it was the MLP's default, so it follows the MLP
        if "attn_bias" in changes and "out_bias" not in changes and self.out_bias == self.attn_bias:
            changes["out_bias"] = None
        return dataclasses.replace(self, **changes)


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]


def parse_overrides(items: list[str]) -> dict[str, object]:
    """["num_layers=24", "tie_embeddings=false"] -> {"num_layers": 24, ...}, typed by field."""
    hints = typing.get_type_hints(ModelConfig)
    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not KEY=VALUE (e.g. num_layers=24)")
        if key not in hints:
            raise ValueError(f"unknown config field {key!r}; valid: {', '.join(field_names())}")
        kind = hints[key]
        args = typing.get_args(kind)
        if type(None) in args:  # X | None
            if raw.lower() in ("none", ""):
                out[key] = None
                continue
            kind = next(a for a in args if a is not type(None))
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{key} expects true/false, got {raw!r}")
            out[key] = raw.lower() in ("true", "1", "yes")
        elif kind is str:
            out[key] = raw
        elif kind is float:
            try:
                out[key] = float(raw.replace("_", ""))
            except ValueError:
                raise ValueError(f"{key} expects a number, got {raw!r}") from None
        elif kind is not int:
            raise ValueError(f"{key} cannot be set as KEY=VALUE; use ModelConfig.override in Python")
        else:
            try:
                out[key] = int(raw.replace("_", ""))
            except ValueError:
                raise ValueError(f"{key} expects an int, got {raw!r}") from None
    return out


# --- presets -----------------------------------------------------------------
# Sources: BERT, Devlin et al. 2018 (arXiv:1810.04805) + google-research/bert
# configs; GPT-2, Radford et al. 2019 + openai/gpt-2 hparams; GPT-3, Brown et
# al. 2020 (arXiv:2005.14165) Table 2.1; Llama 2, Touvron et al. 2023
# (arXiv:2307.09288) + meta-llama/Llama-2-*-hf config.json; SmolLM2 and
# all-MiniLM-L6-v2 from their Hugging Face config.json files.

_BERT_BASE = ModelConfig(
    name="bert-base",
    arch="bert",
    vocab_size=30522,  # WordPiece vocab of bert-base-uncased
    d_model=768,
    num_layers=12,
    num_heads=12,  # D = 64, the original Transformer's per-head width
    d_ff=3072,  # 4 * C, as in the original Transformer
    max_positions=512,  # learned table; the last 10% of pretraining used 512-token sequences
    mlp="gelu",
    norm="layernorm",
    norm_placement="post",  # LayerNorm after each residual add, plus one on embeddings
    positions="learned",
    tie_embeddings=True,  # the MLM decoder shares the word embeddings
    attn_bias=True,
    mlp_bias=True,
    type_vocab_size=2,  # sentence A / sentence B for next-sentence prediction
    pooler=True,  # dense + tanh over [CLS] for NSP; in BertModel's 109.48M
    causal=False,  # bidirectional encoder: no KV cache
    lm_head=False,  # BertModel (what checkpoints load into) ends at hidden states
    norm_eps=1e-12,  # google-research/bert's LayerNorm epsilon
)

_GPT2 = ModelConfig(
    name="gpt2",
    arch="gpt2",
    vocab_size=50257,  # 50257 BPE tokens: 50,000 merges + 256 bytes + <|endoftext|>
    d_model=768,
    num_layers=12,
    num_heads=12,  # D = 64
    d_ff=3072,  # 4 * C
    max_positions=1024,  # learned table; GPT-2 doubled GPT-1's 512
    mlp="gelu",
    norm="layernorm",
    norm_placement="pre",  # GPT-2 moved LayerNorm to the block input, plus a final one
    positions="learned",
    tie_embeddings=True,  # LM head is wte^T
    attn_bias=True,  # c_attn and c_proj are Conv1D with bias
    mlp_bias=True,
    activation="gelu_tanh",  # "gelu_new": the tanh approximation openai/gpt-2 trained with
    eos_token_ids=(50256,),  # <|endoftext|>
)

_GPT3_175B = ModelConfig(
    name="gpt3-175b",
    arch="gpt3",
    vocab_size=50257,  # same BPE as GPT-2
    d_model=12288,
    num_layers=96,
    num_heads=96,
    head_dim=128,  # Table 2.1 d_head; equals C / H
    d_ff=4 * 12288,  # Table 2.1: d_ff = 4 * d_model at every size
    max_positions=2048,  # n_ctx for every GPT-3 size
    mlp="gelu",
    norm="layernorm",
    norm_placement="pre",
    positions="learned",
    tie_embeddings=True,  # same design as GPT-2
    attn_bias=True,
    mlp_bias=True,
    # GPT-3 alternates dense and locally banded sparse attention; that changes
    # FLOPs of the sparse layers but not any weight shape. We count all dense.
)

_LLAMA2_7B = ModelConfig(
    name="llama-2-7b",
    arch="llama",
    vocab_size=32000,  # SentencePiece BPE from Llama 1
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,  # only the 34B and 70B Llama 2 models use GQA
    head_dim=128,
    d_ff=11008,  # ~ 2/3 * 4C for SwiGLU's three matrices, rounded up to a multiple of 256
    max_positions=4096,  # Llama 2 doubled Llama 1's 2048
    mlp="swiglu",
    norm="rmsnorm",
    norm_placement="pre",
    positions="rope",
    tie_embeddings=False,  # separate lm_head: 131M more parameters
    attn_bias=False,
    mlp_bias=False,
)

_LLAMA2_70B = _LLAMA2_7B.override(
    name="llama-2-70b",
    d_model=8192,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,  # GQA, G = 8: an 8x smaller KV cache than MHA
    head_dim=128,
    d_ff=28672,  # 1.3 * (2/3 * 4C) rounded up to 4096; a wider MLP buys back what GQA takes from K, V
)

_SMOLLM2_135M = ModelConfig(
    name="smollm2-135m",
    arch="llama",
    vocab_size=49152,  # SmolLM's own BPE, 48 * 1024
    d_model=576,
    num_layers=30,  # deep and narrow: MobileLLM found depth pays more than width at this size
    num_heads=9,
    num_kv_heads=3,  # GQA, G = 3
    head_dim=64,
    d_ff=1536,
    max_positions=8192,  # max_position_embeddings in its config.json
    mlp="swiglu",
    norm="rmsnorm",
    norm_placement="pre",
    positions="rope",
    tie_embeddings=True,  # the embedding is 28M of 135M parameters; one copy, not two
    attn_bias=False,
    mlp_bias=False,
    rope_theta=100000.0,  # config.json rope_theta: a longer base for its 8192 context
)

_MINILM_L6 = _BERT_BASE.override(
    name="all-minilm-l6-v2",
    d_model=384,
    num_layers=6,  # every second layer of MiniLM-L12-H384, then contrastive fine-tuning
    num_heads=12,  # D = 32: BERT-base's 12 heads at half its 64 width
    d_ff=1536,  # 4 * C
    # vocab, positions, token types and pooler are BERT's: same tokenizer and layout
)

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (_BERT_BASE, _GPT2, _GPT3_175B, _LLAMA2_7B, _LLAMA2_70B, _SMOLLM2_135M, _MINILM_L6)
}

ALIASES = {
    "bert-base-uncased": "bert-base",
    "bert": "bert-base",
    "gpt2-small": "gpt2",
    "gpt-2": "gpt2",
    "gpt3": "gpt3-175b",
    "gpt-3": "gpt3-175b",
    "llama2-7b": "llama-2-7b",
    "llama-2-7b-hf": "llama-2-7b",
    "llama2-70b": "llama-2-70b",
    "llama-2-70b-hf": "llama-2-70b",
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "all-minilm-l6": "all-minilm-l6-v2",
    "minilm": "all-minilm-l6-v2",
}


def get_preset(name: str) -> ModelConfig:
    """Preset by name or alias, case-insensitive ("GPT2-small", "llama2_7b")."""
    key = name.strip().lower().replace("_", "-").split("/")[-1]  # accept "meta-llama/Llama-2-7b-hf"
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)} (aliases: {', '.join(ALIASES)})")
    return PRESETS[key]
