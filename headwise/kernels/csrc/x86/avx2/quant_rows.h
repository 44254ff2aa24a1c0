/* The quantized linear on row-major GGML weights (generic/quant_linear.c has the method), in ymm: two
 * weight rows at a time against up to four rows of x quantized to q8 blocks, one block's integers
 * at a time. The includer defines dot_u8s8(u, s), 8 int32 sums of 4 adjacent u8 x s8 products
 * (the same in both ISAs: no pair saturates, as |u| <= 128 and |s| <= 127 keep a pair within
 * int16): x86/avx2/quant_rows.c with maddubs + madd, x86/avx512/quant_rows.c with VNNI's dpbusd. */
#ifndef HW_QUANT_ROWS_H
#define HW_QUANT_ROWS_H
#include <immintrin.h>
#include <stdint.h>

#include "../../generic/kernels.h"
#include "quant_unpack.h"
#include "vec.h"

/* qw . qx of one block as 8 int32 partial sums. */
static inline __attribute__((always_inline)) __m256i block_dot(int fmt, const wblock *w, __m256i qx) {
    if (fmt == Q8_0) return dot_u8s8(_mm256_abs_epi8(w->q), _mm256_sign_epi8(qx, w->q));
    if (fmt == Q6_K)  /* int16 pairs, each 16-value half times its scale */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w->q), _mm256_sign_epi8(qx, w->q)), w->mul);
    return dot_u8s8(w->q, qx);  /* unsigned 4-bit weights */
}

/* NR (1, 2) weight rows from w0 (row_bytes apart) against MC (1..4) rows of quantized x:
 * out[r][m] = sum over blocks of dw dx (qw . qx) + mw sx. NR, MC, fmt: constants at each call. */
static inline __attribute__((always_inline)) void tile_rows_4x2_q8_ymm(int fmt, int NR, int MC, const uint8_t *w0,
                                                                       long row_bytes, const int8_t *qx,
                                                                       const float *dx, const float *sx, long I,
                                                                       float out[2][4]) {
    const long nb = I / QK;
    __m256 acc[2][4];
    float msum[2][4];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MC; m++) acc[r][m] = _mm256_setzero_ps(), msum[r][m] = 0.0f;
    for (long b = 0; b < nb; b++) {
        wblock w[2];
        for (int r = 0; r < NR; r++) w[r] = unpack(fmt, w0 + r * row_bytes, b);
        for (int m = 0; m < MC; m++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qx + m * I + b * QK));
            const float d = dx[m * nb + b], s = sx[m * nb + b];
            for (int r = 0; r < NR; r++) {
                const __m256 p = _mm256_cvtepi32_ps(block_dot(fmt, &w[r], q));
                acc[r][m] = _mm256_fmadd_ps(_mm256_set1_ps(w[r].dw * d), p, acc[r][m]);
                if (fmt != Q8_0 && fmt != Q6_K) msum[r][m] += w[r].mw * s;
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MC; m++) out[r][m] = hsum_ps(acc[r][m]) + msum[r][m];
}

#define TILE_MC(F, NR, mc, ...)                              \
    switch (mc) {                                            \
        case 1: tile_rows_4x2_q8_ymm(F, NR, 1, __VA_ARGS__); break;          \
        case 2: tile_rows_4x2_q8_ymm(F, NR, 2, __VA_ARGS__); break;          \
        case 3: tile_rows_4x2_q8_ymm(F, NR, 3, __VA_ARGS__); break;          \
        default: tile_rows_4x2_q8_ymm(F, NR, 4, __VA_ARGS__); break;         \
    }

/* Outputs [o, o + nr) (nr = 1, 2) for all M rows of x, plus bias and residual. */
static inline __attribute__((always_inline)) void out_rows_4x2_q8_ymm(int fmt, const uint8_t *w, long row_bytes,
                                                                      const int8_t *qx, const float *dx,
                                                                      const float *sx, const float *b, const float *r,
                                                                      float *y, long M, long O, long I, long o,
                                                                      long nr) {
    const uint8_t *w0 = w + o * row_bytes;
    const long nb = I / QK;
    for (long m0 = 0; m0 < M; m0 += 4) {
        const long mc = M - m0 < 4 ? M - m0 : 4;
        const int8_t *q = qx + m0 * I;
        const float *d = dx + m0 * nb, *s = sx + m0 * nb;
        float out[2][4];
        if (nr == 2) {
            TILE_MC(fmt, 2, mc, w0, row_bytes, q, d, s, I, out)
        } else {
            TILE_MC(fmt, 1, mc, w0, row_bytes, q, d, s, I, out)
        }
        for (long k = 0; k < nr; k++)
            for (long m = 0; m < mc; m++) {
                float v = out[k][m];
                if (b) v += b[o + k];
                if (r) v += r[(m0 + m) * O + o + k];
                y[(m0 + m) * O + o + k] = v;
            }
    }
}


#define PARALLEL_ROWS(F)                                                                        \
    _Pragma("omp parallel for schedule(static) if (par)") for (long p = 0; p < npair; p++)      \
        out_rows_4x2_q8_ymm(F, w, row_bytes, qx, dx, sx, b, r, y, M, O, I, 2 * p, O - 2 * p < 2 ? 1 : 2);

void hw_quant_rows(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, const float *b,
                   const float *r, float *y, long M, long O, long I, int par) {
    const long row_bytes = I / block_values(fmt) * block_bytes(fmt), npair = (O + 1) / 2;
    switch (fmt) {
        case Q4_0: PARALLEL_ROWS(Q4_0) break;
        case Q4_1: PARALLEL_ROWS(Q4_1) break;
        case Q5_0: PARALLEL_ROWS(Q5_0) break;
        case Q5_1: PARALLEL_ROWS(Q5_1) break;
        case Q8_0: PARALLEL_ROWS(Q8_0) break;
        case Q4_K: PARALLEL_ROWS(Q4_K) break;
        case Q5_K: PARALLEL_ROWS(Q5_K) break;
        default: PARALLEL_ROWS(Q6_K) break;
    }
}

#endif
