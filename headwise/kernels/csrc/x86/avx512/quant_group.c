/* The quantized linear's packed groups of 8 rows in the avx512 variant: from hw_zmm_min_rows rows of x
 * two groups at once in zmm (out_x8_8x16_q8_zmm), below that one group in ymm with VNNI
 * (quant_tiles_ymm.h). generic/quant_linear.c quantizes x and calls hw_quant_groups. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../generic/kernels.h"
#include "quant_tiles_ymm.h"
#include "vec.h"

/* tile(MC, ...) for MC = mc (1 .. GMC), each MC a constant the compiler unrolls for. */
#define TILE_MC_WIDE(tile, ...)                              \
        case 4: tile(4, __VA_ARGS__); break;                 \
        case 5: tile(5, __VA_ARGS__); break;                 \
        case 6: tile(6, __VA_ARGS__); break;                 \
        case 7: tile(7, __VA_ARGS__); break;
#define TILE_MC(tile, mc, ...)                               \
    switch (mc) {                                            \
        case 1: tile(1, __VA_ARGS__); break;                 \
        case 2: tile(2, __VA_ARGS__); break;                 \
        case 3: tile(3, __VA_ARGS__); break;                 \
        TILE_MC_WIDE(tile, __VA_ARGS__)                      \
        default: tile(GMC, __VA_ARGS__); break;              \
    }
/* tile_q4q5_8x8_q8_ymm's fmt comes first: one constant format per tile function */
#define TILE_Q4_0(MC, ...) tile_q4q5_8x8_q8_ymm(Q4_0, MC, __VA_ARGS__)
#define TILE_Q4_1(MC, ...) tile_q4q5_8x8_q8_ymm(Q4_1, MC, __VA_ARGS__)
#define TILE_Q5_0(MC, ...) tile_q4q5_8x8_q8_ymm(Q5_0, MC, __VA_ARGS__)
#define TILE_Q5_1(MC, ...) tile_q4q5_8x8_q8_ymm(Q5_1, MC, __VA_ARGS__)
#define TILE_Q4_K(MC, ...) tile_q4q5_k_8x8_q8_ymm(0, MC, __VA_ARGS__)
#define TILE_Q5_K(MC, ...) tile_q4q5_k_8x8_q8_ymm(1, MC, __VA_ARGS__)

/* Outputs [8 g, 8 g + 8) (those below O) of packed group g for all M rows, plus bias and residual. */
static void out_x8_8x8_q8_ymm(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                              const int32_t *xs, const float *b, const float *r, float *y, long M, long O, long I, long g) {
    const long nb = I / QK, o = 8 * g, n = O - o < 8 ? O - o : 8;
    const uint8_t *grp = w + g * (I / block_values(fmt)) * 8 * block_bytes(fmt);
    for (long m0 = 0; m0 < M; m0 += GMC) {
        const long mc = M - m0 < GMC ? M - m0 : GMC;
        __m256 out[GMC];
        const int8_t *q = qx + m0 * I;
        const float *d = dx + m0 * nb, *s = sx + m0 * nb;
        switch (fmt) {
            case Q8_0: TILE_MC(tile_q8_0_8x8_q8_ymm, mc, grp, nb, q, d, I, out) break;
            case Q4_1: TILE_MC(TILE_Q4_1, mc, grp, nb, q, d, s, I, out) break;
            case Q5_0: TILE_MC(TILE_Q5_0, mc, grp, nb, q, d, s, I, out) break;
            case Q5_1: TILE_MC(TILE_Q5_1, mc, grp, nb, q, d, s, I, out) break;
            case Q4_K: TILE_MC(TILE_Q4_K, mc, grp, I / QK_K, q, d, s, I, out) break;
            case Q5_K: TILE_MC(TILE_Q5_K, mc, grp, I / QK_K, q, d, s, I, out) break;
            case Q6_K: TILE_MC(tile_q6_k_8x8_q8_ymm, mc, grp, I / QK_K, q, d, xs + m0 * (I / 16), I, out) break;
            default: TILE_MC(TILE_Q4_0, mc, grp, nb, q, d, s, I, out) break;
        }
        for (long m = 0; m < mc; m++) {
            float t[8];
            _mm256_storeu_ps(t, out[m]);
            store_row(t, n, b, r, y, m0 + m, O, o);
        }
    }
}
/* Two packed groups (16 outputs) at once in 16-wide vectors, from hw_zmm_min_rows rows of x: per chunk the two
 * groups' 32 bytes joined into one zmm, so each broadcast of x feeds one dpbusd for 16 rows where
 * tile_q4q5_8x8_q8_ymm's ymm gives 8. Where the core has full-width 512-bit units (AMD Zen 5, Xeon
 * Gold/Platinum) that is twice the work per instruction; a batch-1 step stays on the ymm tiles
 * (memory-bound there) except where hw_zmm_min_rows is 1 (Intel: these tiles stream faster). Same integers, the same float epilogue per block, per output lane. The
 * K-quants too (tile_q4q5_k_8x16_q8_zmm, tile_q6_k_8x16_q8_zmm): on Zen 5, a Llama-7B-shaped matrix at 128-512 rows
 * of x, Q4_K 277-410 -> 559-738 GFLOP/s, Q6_K 177-205 -> 281-325. */
