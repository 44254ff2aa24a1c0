/* The fp32 small-row linear in AVX2 (generic/small_linear.c has the method): up to 4 rows each block
 * of 8 outputs streams once through a 4 x 8 tile (memory-bound); from 5 rows pairs of blocks go
 * through a 6 x 16 tile (compute-bound), the pair read from cache once per row group. */
#include <immintrin.h>
#include <stdlib.h>

#define GEMM_F32_PANEL_ROWS 6
#include "gemm_f32.h"

/* Outputs of blocks [blk, blk + nb) (nb = 1 or 2) for all M rows. */
static void out_f32_6x16_ymm(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M, long O,
                             long I, long blk, long nb) {
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

void hw_gemm_f32(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M, long O, long I) {
    const long nblk = (O + 7) / 8, npair = (nblk + 1) / 2;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < npair; p++) {
        const long blk = 2 * p;
        out_f32_6x16_ymm(Wb, xs, b, r, y, M, O, I, blk, nblk - blk < 2 ? 1 : 2);
    }
}
