/* Prefill attention's P V tile in ymm (generic/prefill_attention.c has the method): the avx2
 * variant's, and the avx512 variant's for the channels its zmm tiles leave (D % 64). Rows a tile:
 * PA_PV_ROWS, set by the includer (16 registers: 3 x 4 + 4, a V column read as an operand; 32: 6 x 4 + ...). */
#ifndef HW_PREFILL_PV_H
#define HW_PREFILL_PV_H
#include <immintrin.h>

#include "../../generic/kernels.h"

/* os rows [r0, r0 + RB) (RB <= PA_PV_ROWS), channels [d0, d0 + 8 NV): os = os * alpha + P V over the block's nk keys. */
static inline __attribute__((always_inline)) void tile_pv_f32_mx32_ymm(float *os, const float *p, const float *alpha,
                                                                       const float *v, long sv_t, long nk, long D,
                                                                       long d0, int RB, int NV) {
    __m256 a[PA_PV_ROWS][4];
    for (int r = 0; r < RB; r++) {
        const __m256 s = _mm256_broadcast_ss(alpha + r);
        for (int c = 0; c < NV; c++) a[r][c] = _mm256_mul_ps(_mm256_loadu_ps(os + r * D + d0 + 8 * c), s);
    }
    for (long j = 0; j < nk; j++) {
        const float *vj = v + j * sv_t + d0;
        __m256 w[4];
        for (int c = 0; c < NV; c++) w[c] = _mm256_loadu_ps(vj + 8 * c);
        for (int r = 0; r < RB; r++) {
            const __m256 b = _mm256_broadcast_ss(p + r * PK + j);
            for (int c = 0; c < NV; c++) a[r][c] = _mm256_fmadd_ps(b, w[c], a[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NV; c++) _mm256_storeu_ps(os + r * D + d0 + 8 * c, a[r][c]);
}

#define PV_CASES(n)                                                                       \
    switch (nv) {                                                                         \
        case 1: tile_pv_f32_mx32_ymm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 1); break;  \
        case 2: tile_pv_f32_mx32_ymm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 2); break;  \
        case 3: tile_pv_f32_mx32_ymm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 3); break;  \
        default: tile_pv_f32_mx32_ymm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 4); break; \
    }

#endif
