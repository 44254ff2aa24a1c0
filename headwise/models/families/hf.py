"""What every decoder family reads from an HF config the same way: widths, RoPE, windows.

A family's `config_from_hf` is `ModelConfig(**decoder_fields(hf, ...), <its own block fields>)`.
transformers 5 writes RoPE as `rope_parameters` (per layer type for Gemma 3) and windows as
`layer_types`; transformers 4 wrote `rope_theta` + `rope_scaling` and a family-specific rule
(Gemma 2: every other layer; Gemma 3: `sliding_window_pattern`). Both are read here.
"""

from __future__ import annotations

from ...core.config import RopeScaling
from ..loading import CheckpointError, hf_activation, hf_eos, need

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types
_ROPE_KINDS = ("default", "linear", "dynamic", "llama3")


def decoder_fields(
    hf: dict, *, tie_default: bool = False, act_key: str = "hidden_act", act_default: str = "silu"
) -> dict:
    """ModelConfig fields every RoPE decoder reads from the same HF keys (Llama's block: pre-norm
    RMSNorm, gated MLP, RoPE over the whole head, no window); a family overrides what differs."""
    C, H = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    max_positions = need(hf, "max_position_embeddings")
    theta, scaling = rope_params(hf, max_positions)
    attn_bias = bool(hf.get("attention_bias", False))
    return dict(
        name=hf.get("_name_or_path") or hf.get("model_type") or "decoder",
        arch="llama",  # every RoPE decoder: families/decoder.py builds it from the fields below
        vocab_size=need(hf, "vocab_size"),
        d_model=C,
        num_layers=need(hf, "num_hidden_layers"),
        num_heads=H,
        num_kv_heads=hf.get("num_key_value_heads") or H,
        head_dim=hf.get("head_dim") or C // H,
        d_ff=need(hf, "intermediate_size"),
        max_positions=max_positions,
        mlp="swiglu",  # gated: down(act(gate(x)) * up(x)); `activation` names act
        norm="rmsnorm",
        norm_placement="pre",
        positions="rope",
        tie_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        attn_bias=attn_bias,
        out_bias=attn_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation=hf_activation(hf.get(act_key) or hf.get("hidden_act") or act_default),
        rope_theta=theta,
        rope_scaling=scaling,
        eos_token_ids=hf_eos(hf),
    )


def rope_params(hf: dict, max_positions: int, layer_type: str | None = None) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's `rope_parameters` (or its `layer_type` entry where
    it is per layer type) or 4's `rope_theta` + `rope_scaling`. An unsupported kind is an error."""
    p = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if layer_type is not None and layer_type in p:
        p = p[layer_type]
    elif FULL in p or SLIDING in p:  # per layer type, asked for the plain one: the global layers'
        p = p.get(FULL) or {}
    p = dict(p)
    theta = float(p.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in _ROPE_KINDS:
        raise CheckpointError(
            f"rope scaling type {kind!r} is not supported ({hf.get('model_type')}); supported: {', '.join(_ROPE_KINDS)}"
        )
    return theta, RopeScaling(
        kind,
        float(p["factor"]),
        original_max_positions=p.get("original_max_position_embeddings", max_positions) if kind == "llama3" else None,
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
    )


def rotary_dim(hf: dict, head_dim: int) -> int | None:
    """RoPE's channels per head from partial_rotary_factor (Phi-3, top level or in rope_parameters);
    None = the whole head. Only families whose HF model reads the factor call this (Llama, Mistral,
    Qwen and Gemma rotate whole heads whatever their config says)."""
    p = hf.get("rope_parameters") or {}
    factor = p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) if isinstance(p, dict) else 1.0
    if factor in (None, 1.0):
        return None
    dim = int(head_dim * float(factor))  # as HF: int(head_dim * partial_rotary_factor)
    if dim <= 0 or dim % 2:
        raise CheckpointError(
            f"partial_rotary_factor={factor} gives {dim} rotary channels of {head_dim}; need even > 0"
        )
    return dim


def layer_windows(hf: dict, window: int | None, default_types: list[str]) -> dict:
    """{sliding_window, layer_windows} ModelConfig fields: every layer `window` (Mistral) as
    sliding_window, or a mix of windowed and global layers (HF `layer_types`, else `default_types`)
    as layer_windows, with sliding_window None so that nothing reads it as every layer's."""
    if window is None:
        return dict(sliding_window=None, layer_windows=None)
    types = hf.get("layer_types") or default_types
    n = need(hf, "num_hidden_layers")
    unknown = sorted({t for t in types} - {SLIDING, FULL})
    if unknown or len(types) != n:
        raise CheckpointError(
            f"layer_types {types} ({hf.get('model_type')}): need {n} entries of {SLIDING!r} or {FULL!r}"
            + (f"; {unknown} not supported" if unknown else "")
        )
    windows = tuple(int(window) if t == SLIDING else None for t in types)
    if all(w is not None for w in windows):
        return dict(sliding_window=int(window), layer_windows=None)
    return dict(sliding_window=None, layer_windows=windows)


def refuse(hf: dict, **options) -> None:
    """CheckpointError naming the first option whose value the family does not run ({key: is_bad(value)})."""
    for key, bad in options.items():
        if key in hf and bad(hf[key]):
            raise CheckpointError(f"{hf.get('model_type')}: {key}={hf[key]!r} is not supported")
