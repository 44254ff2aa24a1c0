/* GGML's block formats as quant_linear.c (the linear) and quant_convert.c (dequantize, quantize,
 * the packed rows) read them: sizes, the f16 fields, one 32-value block unpacked to bytes, and
 * the packed layout's header. Layouts: ggml-common.h's block_q4_0, block_q4_1, block_q5_0,
 * block_q5_1, block_q8_0, block_q4_K, block_q5_K, block_q6_K; a weight (O, I) is O rows of I / block_values blocks, row-major. */
#ifndef HW_QUANT_BLOCKS_H
#define HW_QUANT_BLOCKS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  /* GGML type ids */
enum { QK = 32, QK_K = 256 };
enum { ERR_ALLOC = -1, ERR_FORMAT = -2, ERR_SHAPE = -3 };
enum { X8 = 0x100 };  /* fmt | X8: Q4_0 / Q4_1 / Q8_0 rows packed in groups of 8 (hw_repack8) */

/* Packed rows (quant_group.c): every group's outputs for M rows of x quantized as quant_linear.c does
 * (qx int8, dx scales, sx sums per 32-block), plus bias b and residual r where not NULL; over the
 * OpenMP threads when par. */
void hw_quant_groups(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, const float *b,
                     const float *r, float *y, long M, long O, long I, int par);

/* Bytes per block and values per block (block_bytes: 0 for a format these kernels do not know). */
static inline long block_bytes(int fmt) {
    switch (fmt) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}
static inline long block_values(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K ? QK_K : QK; }

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* A value the compiler may not fuse into an FMA with what follows: the reference quantizers
 * and decoders round the product before the add, and we match them bit for bit. */
static inline float rounded(float v) {
    __asm__("" : "+x"(v));
    return v;
}
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

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a Q4_K block's 12 bytes. */
static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
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

/* ---- Q4_0 / Q4_1 / Q8_0 rows packed in groups of 8 (fmt | X8) ----
 * The layout (llama.cpp's q4_0_8x8 repacking, ours in detail): O rows in groups of 8, the last
 * padded with zero rows; per group and block b, the 8 rows' d (f16), Q4_1's 8 m's, then chunks:
 * chunk c is each row's quant bytes 4c .. 4c + 3, 8 rows x 4 bytes (Q4: 4 chunks, values 4c ..
 * 4c + 3 in the low nibbles, 16 + 4c .. in the high ones; Q8_0: 8 chunks of values 4c .. 4c + 3).
 * The same bytes per weight as the file's. One 32-byte load holds 4 values of 8 rows, so a
 * maddubs against 4 bytes of x (broadcast) gives the 8 rows' partial sums in lanes; a Q4 block's
 * 8 products add in int16 (|sum| <= 8 x 2 x 15 x 127 < 2^15) before one madd, and the 8 rows'
 * dw and mw are one vector each. AMD EPYC, 1 thread: ~2.3x the row-by-row kernel at 1 row of x,
 * ~1.8x from 2 rows. */

/* the f16 fields before a block's quants (a Q5 block's 4 bytes of fifth bits are its first chunk) */
static inline long hdr_bytes(int fmt) { return fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K ? 4 : 2; }
/* where in a block its f16 fields are: first, except Q6_K's d, its last 2 bytes (the packed group
 * puts them first all the same; the chunks are the block's other bytes in order) */
static inline long hdr_at(int fmt) { return fmt == Q6_K ? 208 : 0; }
static inline int packable(int fmt) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == Q8_0 || fmt == Q4_K || fmt == Q5_K ||
           fmt == Q6_K;
}

int hw_quant_linear(int fmt, const uint8_t *w, const float *x, const float *b, const float *r, float *y, long M,
                    long O, long I, int kind, const float *norm_w, float eps, const float *cos, const float *sin,
                    long rot_cols, long head_dim);
int hw_dequantize(int fmt, const uint8_t *w, float *out, long O, long I);
int hw_quantize(int fmt, const float *w, uint8_t *out, long O, long I);
int hw_repack8(int fmt, const uint8_t *src, uint8_t *dst, long O, long I, int pack);
#endif
