/* The quantized linear's weights packed in groups of 8 rows (fmt | X8, generic/quant_formats.h: every
 * format it computes) in AVX2: each group's blocks interleaved so that one 32-byte chunk holds the
 * same block of 8 rows, met by every row of quantized x before the next (out_x8_4x8_q8_ymm), 4 rows
 * of x a pass, products summed by maddubs in int16 pairs. generic/quant_linear.c quantizes x and
 * calls hw_quant_groups; the arithmetic is the rows path's (same integers, same float epilogue). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../generic/kernels.h"
#include "quant_unpack.h"
#include "quant_x8.h"

/* Rows of x per pass over a packed group: the avx512 variant's 32 vector registers hold 8 int sums +
 * 8 accumulators (each group's nibbles unpacked half as often: SmolLM2's 30 Q4_1 layers + the Q8_0
 * head at 16 rows, 2 threads, AMD EPYC Zen 4: 16.8 -> 15.7 ms, 8 rows 10.0 -> 9.0, the same bits);
 * AVX2's 16 hold 4 + 4. */
#define GMC 4

/* 8 packed rows against MC (1..GMC) rows of quantized x: out[m] lane r = row r's output. The
 * weight chunks are loaded one at a time and met by every row of x before the next, so the
 * registers hold 2 chunks, MC int16 sums and MC accumulators (no spills at MC = GMC). Q5_0 / Q5_1:
 * Q4_0's / Q4_1's with each value's fifth bit from the group's first chunk (values 0..31: in
 * AVX2's int16 sums 8 pair sums could pass 2^15, so there each chunk's two go to int32 at once). */
static inline __attribute__((always_inline)) void tile_q4q5_4x8_q8_ymm(int fmt, int MC, const uint8_t *grp, long nb,
                                                                       const int8_t *qx, const float *dx,
                                                                       const float *sx, long I, __m256 out[GMC]) {
    const int five = fmt == Q5_0 || fmt == Q5_1;
    const long gb = 8 * block_bytes(fmt), h = 8 * hdr_bytes(fmt) + (five ? 32 : 0);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = grp + b * gb;
        const int8_t *xb = qx + b * QK;
        for (long o = 0; o < gb; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        __m256i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm256_setzero_si256();
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + h - 32)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + h + 32 * c));
            __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            if (five) lo = _mm256_or_si256(lo, fifth_bits(qh, c, 0)), hi = _mm256_or_si256(hi, fifth_bits(qh, c, 1));
            for (int m = 0; m < MC; m++) {
                int32_t a, z;
                memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + 16 + 4 * c, 4);
                const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                                      _mm256_maddubs_epi16(hi, _mm256_set1_epi32(z)));
                sum[m] = five ? _mm256_add_epi32(sum[m], _mm256_madd_epi16(pair, _mm256_set1_epi16(1)))
                              : _mm256_add_epi16(sum[m], pair);
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 mw = fmt == Q4_1 || fmt == Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))
                                                     : _mm256_mul_ps(dw, _mm256_set1_ps(fmt == Q5_0 ? -16.0f : -8.0f));
        for (int m = 0; m < MC; m++) {
            const __m256 f = _mm256_cvtepi32_ps(five ? sum[m] : _mm256_madd_epi16(sum[m], _mm256_set1_epi16(1)));
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)), f, acc[m]);
            acc[m] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(sx + m * nb + b), acc[m]);
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Q8_0's groups: 8 chunks of 4 signed values a row; the sign trick per chunk, whose pairs (up to
 * 2 x 128 x 127) need an int32 sum each. */
