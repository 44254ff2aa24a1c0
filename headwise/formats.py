"""The GGML block formats headwise computes from, as plain data (no torch): plan.py sizes weights
with it, kernels/quant.py checks blocks against it.

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

# Formats with the 8-row packed layout (kernels/quant_blocks.h packable): every one headwise computes from.
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
