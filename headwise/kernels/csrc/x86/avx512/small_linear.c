/* The fp32 small-row linear in AVX-512 (generic/small_linear.c has the method): up to 4 rows the
 * avx2 variant's 4 x 8 tiles; from 5 rows fours of blocks through a 12 x 32 zmm tile (SmolLM2's 30
 * layers, 2 threads, AMD EPYC Zen 5, vs oneDNN: 16 rows 1.23x -> 1.59x, 32 rows 0.88x -> 1.37x, 64
 * rows 0.53x -> 1.20x), pairs of blocks at the matrix's edge through 12 x 16 ymm tiles (the avx2
 * variant's panel with AVX-512's 32 registers: 24 accumulators + 2 weights + a broadcast). */
#include <immintrin.h>
#include <stdlib.h>

#define GEMM_F32_PANEL_ROWS 12
#include "../avx2/gemm_f32.h"

/* Outputs of blocks [blk, blk + nb) (nb = 1 or 2) for all M rows. */
static void out_f32_12x16_ymm(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M,
                              long O, long I, long blk, long nb) {
    const long o = blk * 8;
    if (nb == 2 && M > 4 && M <= MAX_PANEL_ROWS) {
        const float *w0 = Wb + blk * I * 8, *w1 = w0 + I * 8;
        const long rows0 = O - o < 8 ? O - o : 8, rows1 = O - o - 8 < 8 ? O - o - 8 : 8;
        float acc[MAX_PANEL_ROWS * 16] = {0};
        for (long k0 = 0; k0 < I; k0 += KC) {
            const long k1 = I - k0 < KC ? I : k0 + KC;
            for (long m0 = 0; m0 < M;) {
                const long mc = group_rows(M - m0, GEMM_F32_PANEL_ROWS);
                const float *xm = xs + m0 * I;
                float *am = acc + m0 * 16;
                switch (mc) {
                    case 1: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 1, am, m0 == 0); break;
                    case 2: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 2, am, m0 == 0); break;
                    case 3: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 3, am, m0 == 0); break;
                    case 4: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 4, am, m0 == 0); break;
                    case 5: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 5, am, m0 == 0); break;
                    case 6: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 6, am, m0 == 0); break;
                    case 7: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 7, am, m0 == 0); break;
                    case 8: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 8, am, m0 == 0); break;
                    case 9: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 9, am, m0 == 0); break;
                    case 10: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 10, am, m0 == 0); break;
                    case 11: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, 11, am, m0 == 0); break;
                    default: tile_f32_mx16_ymm(w0, w1, xm, I, k0, k1, GEMM_F32_PANEL_ROWS, am, m0 == 0); break;
                }
                m0 += mc;
            }
        }
        for (long m = 0; m < M; m++) {
            store_block(_mm256_loadu_ps(acc + m * 16), b, r, y, m, O, o, rows0);
            if (rows1 > 0) store_block(_mm256_loadu_ps(acc + m * 16 + 8), b, r, y, m, O, o + 8, rows1);
        }
        return;
    }
    for (long k = 0; k < nb; k++) out_f32_4x8_ymm(Wb, xs, b, r, y, M, O, I, blk + k);
}

/* From 5 rows, four adjacent blocks (32 outputs) per tile in 16-wide vectors: per input, the four
 * 8-float weight rows joined into two zmm, then per row of x one broadcast feeding two FMAs. Each
 * zmm FMA does the work of two of tile_f32_mx16_ymm's FMAs, and the broadcasts per multiply-add halve
 * again (its 16 outputs per broadcast in ymm: 1 load per 2 FMAs, here 1 per 2 zmm FMAs),
 * so a core with full-width 512-bit FMA units (AMD Zen 5, Xeon Gold/Platinum) is not held up by
 * its load ports. 32 registers: 2 x 12 row accumulators + 2 weights + a broadcast. */
