"""The GGML block formats headwise computes from, and llama-quantize's mixes of them, as plain data
(no torch): plan.py sizes weights with it, kernels/quant.py checks blocks against it,
headwise.load(weights=...) picks each weight's format with it.

name -> (GGML type id, values per block, bytes per block), the block_* structs of ggml-common.h.
"""

from __future__ import annotations

QUANT_FORMATS = {
    "q4_0": (2, 32, 18),  # f16 d, 16 bytes of 4-bit q: w = d (q - 8)
    "q4_1": (3, 32, 20),  # f16 d, f16 m, 16 bytes: w = d q + m
    "q5_0": (6, 32, 22),  # f16 d, 4 bytes of fifth bits, 16 bytes of low nibbles: w = d (q - 16)
    "q5_1": (7, 32, 24),  # f16 d, f16 m, 4 + 16 bytes: w = d q + m
    "q8_0": (8, 32, 34),  # f16 d, 32 int8: w = d q
    "q4_k": (12, 256, 144),  # f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 bytes of 4-bit q
    "q5_k": (13, 256, 176),  # Q4_K's fields with 32 bytes of fifth bits before the 128 of low nibbles
    "q6_k": (14, 256, 210),  # 128 + 64 bytes of 6-bit q, 16 int8 scales, f16 d
}

# Formats with the 8-row packed layout (kernels/csrc/generic/quant_formats.h packable): every one headwise computes from.
PACKABLE = tuple(QUANT_FORMATS)


def bits_per_weight(fmt: str) -> float:
    """Bits a weight takes in `fmt`, its block's scales included (q4_1: 5.0, q8_0: 8.5)."""
    _, values, nbytes = QUANT_FORMATS[fmt]
    return 8 * nbytes / values


# llama-quantize's type for a weight whose rows are not whole super-blocks of the K-quant asked for
# (SmolLM2's 576-wide rows, MiniLM's 384): headwise.load(weights=...) and plan.py follow it.
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def target_format(fmt: str, in_features: int) -> str | None:
    """The format a weight of rows of in_features values takes when `fmt` is asked for: `fmt`, its
    FALLBACK where the rows are not whole blocks of it, or None (the weight stays float)."""
    for f in (fmt, FALLBACK.get(fmt)):
        if f is not None and in_features % QUANT_FORMATS[f][1] == 0:
            return f
    return None


# Formats whose blocks hold exactly what a Q8_0 block can (w = d (q - offset): one f16 d per 32
# values, q - offset within int8). A fused q|k|v whose parts mix them is held as Q8_0 blocks of the
# same values (llama.cpp's Q4_K_M on narrow models: Q5_0 Q and K beside a Q8_0 V).
AS_Q8_0 = ("q4_0", "q5_0", "q8_0")


def fused_format(fmts) -> str | None:
    """The format parts in `fmts` share once fused: their one format, Q8_0 where they differ but all
    fit it, else None (held apart, or fp32 where they cannot be: models/quantized_load.py)."""
    fmts = set(fmts)
    if len(fmts) == 1:
        return next(iter(fmts))
    return "q8_0" if fmts <= set(AS_Q8_0) else None


# llama-quantize's K-quant mixes (its ftypes Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M): a base format and a
# few weights given more bits. name -> base format.
MIXES = {"q4_k_s": "q4_k", "q4_k_m": "q4_k", "q5_k_s": "q5_k", "q5_k_m": "q5_k"}

# The roles a weight plays in a mix, llama.cpp's tensor categories: attn_qkv is a checkpoint's own
# fused q|k|v (GPT-2's c_attn); "output" is the head, or the token embedding where the head is tied.
ROLES = ("output", "token_embd", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama-quantize's choice of layers for more bits: the first and last eighth, every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def big_gqa(arch: str, num_layers: int, num_heads: int, num_kv_heads: int) -> bool:
    """llama.cpp's LLM_TYPE_70B for a Llama-family model (80 layers, grouped K/V), whose V a mix gives
    Q5_K where it would be Q4_K (mix_format's big_gqa)."""
    return arch == "llama" and num_layers == 80 and num_kv_heads < num_heads


def mix_format(
    mix: str, role: str, layer: int, num_layers: int, in_features: int, *, big_gqa: bool = False
) -> str | None:
    """The format llama-quantize's `mix` gives one weight (llama_tensor_get_type for a dense model,
    llama.cpp b11434): the head (or a tied embedding) Q6_K, Q8_0 where its rows are not whole
    super-blocks; V (or a fused q|k|v) and the down projection Q6_K in the use_more_bits layers for
    the _m mixes; Q5_K for the first 4 V and the first eighth of the down projections in q4_k_s;
    V Q5_K for a 70B-class GQA model (`big_gqa`, llama.cpp's LLM_TYPE_70B) where it would be Q4_K;
    the base format elsewhere; then FALLBACK for rows that are not whole blocks. None: stays float."""
    base = MIXES[mix]
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    if role == "output":
        return target_format("q6_k" if in_features % QUANT_FORMATS[base][1] == 0 else "q8_0", in_features)
    fmt = base
    more = use_more_bits(layer, num_layers)
    if role in ("attn_v", "attn_qkv"):
        if mix in ("q4_k_m", "q5_k_m") and more:
            fmt = "q6_k"
        elif mix == "q4_k_s" and layer < 4:
            fmt = "q5_k"
        if big_gqa and fmt == "q4_k":
            fmt = "q5_k"
    elif role == "ffn_down":
        if mix in ("q4_k_m", "q5_k_m") and more:
            fmt = "q6_k"
        elif mix == "q4_k_s" and layer < num_layers // 8:
            fmt = "q5_k"
    return target_format(fmt, in_features)