static inline __attribute__((always_inline)) void tile_q8_0_4x8_q8_ymm(int MC, const uint8_t *grp, long nb,
                                                                       const int8_t *qx, const float *dx, long I,
                                                                       __m256 out[GMC]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = grp + b * 8 * 34;
        for (long o = 0; o < 8 * 34; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        __m256i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c)), a = _mm256_abs_epi8(v);
            for (int m = 0; m < MC; m++) {
                int32_t x4;
                memcpy(&x4, qx + m * I + b * QK + 4 * c, 4);
                const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x4), v);
                sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), ones));
            }
        }
        for (int m = 0; m < MC; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)),
                                     _mm256_cvtepi32_ps(sum[m]), acc[m]);
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* tile(MC, ...) for MC = mc (1 .. GMC), each MC a constant the compiler unrolls for. */
#define TILE_MC_WIDE(tile, ...)
#define TILE_MC(tile, mc, ...)                               \
    switch (mc) {                                            \
        case 1: tile(1, __VA_ARGS__); break;                 \
        case 2: tile(2, __VA_ARGS__); break;                 \
        case 3: tile(3, __VA_ARGS__); break;                 \
        TILE_MC_WIDE(tile, __VA_ARGS__)                      \
        default: tile(GMC, __VA_ARGS__); break;              \
    }
/* tile_q4q5_4x8_q8_ymm's fmt comes first: one constant format per tile function */
#define TILE_Q4_0(MC, ...) tile_q4q5_4x8_q8_ymm(Q4_0, MC, __VA_ARGS__)
#define TILE_Q4_1(MC, ...) tile_q4q5_4x8_q8_ymm(Q4_1, MC, __VA_ARGS__)
#define TILE_Q5_0(MC, ...) tile_q4q5_4x8_q8_ymm(Q5_0, MC, __VA_ARGS__)
#define TILE_Q5_1(MC, ...) tile_q4q5_4x8_q8_ymm(Q5_1, MC, __VA_ARGS__)
#define TILE_Q4_K(MC, ...) tile_q4q5_k_4x8_q8_ymm(0, MC, __VA_ARGS__)
#define TILE_Q5_K(MC, ...) tile_q4q5_k_4x8_q8_ymm(1, MC, __VA_ARGS__)

/* Q4_K's groups: per super-block the 8 rows' d and dmin, their 12 bytes of 6-bit scales and mins
 * as 3 chunks (dword lane r = row r's bytes 4c .. 4c + 3), then 32 chunks of quants: chunk 8 k + c
 * holds each row's bytes 32 k + 4 c .. + 3, whose low nibbles are values 4 c .. of sub-block 2 k
 * and high nibbles those of sub-block 2 k + 1. Sub-block j's scale and min for the 8 rows are
 * ggml's get_scale_min_k4 on the lanes at once; w = (d sc_j) q - dmin mn_j, the rows path's.
 * Q5_K (five = 1): the same, with 8 chunks of qh between the scales and the quants: chunk c holds
 * each row's qh bytes 4 c .. 4 c + 3, whose bit j is the fifth bit of value 4 c .. of sub-block j. */