enum { QUAD_ROWS = 12 };
static inline void tile_f32_12x32_zmm(const float *w0, const float *x, long I, long k0, long k1, int MC, float *acc, int pf) {
    const long pfa = hw_pf_ahead;
    const float *w1 = w0 + I * 8, *w2 = w1 + I * 8, *w3 = w2 + I * 8;
    __m512 a[QUAD_ROWS][2];
    for (int m = 0; m < MC; m++) a[m][0] = _mm512_loadu_ps(acc + m * 32), a[m][1] = _mm512_loadu_ps(acc + m * 32 + 16);
    for (long i = k0; i < k1; i++) {
        if (pf && !(i & 1)) {
            const long ahead = (i + pfa) * 8;
            _mm_prefetch((const char *)(w0 + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(w2 + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(w3 + ahead), _MM_HINT_T0);
        }
        const __m512 u = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(w0 + i * 8)), _mm256_load_ps(w1 + i * 8), 1);
        const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(w2 + i * 8)), _mm256_load_ps(w3 + i * 8), 1);
        for (int m = 0; m < MC; m++) {          /* MC is a constant at each call site: unrolled */
            const __m512 xb = _mm512_set1_ps(x[m * I + i]);
            a[m][0] = _mm512_fmadd_ps(u, xb, a[m][0]);
            a[m][1] = _mm512_fmadd_ps(v, xb, a[m][1]);
        }
    }
    for (int m = 0; m < MC; m++) _mm512_storeu_ps(acc + m * 32, a[m][0]), _mm512_storeu_ps(acc + m * 32 + 16, a[m][1]);
}

#define QUAD_CASE(n) \
    case n: tile_f32_12x32_zmm(w, xm, I, k0, k1, n, am, m0 == 0); break;

/* Outputs of blocks [blk, blk + nb) (nb 1..4) for all M rows: four blocks and 5+ rows in
 * 12 x 32 zmm tiles, anything else as out_f32_12x16_ymm's pairs. */
static void out_f32_12x32_zmm(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M,
                              long O, long I, long blk, long nb) {
    if (!(nb == 4 && M > 4 && M <= MAX_PANEL_ROWS)) {
        out_f32_12x16_ymm(Wb, xs, b, r, y, M, O, I, blk, nb < 2 ? nb : 2);
        if (nb > 2) out_f32_12x16_ymm(Wb, xs, b, r, y, M, O, I, blk + 2, nb - 2);
        return;
    }
    const float *w = Wb + blk * I * 8;
    const long o = blk * 8;
    float acc[MAX_PANEL_ROWS * 32] = {0};
    for (long k0 = 0; k0 < I; k0 += KC) {
        const long k1 = I - k0 < KC ? I : k0 + KC;
        for (long m0 = 0; m0 < M;) {
            const long mc = group_rows(M - m0, QUAD_ROWS);
            const float *xm = xs + m0 * I;
            float *am = acc + m0 * 32;
            switch (mc) {
                QUAD_CASE(1) QUAD_CASE(2) QUAD_CASE(3) QUAD_CASE(4) QUAD_CASE(5) QUAD_CASE(6)
                QUAD_CASE(7) QUAD_CASE(8) QUAD_CASE(9) QUAD_CASE(10) QUAD_CASE(11)
                default: tile_f32_12x32_zmm(w, xm, I, k0, k1, QUAD_ROWS, am, m0 == 0); break;
            }
            m0 += mc;
        }
    }
    for (long m = 0; m < M; m++)
        for (long k = 0; k < 4; k++) {
            const long ok = o + 8 * k, rows = O - ok < 8 ? O - ok : 8;
            if (rows > 0) store_block(_mm256_loadu_ps(acc + m * 32 + 8 * k), b, r, y, m, O, ok, rows);
        }
}
void hw_gemm_f32(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M, long O, long I) {
    const long nblk = (O + 7) / 8, nquad = (nblk + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (long q = 0; q < nquad; q++) {
        const long blk = 4 * q;
        out_f32_12x32_zmm(Wb, xs, b, r, y, M, O, I, blk, nblk - blk < 4 ? nblk - blk : 4);
    }
}