static inline __attribute__((always_inline)) void tile_q4q5q8_8x16_q8_zmm(int fmt, int MC, const uint8_t *g0,
                                                                          const uint8_t *g1, long nb, const int8_t *qx,
                                                                          const float *dx, const float *sx, long I,
                                                                          __m512 out[GMC]) {
    const int five = fmt == Q5_0 || fmt == Q5_1;
    const long gb = 8 * block_bytes(fmt), h = 8 * hdr_bytes(fmt) + (five ? 32 : 0);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p0 = g0 + b * gb, *p1 = g1 + b * gb;
        const int8_t *xb = qx + b * QK;
        for (long o = 0; o < gb; o += 64) {
            _mm_prefetch((const char *)(p0 + ahead + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + ahead + o), _MM_HINT_T0);
        }
        __m512i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm512_setzero_si512();
        if (fmt == Q8_0) {  /* |w| against x with w's sign (AVX-512 has no vpsignb: negate where w < 0) */
            for (int c = 0; c < 8; c++) {
                const __m512i v = join_si(p0 + 16 + 32 * c, p1 + 16 + 32 * c), a = _mm512_abs_epi8(v);
                const __mmask64 neg = _mm512_movepi8_mask(v);
                for (int m = 0; m < MC; m++) {
                    int32_t x4;
                    memcpy(&x4, xb + m * I + 4 * c, 4);
                    const __m512i xv = _mm512_set1_epi32(x4);
                    sum[m] = _mm512_dpbusd_epi32(sum[m], a, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
                }
            }
        } else {
            const __m256i qh0 = five ? _mm256_loadu_si256((const __m256i *)(p0 + h - 32)) : _mm256_setzero_si256(),
                          qh1 = five ? _mm256_loadu_si256((const __m256i *)(p1 + h - 32)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m512i v = join_si(p0 + h + 32 * c, p1 + h + 32 * c);
                __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                if (five) {  /* the fifth bits of each group (tile_q4q5_8x8_q8_ymm's), joined */
                    lo = _mm512_or_si512(lo, _mm512_inserti64x4(_mm512_castsi256_si512(fifth_bits(qh0, c, 0)),
                                                                fifth_bits(qh1, c, 0), 1));
                    hi = _mm512_or_si512(hi, _mm512_inserti64x4(_mm512_castsi256_si512(fifth_bits(qh0, c, 1)),
                                                                fifth_bits(qh1, c, 1), 1));
                }
                for (int m = 0; m < MC; m++) {
                    int32_t a, z;
                    memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + 16 + 4 * c, 4);
                    sum[m] = _mm512_dpbusd_epi32(sum[m], lo, _mm512_set1_epi32(a));
                    sum[m] = _mm512_dpbusd_epi32(sum[m], hi, _mm512_set1_epi32(z));
                }
            }
        }
        const __m512 dw = join_ph(p0, p1);
        if (fmt == Q8_0) {
            for (int m = 0; m < MC; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), _mm512_cvtepi32_ps(sum[m]),
                                         acc[m]);
        } else {
            const __m512 mw = fmt == Q4_1 || fmt == Q5_1 ? join_ph(p0 + 16, p1 + 16)
                                                         : _mm512_mul_ps(dw, _mm512_set1_ps(fmt == Q5_0 ? -16.0f : -8.0f));
            for (int m = 0; m < MC; m++) {
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), _mm512_cvtepi32_ps(sum[m]),
                                         acc[m]);
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

