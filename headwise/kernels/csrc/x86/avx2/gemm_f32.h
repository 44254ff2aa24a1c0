/* The fp32 small-row linear's tiles in ymm (generic/small_linear.c has the method): the x86/avx2
 * variant's, and the ones the x86/avx512 variant keeps (its 4 x 8 tiles and 16-output panels, whose
 * rows the includer sets, GEMM_F32_PANEL_ROWS: AVX-512's 32 vector registers hold 12 rows x 2
 * accumulators + 2 weights + a broadcast, AVX2's 16 hold 6). */
#ifndef HW_GEMM_F32_H
#define HW_GEMM_F32_H
#include <immintrin.h>
#include <stddef.h>

#include "../../generic/kernels.h"

enum { MAX_PANEL_ROWS = 64 };  /* rows the x 16 tiles take in one call, in row groups (accumulators: 4 KB) */
enum { KC = 128 };  /* inputs per pass: 8 KB of a panel's weights, read from memory once, stay in L1 for every row group */

/* One block of 8 outputs for MC (1..4) rows of x: two accumulators per row (even/odd i). */
static inline void tile_f32_4x8_ymm(const float *w, const float *x, long I, int MC, __m256 out[4]) {
    __m256 a[4][2];
    for (int m = 0; m < 4; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
    long i = 0;
    for (; i + 2 <= I; i += 2) {
        __m256 w0 = _mm256_load_ps(w + i * 8), w1 = _mm256_load_ps(w + (i + 1) * 8);
        for (int m = 0; m < MC; m++) {          /* MC is a constant at each call site: unrolled */
            a[m][0] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + m * I + i), a[m][0]);
            a[m][1] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + m * I + i + 1), a[m][1]);
        }
    }
    if (i < I) {
        __m256 w0 = _mm256_load_ps(w + i * 8);
        for (int m = 0; m < MC; m++) a[m][0] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + m * I + i), a[m][0]);
    }
    for (int m = 0; m < MC; m++) out[m] = _mm256_add_ps(a[m][0], a[m][1]);
}

/* Two adjacent blocks (16 outputs) for MC (1 .. GEMM_F32_PANEL_ROWS) rows of x over inputs [k0, k1): the 2 MC
 * accumulators come from and go back to acc (MC, 16). Per input, 2 weight loads + MC broadcasts
 * feed 2 MC FMAs, so from 5 rows on the FMA units, not the loads, set the pace (tile_f32_4x8_ymm's
 * 4 x 8 tile needs a load per FMA). pf: also ask for the weights PF_AHEAD inputs on (the next
 * chunk's, which the first row group of a chunk reads from memory), one 64-byte line of each
 * block every 2 inputs: SmolLM2's 30 layers at 16 rows, 2 threads, AMD EPYC Zen 4: 38 -> 32 ms
 * (with 12-row panels), 8 rows 33 -> 28; the hardware prefetcher alone left memory idle while the
 * FMAs ran. How far ahead pays depends on the core: hw_pf_ahead, set at load by kernels/__init__.py
 * from the CPU (prefetch_ahead_for), 128 unless measured otherwise (benchmarks/prefetch.py). MC: 1 ..
 * GEMM_F32_PANEL_ROWS. */
static inline void tile_f32_mx16_ymm(const float *w0, const float *w1, const float *x, long I, long k0, long k1, int MC,
                                     float *acc, int pf) {
    const long ahead = hw_pf_ahead;
    __m256 a[GEMM_F32_PANEL_ROWS][2];
    for (int m = 0; m < MC; m++) a[m][0] = _mm256_loadu_ps(acc + m * 16), a[m][1] = _mm256_loadu_ps(acc + m * 16 + 8);
    for (long i = k0; i < k1; i++) {
        if (pf && !(i & 1)) {
            _mm_prefetch((const char *)(w0 + (i + ahead) * 8), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (i + ahead) * 8), _MM_HINT_T0);
        }
        __m256 u = _mm256_load_ps(w0 + i * 8), v = _mm256_load_ps(w1 + i * 8);
        for (int m = 0; m < MC; m++) {          /* MC is a constant at each call site: unrolled */
            __m256 xb = _mm256_broadcast_ss(x + m * I + i);
            a[m][0] = _mm256_fmadd_ps(u, xb, a[m][0]);
            a[m][1] = _mm256_fmadd_ps(v, xb, a[m][1]);
        }
    }
    for (int m = 0; m < MC; m++) _mm256_storeu_ps(acc + m * 16, a[m][0]), _mm256_storeu_ps(acc + m * 16 + 8, a[m][1]);
}

/* The rows of the next row group when `left` rows remain in groups of at most `tile`, split evenly
 * (16 rows in tiles of 12: 8 + 8, not 12 + 4). */
static inline long group_rows(long left, long tile) {
    const long groups = (left + tile - 1) / tile;
    return (left + groups - 1) / groups;
}

/* y[m][o .. o + rows) = acc + b + r for one row m of one 8-output block. */
static inline void store_block(__m256 acc, const float *b, const float *r, float *y, long m, long O, long o,
                               long rows) {
    float t[8];
    _mm256_storeu_ps(t, acc);
    float *ym = y + m * O + o;
    const float *rm = r ? r + m * O + o : NULL;
    for (long k = 0; k < rows; k++) {
        float v = t[k];
        if (b) v += b[o + k];
        if (rm) v += rm[k];
        ym[k] = v;
    }
}

/* Outputs of block blk for all M rows in 4 x 8 tiles: up to 4 rows, each block streams once (memory-bound). */
static inline void out_f32_4x8_ymm(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M,
                                   long O, long I, long blk) {
    const float *w = Wb + blk * I * 8;
    const long ok = blk * 8, rows = O - ok < 8 ? O - ok : 8;
    for (long m0 = 0; m0 < M; m0 += 4) {
        const long mc = M - m0 < 4 ? M - m0 : 4;
        const float *xm = xs + m0 * I;
        __m256 acc[4];
        switch (mc) {
            case 1: tile_f32_4x8_ymm(w, xm, I, 1, acc); break;
            case 2: tile_f32_4x8_ymm(w, xm, I, 2, acc); break;
            case 3: tile_f32_4x8_ymm(w, xm, I, 3, acc); break;
            default: tile_f32_4x8_ymm(w, xm, I, 4, acc); break;
        }
        for (long m = 0; m < mc; m++) store_block(acc[m], b, r, y, m0 + m, O, ok, rows);
    }
}

#endif