static inline __attribute__((always_inline)) void tile_q4q5_k_4x8_q8_ymm(int five, int MC, const uint8_t *grp, long nsb,
                                                                         const int8_t *qx, const float *dx,
                                                                         const float *sx, long I, __m256 out[GMC]) {
    const long nb = I / QK, bb = five ? 176 : 144;
    const __m256i mask = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(0x0F);
    const __m256i bit = _mm256_set1_epi8(0x01);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p = grp + s * 8 * bb;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)(p + 32)),
                      s1 = _mm256_loadu_si256((const __m256i *)(p + 64)),
                      s2 = _mm256_loadu_si256((const __m256i *)(p + 96));
        const uint8_t *q = p + (five ? 384 : 128), *qh = p + 128;  /* Q5_K: 8 chunks of fifth bits first */
        for (int k = 0; k < 4; k++) {
            __m256 dw[2], mw[2];
            for (int h = 0; h < 2; h++) {  /* sub-block j = 2 k + h */
                const int j = 2 * k + h;
                __m256i sc, mn;
                if (j < 4) {
                    sc = _mm256_and_si256(lane_byte(s0, j), m6), mn = _mm256_and_si256(lane_byte(s1, j), m6);
                } else {
                    const __m256i lo = lane_byte(s2, j - 4);
                    sc = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi32(_mm256_srli_epi32(lane_byte(s0, j - 4), 6), 4));
                    mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4), _mm256_slli_epi32(_mm256_srli_epi32(lane_byte(s1, j - 4), 6), 4));
                }
                dw[h] = rounded8(_mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
                mw[h] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)));
            }
            __m256i sum[2][GMC];
            for (int m = 0; m < MC; m++) sum[0][m] = sum[1][m] = _mm256_setzero_si256();
            __m256i sum32[2][GMC];
            for (int m = 0; m < MC; m++) sum32[0][m] = sum32[1][m] = _mm256_setzero_si256();
            const int8_t *xb = qx + (s * 8 + 2 * k) * QK;
            for (int c = 0; c < 8; c++) {
                /* a line an iteration, not the block's 18 or 22 at its start (the avx512 tiles' finding;
                 * measured with this variant on a Zen 4) */
                if (64 * (8 * k + c) < 8 * bb) _mm_prefetch((const char *)(p + ahead + 64 * (8 * k + c)), _MM_HINT_T0);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + (8 * k + c) * 32));
                __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                if (five) {  /* values 4 c .. of sub-blocks 2 k, 2 k + 1: bits 2 k, 2 k + 1 of qh bytes 4 c .. */
                    const __m256i h = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qh + c * 32)), 2 * k);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, bit), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), bit), 4));
                }
                for (int m = 0; m < MC; m++) {
                    int32_t a, z;
                    memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + QK + 4 * c, 4);
                    /* Q4_K: 8 pair sums of at most 2 x 15 x 127 each stay within int16; Q5_K's
                     * (2 x 31 x 127) do for 4 chunks: the first 4 go to int32 before the next 4 add */
                    if (five && c == 4) {
                        sum[0][m] = _mm256_madd_epi16(sum[0][m], _mm256_set1_epi16(1));
                        sum[1][m] = _mm256_madd_epi16(sum[1][m], _mm256_set1_epi16(1));
                        sum32[0][m] = sum[0][m], sum32[1][m] = sum[1][m];
                        sum[0][m] = sum[1][m] = _mm256_setzero_si256();
                    }
                    sum[0][m] = _mm256_add_epi16(sum[0][m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
                    sum[1][m] = _mm256_add_epi16(sum[1][m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(z)));
                }
            }
            for (int h = 0; h < 2; h++) {
                const long b = s * 8 + 2 * k + h;
                for (int m = 0; m < MC; m++) {
                    const __m256 f = _mm256_cvtepi32_ps(
                        _mm256_add_epi32(sum32[h][m], _mm256_madd_epi16(sum[h][m], _mm256_set1_epi16(1))));
                    acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw[h], _mm256_broadcast_ss(dx + m * nb + b)), f, acc[m]);
                    acc[m] = _mm256_fmadd_ps(mw[h], _mm256_broadcast_ss(sx + m * nb + b), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Q6_K's groups: per super-block the 8 rows' d, then the block's other bytes as chunks (8 rows x 4
 * bytes): 32 of ql, 16 of qh, 4 of the 16 int8 scales. Sub-block j's values 4 c .. 4 c + 3 are ql
 * chunk 16 (j / 4) + 8 (j % 2) + c shifted by 4 ((j % 4) / 2) and qh chunk 32 + 8 (j / 4) + c
 * shifted by 2 (j % 4) (the rows path's unpack), minus 32. Signed weights: the sign trick, each
 * 16-value half's sum times its scale in integers (AVX2: 4 pair sums <= 4 x 2 x 32 x 127 < 2^15). */
static inline __attribute__((always_inline)) void tile_q6_k_4x8_q8_ymm(int MC, const uint8_t *grp, long nsb,
                                                                       const int8_t *qx, const float *dx, long I,
                                                                       __m256 out[GMC]) {
    const long nb = I / QK;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), k32 = _mm256_set1_epi8(32);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p = grp + s * 8 * 210, *ch = p + 16;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        for (int j = 0; j < 8; j++) {
            const int cq = 16 * (j / 4) + 8 * (j % 2), chh = 32 + 8 * (j / 4), sl = 4 * ((j % 4) / 2), sh = 2 * (j % 4);
            const __m256i scs = _mm256_loadu_si256((const __m256i *)(ch + 32 * (48 + j / 2)));
            const int k0 = 2 * (j % 2);  /* the two scales' bytes in each lane, sign-extended */
            const __m256i sc0 = _mm256_srai_epi32(_mm256_slli_epi32(scs, 24 - 8 * k0), 24),
                          sc1 = _mm256_srai_epi32(_mm256_slli_epi32(scs, 16 - 8 * k0), 24);
            const int8_t *xb = qx + (s * 8 + j) * QK;
            __m256i sum[2][GMC];
            for (int m = 0; m < MC; m++) sum[0][m] = sum[1][m] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                if (c < 4 && 64 * (4 * j + c) < 8 * 210)  /* the block's 27 lines over its first 7 sub-blocks */
                    _mm_prefetch((const char *)(p + ahead + 64 * (4 * j + c)), _MM_HINT_T0);
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(ch + 32 * (cq + c)));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(ch + 32 * (chh + c)));
                const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, sl), m4),
                                                  _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, sh), m2), 4));
                const __m256i w = _mm256_sub_epi8(q, k32), aw = _mm256_abs_epi8(w);
                for (int m = 0; m < MC; m++) {
                    int32_t a;
                    memcpy(&a, xb + m * I + 4 * c, 4);
                    const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
                    sum[c / 4][m] = _mm256_add_epi16(sum[c / 4][m], _mm256_maddubs_epi16(aw, sx));
                }
            }
            for (int m = 0; m < MC; m++) {
                const __m256i s0 = _mm256_madd_epi16(sum[0][m], _mm256_set1_epi16(1)),
                              s1 = _mm256_madd_epi16(sum[1][m], _mm256_set1_epi16(1));
                const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1));
                acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(dx + m * nb + s * 8 + j)),
                                         _mm256_cvtepi32_ps(t), acc[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Outputs [8 g, 8 g + 8) (those below O) of packed group g for all M rows, plus bias and residual. */
static void out_x8_4x8_q8_ymm(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                              const float *b, const float *r, float *y, long M, long O, long I, long g) {
    const long nb = I / QK, o = 8 * g, n = O - o < 8 ? O - o : 8;
    const uint8_t *grp = w + g * (I / block_values(fmt)) * 8 * block_bytes(fmt);
    for (long m0 = 0; m0 < M; m0 += GMC) {
        const long mc = M - m0 < GMC ? M - m0 : GMC;
        __m256 out[GMC];
        const int8_t *q = qx + m0 * I;
        const float *d = dx + m0 * nb, *s = sx + m0 * nb;
        switch (fmt) {
            case Q8_0: TILE_MC(tile_q8_0_4x8_q8_ymm, mc, grp, nb, q, d, I, out) break;
            case Q4_1: TILE_MC(TILE_Q4_1, mc, grp, nb, q, d, s, I, out) break;
            case Q5_0: TILE_MC(TILE_Q5_0, mc, grp, nb, q, d, s, I, out) break;
            case Q5_1: TILE_MC(TILE_Q5_1, mc, grp, nb, q, d, s, I, out) break;
            case Q4_K: TILE_MC(TILE_Q4_K, mc, grp, I / QK_K, q, d, s, I, out) break;
            case Q5_K: TILE_MC(TILE_Q5_K, mc, grp, I / QK_K, q, d, s, I, out) break;
            case Q6_K: TILE_MC(tile_q6_k_4x8_q8_ymm, mc, grp, I / QK_K, q, d, I, out) break;
            default: TILE_MC(TILE_Q4_0, mc, grp, nb, q, d, s, I, out) break;
        }
        for (long m = 0; m < mc; m++) {
            float t[8];
            _mm256_storeu_ps(t, out[m]);
            store_row(t, n, b, r, y, m0 + m, O, o);
        }
    }
}
void hw_quant_groups(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, const int32_t *xs,
                     const float *b, const float *r, float *y, long M, long O, long I, int par) {
    (void)xs;  /* the avx512 variant's Q6_K tiles' sums; maddubs' int16 pairs keep the sign trick here */
    const long ng = (O + 7) / 8;
    #pragma omp parallel for schedule(static) if (par)
    for (long g = 0; g < ng; g++) out_x8_4x8_q8_ymm(fmt, w, qx, dx, sx, b, r, y, M, O, I, g);
}