static inline __m512i lane_byte16(__m512i v, int k) { /* byte k of each dword lane, as int32 */
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xFF));
}

/* tile_q4q5_k_8x8_q8_ymm on two groups at once (16 rows in zmm lanes): each lane the ymm tile's integers and
 * float epilogue, in its order. */
static inline __attribute__((always_inline)) void tile_q4q5_k_8x16_q8_zmm(int five, int MC, const uint8_t *g0,
                                                                          const uint8_t *g1, long nsb, const int8_t *qx,
                                                                          const float *dx, const float *sx, long I,
                                                                          __m512 out[GMC]) {
    const long nb = I / QK, bb = five ? 176 : 144;
    const __m512i mask = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(0x0F);
    const __m512i bit = _mm512_set1_epi8(0x01);
    __m512 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p0 = g0 + s * 8 * bb, *p1 = g1 + s * 8 * bb;
        const __m512 d = join_ph(p0, p1), dmin = join_ph(p0 + 16, p1 + 16);
        const __m512i s0 = join_si(p0 + 32, p1 + 32), s1 = join_si(p0 + 64, p1 + 64), s2 = join_si(p0 + 96, p1 + 96);
        const long qo = five ? 384 : 128;
        for (int k = 0; k < 4; k++) {
            __m512 dw[2], mw[2];
            for (int h = 0; h < 2; h++) {  /* sub-block j = 2 k + h */
                const int j = 2 * k + h;
                __m512i sc, mn;
                if (j < 4) {
                    sc = _mm512_and_si512(lane_byte16(s0, j), m6), mn = _mm512_and_si512(lane_byte16(s1, j), m6);
                } else {
                    const __m512i lo = lane_byte16(s2, j - 4);
                    sc = _mm512_or_si512(_mm512_and_si512(lo, m4),
                                         _mm512_slli_epi32(_mm512_srli_epi32(lane_byte16(s0, j - 4), 6), 4));
                    mn = _mm512_or_si512(_mm512_srli_epi32(lo, 4),
                                         _mm512_slli_epi32(_mm512_srli_epi32(lane_byte16(s1, j - 4), 6), 4));
                }
                dw[h] = rounded16(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
                mw[h] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
            }
            __m512i sum[2][GMC];
            for (int m = 0; m < MC; m++) sum[0][m] = sum[1][m] = _mm512_setzero_si512();
            const int8_t *xb = qx + (s * 8 + 2 * k) * QK;
            const __m128i sh = _mm_cvtsi32_si128(2 * k);
            for (int c = 0; c < 8; c++) {
                /* a line of each group an iteration, as the ymm tiles: the 36-44 prefetches at the block's start
                 * stalled it. 7B-shaped file's linears, Zen 4, 2 threads: 4 rows 1.49x, 8 rows 1.21x, 32 rows 1.04x;
                 * 1 row with the zmm tiles forced (Intel's batch-1 path, hw_zmm_min_rows 1) 1.45x; not measured
                 * on an Intel */
                if (64 * (8 * k + c) < 8 * bb) {
                    _mm_prefetch((const char *)(p0 + ahead + 64 * (8 * k + c)), _MM_HINT_T0);
                    _mm_prefetch((const char *)(p1 + ahead + 64 * (8 * k + c)), _MM_HINT_T0);
                }
                const __m512i v = join_si(p0 + qo + (8 * k + c) * 32, p1 + qo + (8 * k + c) * 32);
                __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                if (five) {  /* values 4 c .. of sub-blocks 2 k, 2 k + 1: bits 2 k, 2 k + 1 of qh bytes 4 c .. */
                    const __m512i h = _mm512_srl_epi16(join_si(p0 + 128 + c * 32, p1 + 128 + c * 32), sh);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(h, bit), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 1), bit), 4));
                }
                for (int m = 0; m < MC; m++) {
                    int32_t a, z;
                    memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + QK + 4 * c, 4);
                    sum[0][m] = _mm512_dpbusd_epi32(sum[0][m], lo, _mm512_set1_epi32(a));
                    sum[1][m] = _mm512_dpbusd_epi32(sum[1][m], hi, _mm512_set1_epi32(z));
                }
            }
            for (int h = 0; h < 2; h++) {
                const long b = s * 8 + 2 * k + h;
                for (int m = 0; m < MC; m++) {
                    const __m512 f = _mm512_cvtepi32_ps(sum[h][m]);
                    acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw[h], _mm512_set1_ps(dx[m * nb + b])), f, acc[m]);
                    acc[m] = _mm512_fmadd_ps(mw[h], _mm512_set1_ps(sx[m * nb + b]), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* tile_q6_k_8x8_q8_ymm on two groups at once, as tile_q4q5_k_8x16_q8_zmm is tile_q4q5_k_8x8_q8_ymm's (unsigned
 * q from -32 sum(qx): no abs, sign mask and masked negate per chunk). */
