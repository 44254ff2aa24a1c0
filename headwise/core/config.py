"""Model and attention configs: small frozen dataclasses, plus named presets (fields in presets.py).

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

from .presets import ALIASES, PRESET_FIELDS

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
                    f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; pass head_dim explicitly"
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
                raise ValueError(
                    f"rope_scaling llama3 needs high_freq_factor={self.high_freq_factor} > "
                    f"low_freq_factor={self.low_freq_factor}"
                )


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
    # --- the block as data: what today's families vary (models/families); defaults are Llama's ---
    qk_norm: bool = False  # RMSNorm over each head's D on q and k, before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # also a norm on the attention's and the MLP's output before each add (Gemma 2/3)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before the mask (Gemma 2: 50)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2: 30)
    embed_scale: float | None = None  # token embeddings times this (Gemma: sqrt(C))
    attn_scale: float | None = None  # the scores' scale; None = 1/sqrt(D) (Gemma: query_pre_attn_scalar**-0.5)
    layer_windows: tuple[int | None, ...] | None = None  # per layer: W keys (sliding) or None (global);
    # None = every layer `sliding_window` (Mistral). Gemma 3: five 512-key local layers to one global
    rope_local_theta: float | None = None  # RoPE base of the windowed layers, unscaled (Gemma 3: 10000)
    rotary_dim: int | None = None  # partial rotary: RoPE over the first rotary_dim of each head; None = D

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
            vocab_size=self.vocab_size, num_layers=self.num_layers, d_ff=self.d_ff, max_positions=self.max_positions
        )
        if self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size={self.type_vocab_size} must be >= 0")
        attn = AttentionConfig(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim)
        object.__setattr__(self, "num_kv_heads", attn.num_kv_heads)
        object.__setattr__(self, "head_dim", attn.head_dim)
        self._check_block()

    def _check_block(self) -> None:
        for name in ("attn_softcap", "final_softcap", "embed_scale", "attn_scale", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be > 0 (or None)")
        if self.layer_windows is not None:
            windows = tuple(self.layer_windows)
            object.__setattr__(self, "layer_windows", windows)
            if len(windows) != self.num_layers:
                raise ValueError(
                    f"layer_windows has {len(windows)} entries but the model has num_layers={self.num_layers}; "
                    "give one per layer (an int W for a sliding window of W keys, None for a global layer)"
                )
            for i, w in enumerate(windows):
                if w is not None:
                    _check_positive(**{f"layer_windows[{i}]": w})
        if self.rotary_dim is not None:
            _check_positive(rotary_dim=self.rotary_dim)
            if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
                raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim={self.head_dim}")

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window in keys (it sees the W keys ending at each query), None = global."""
        if self.layer_windows is not None:
            return self.layer_windows[layer]
        return self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's window (None = global), in layer order."""
        return tuple(self.window(i) for i in range(self.num_layers))

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, bias=self.attn_bias)

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
# The fields and their sources are in presets.py (plain data); built and validated here.


def _build_presets() -> dict[str, ModelConfig]:
    built: dict[str, ModelConfig] = {}
    for fields in PRESET_FIELDS:
        fields = dict(fields)
        base = fields.pop("base", None)
        built[fields["name"]] = built[base].override(**fields) if base else ModelConfig(**fields)
    return built


PRESETS: dict[str, ModelConfig] = _build_presets()


def get_preset(name: str) -> ModelConfig:
    """Preset by name or alias, case-insensitive ("GPT2-small", "llama2_7b")."""
    key = name.strip().lower().replace("_", "-").split("/")[-1]  # accept "meta-llama/Llama-2-7b-hf"
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)} (aliases: {', '.join(ALIASES)})")
    return PRESETS[key]
