/* A GGML block as vectors (generic/quant_formats.h has the formats): one 32-value block of a
 * weight row unpacked to 32 bytes and its scale and offset, for the row-major kernels (quant_rows.h,
 * dequantize.c); and the byte packing the quantizers share. AVX2, the same in both variants. */
#ifndef HW_QUANT_UNPACK_H
#define HW_QUANT_UNPACK_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../../generic/quant_formats.h"

/* rounded() on 8 lanes: no FMA with what follows. */
static inline __m256 rounded8(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

/* 4 x 8 int32 -> 32 int8 in order (the packs interleave 128-bit lanes; the permute undoes it). */
static inline __m256i pack32(const __m256i i[4]) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* ---- weights: one 32-value block -> 32 bytes ---- */

/* One 32-block of a weight, unpacked: q (32 bytes in value order), the scale dw and offset mw
 * (w = dw q + mw), and for signed formats the int16 multipliers of the product pairs (Q6_K's
 * two 16-value scales; ones otherwise). */
typedef struct {
    __m256i q, mul;
    float dw, mw;
} wblock;

static inline __m256i nibbles16(const uint8_t *qs) {  /* 16 bytes -> low nibbles, then high */
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* byte j = 0xFF where bit j of x is set, else 0 (each byte ORed with all bits but its own). */
static inline __m256i bits_to_bytes(uint32_t x) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i b = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread),
                                      _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

/* A Q5 block's 32 values 0..31 in order: the 16 bytes' nibbles (low first) and qh's bit j as
 * value j's fifth bit (ggml's dequantize_row_q5_0). */
static inline __m256i fives(const uint8_t *qh, const uint8_t *qs) {
    uint32_t h;
    memcpy(&h, qh, 4);
    return _mm256_or_si256(nibbles16(qs), _mm256_and_si256(bits_to_bytes(h), _mm256_set1_epi8(0x10)));
}

/* Block b (of I / 32) of weight row `row`. */
static inline __attribute__((always_inline)) wblock unpack(int fmt, const uint8_t *row, long b) {
    wblock w;
    w.mul = _mm256_set1_epi16(1);
    if (fmt == Q4_0) {
        const uint8_t *p = row + b * 18;
        w.q = nibbles16(p + 2), w.dw = f16(p), w.mw = -8.0f * w.dw;
    } else if (fmt == Q4_1) {
        const uint8_t *p = row + b * 20;
        w.q = nibbles16(p + 4), w.dw = f16(p), w.mw = f16(p + 2);
    } else if (fmt == Q5_0) {
        const uint8_t *p = row + b * 22;
        w.q = fives(p + 2, p + 6), w.dw = f16(p), w.mw = -16.0f * w.dw;
    } else if (fmt == Q5_1) {
        const uint8_t *p = row + b * 24;
        w.q = fives(p + 4, p + 8), w.dw = f16(p), w.mw = f16(p + 2);
    } else if (fmt == Q8_0) {
        const uint8_t *p = row + b * 34;
        w.q = _mm256_loadu_si256((const __m256i *)(p + 2)), w.dw = f16(p), w.mw = 0.0f;
    } else if (fmt == Q4_K || fmt == Q5_K) {  /* Q5_K: Q4_K's fields, then 32 bytes of fifth bits (bit j of
                                               * qh[l]: value l of sub-block j) before the nibbles */
        const int five = fmt == Q5_K;
        const uint8_t *p = row + (b / 8) * (five ? 176 : 144);
        const int j = (int)(b % 8);
        int sc, mn;
        k4_scale_min(p + 4, j, &sc, &mn);
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + (five ? 48 : 16) + 32 * (j / 2)));
        if (j & 1) v = _mm256_srli_epi16(v, 4);
        w.q = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
        if (five) {
            const __m256i hb = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(p + 16)), _mm_cvtsi32_si128(j));
            w.q = _mm256_or_si256(w.q, _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x01)), 4));
        }
        w.dw = f16(p) * (float)sc, w.mw = -(f16(p + 2) * (float)mn);
    } else {  /* Q6_K */
        const uint8_t *p = row + (b / 8) * 210;
        const int j = (int)(b % 8), h = j / 4;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (j % 2)));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        const __m128i sh_lo = _mm_cvtsi32_si128(4 * ((j % 4) / 2)), sh_hi = _mm_cvtsi32_si128(2 * (j % 4));
        const __m256i ql = _mm256_and_si256(_mm256_srl_epi16(lo, sh_lo), _mm256_set1_epi8(0x0F));
        const __m256i qh = _mm256_and_si256(_mm256_srl_epi16(hi, sh_hi), _mm256_set1_epi8(0x03));
        w.q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
        const int8_t *sc = (const int8_t *)(p + 192);
        w.mul = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
        w.dw = f16(p + 208), w.mw = 0.0f;
    }
    return w;
}

#endif