static inline __attribute__((always_inline)) void tile_q6_k_8x16_q8_zmm(int MC, const uint8_t *g0, const uint8_t *g1,
                                                                        long nsb, const int8_t *qx, const float *dx,
                                                                        const int32_t *xs, long I, __m512 out[GMC]) {
    const long nb = I / QK, n16 = I / 16;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    __m512 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p0 = g0 + s * 8 * 210, *p1 = g1 + s * 8 * 210, *c0 = p0 + 16, *c1 = p1 + 16;
        const __m512 d = join_ph(p0, p1);
        for (int j = 0; j < 8; j++) {
            const int cq = 16 * (j / 4) + 8 * (j % 2), chh = 32 + 8 * (j / 4);
            const __m128i sl = _mm_cvtsi32_si128(4 * ((j % 4) / 2)), sh = _mm_cvtsi32_si128(2 * (j % 4));
            const __m512i scs = join_si(c0 + 32 * (48 + j / 2), c1 + 32 * (48 + j / 2));
            const int k0 = 2 * (j % 2);  /* the two scales' bytes in each lane, sign-extended */
            const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(scs, 24 - 8 * k0), 24),
                          sc1 = _mm512_srai_epi32(_mm512_slli_epi32(scs, 16 - 8 * k0), 24);
            const int8_t *xb = qx + (s * 8 + j) * QK;
            __m512i sum[2][GMC];
            for (int m = 0; m < MC; m++)
                for (int h = 0; h < 2; h++) sum[h][m] = _mm512_set1_epi32(xs[m * n16 + 2 * (s * 8 + j) + h]);
            for (int c = 0; c < 8; c++) {
                if (64 * (8 * j + c) < 8 * 210) {
                    _mm_prefetch((const char *)(p0 + ahead + 64 * (8 * j + c)), _MM_HINT_T0);
                    _mm_prefetch((const char *)(p1 + ahead + 64 * (8 * j + c)), _MM_HINT_T0);
                }
                const __m512i ql = join_si(c0 + 32 * (cq + c), c1 + 32 * (cq + c));
                const __m512i qh = join_si(c0 + 32 * (chh + c), c1 + 32 * (chh + c));
                const __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi16(ql, sl), m4),
                                                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh, sh), m2), 4));
                for (int m = 0; m < MC; m++) {
                    int32_t a;
                    memcpy(&a, xb + m * I + 4 * c, 4);
                    sum[c / 4][m] = _mm512_dpbusd_epi32(sum[c / 4][m], q, _mm512_set1_epi32(a));
                }
            }
            for (int m = 0; m < MC; m++) {
                const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(sum[0][m], sc0), _mm512_mullo_epi32(sum[1][m], sc1));
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[m * nb + s * 8 + j])),
                                         _mm512_cvtepi32_ps(t), acc[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

#define TILE2_Q4_K(MC, ...) tile_q4q5_k_8x16_q8_zmm(0, MC, __VA_ARGS__)
#define TILE2_Q5_K(MC, ...) tile_q4q5_k_8x16_q8_zmm(1, MC, __VA_ARGS__)
#define TILE2_Q6_K(MC, g0, g1, nsb, qx, dx, xs, I, out) tile_q6_k_8x16_q8_zmm(MC, g0, g1, nsb, qx, dx, xs, I, out)
#define GROUP2_MC_K(tile, mc, ...)                      \
    switch (mc) {                                       \
        case 1: tile(1, __VA_ARGS__); break;            \
        case 2: tile(2, __VA_ARGS__); break;            \
        case 3: tile(3, __VA_ARGS__); break;            \
        case 4: tile(4, __VA_ARGS__); break;            \
        case 5: tile(5, __VA_ARGS__); break;            \
        case 6: tile(6, __VA_ARGS__); break;            \
        case 7: tile(7, __VA_ARGS__); break;            \
        default: tile(GMC, __VA_ARGS__); break;         \
    }

#define GROUP2_MC(F, mc, ...)                                \
    switch (mc) {                                            \
        case 1: tile_q4q5q8_8x16_q8_zmm(F, 1, __VA_ARGS__); break;       \
        case 2: tile_q4q5q8_8x16_q8_zmm(F, 2, __VA_ARGS__); break;       \
        case 3: tile_q4q5q8_8x16_q8_zmm(F, 3, __VA_ARGS__); break;       \
        case 4: tile_q4q5q8_8x16_q8_zmm(F, 4, __VA_ARGS__); break;       \
        case 5: tile_q4q5q8_8x16_q8_zmm(F, 5, __VA_ARGS__); break;       \
        case 6: tile_q4q5q8_8x16_q8_zmm(F, 6, __VA_ARGS__); break;       \
        case 7: tile_q4q5q8_8x16_q8_zmm(F, 7, __VA_ARGS__); break;       \
        default: tile_q4q5q8_8x16_q8_zmm(F, GMC, __VA_ARGS__); break;    \
    }

/* Outputs [8 g, 8 g + 16) (those below O) of packed groups g and g + 1 for all M rows, plus bias and residual. */
static void out_x8_8x16_q8_zmm(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                               const int32_t *xs, const float *b, const float *r, float *y, long M, long O, long I, long g) {
    const long nb = I / QK, o = 8 * g, n = O - o < 16 ? O - o : 16, nblk = I / block_values(fmt);
    const uint8_t *g0 = w + g * nblk * 8 * block_bytes(fmt), *g1 = g0 + nblk * 8 * block_bytes(fmt);
    for (long m0 = 0; m0 < M; m0 += GMC) {
        const long mc = M - m0 < GMC ? M - m0 : GMC;
        __m512 out[GMC];
        if (fmt == Q4_K) {
            GROUP2_MC_K(TILE2_Q4_K, mc, g0, g1, nblk, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q5_K) {
            GROUP2_MC_K(TILE2_Q5_K, mc, g0, g1, nblk, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q6_K) {
            GROUP2_MC_K(TILE2_Q6_K, mc, g0, g1, nblk, qx + m0 * I, dx + m0 * nb, xs + m0 * (I / 16), I, out)
        } else if (fmt == Q8_0) {
            GROUP2_MC(Q8_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q4_1) {
            GROUP2_MC(Q4_1, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q5_0) {
            GROUP2_MC(Q5_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q5_1) {
            GROUP2_MC(Q5_1, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else {
            GROUP2_MC(Q4_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        }
        for (long m = 0; m < mc; m++) {
            float t[16];
            _mm512_storeu_ps(t, out[m]);
            store_row(t, n, b, r, y, m0 + m, O, o);
        }
    }
}

void hw_quant_groups(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, const int32_t *xs,
                     const float *b, const float *r, float *y, long M, long O, long I, int par) {
    const long ng = (O + 7) / 8;
    if (M >= hw_zmm_min_rows) {
        #pragma omp parallel for schedule(static) if (par)
        for (long q = 0; q < (ng + 1) / 2; q++) {
            if (2 * q + 1 < ng) out_x8_8x16_q8_zmm(fmt, w, qx, dx, sx, xs, b, r, y, M, O, I, 2 * q);
            else out_x8_8x8_q8_ymm(fmt, w, qx, dx, sx, xs, b, r, y, M, O, I, 2 * q);
        }
        return;
    }
    #pragma omp parallel for schedule(static) if (par)
    for (long g = 0; g < ng; g++) out_x8_8x8_q8_ymm(fmt, w, qx, dx, sx, xs, b, r, y, M, O, I, g);
}
