/* Small-batch fp32 linear for CPU decoding: y = prologue(x) @ W^T + b + r, for M <= a few rows.
 *
 * A one-token decode step is a chain of matrix-vector products whose speed is how fast the
 * weights stream from memory. The weight is read in a blocked layout made once
 * (kernels.block_weight): Wb[blk][i][r] = W[8 blk + r][i], so each block of 8 output rows is
 * one contiguous stream that the hardware prefetcher follows (row-major W needs 8 streams per
 * block and streams ~30% slower here), and one 8-wide load serves 8 outputs for every row of x.
 * Blocks are split over the OpenMP threads of the calling process: this library links the
 * libgomp that PyTorch already loaded, so both share one thread pool.
 *
 * The prologue saves the op that would otherwise run before the matmul:
 *   PRO_NONE     x as given, (M, I)
 *   PRO_RMSNORM  x / sqrt(mean(x^2) + eps) * norm_w, (M, I), in fp32
 *   PRO_SWIGLU   x is (M, 2I) = [gate | up]; silu(gate) * up, (M, I)
 * b (O,) and r (M, O) (a residual) are added when not NULL. x, r, y: row-major, contiguous.
 * With cos/sin (M, head_dim / 2) given, RoPE rotates the first rot_cols outputs (the q and k
 * heads of a QKV projection) after the matmul (rope_epilogue).
 * Needs AVX2 + FMA.
 */
#include <immintrin.h>
#include <stdlib.h>

#include "common.h"  /* prologue, rope_epilogue: shared with quant_linear.c */

enum { MAX_PANEL_ROWS = 64 };  /* rows the x 16 tiles take in one call, in row groups (accumulators: 4 KB) */

/* One block of 8 outputs for MC (1..4) rows of x: two accumulators per row (even/odd i). */
static inline void block_rows(const float *w, const float *x, long I, int MC, __m256 out[4]) {
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

/* Two adjacent blocks (16 outputs) for MC (1..PANEL_MC) rows of x over inputs [k0, k1): the 2 MC
 * accumulators come from and go back to acc (MC, 16). Per input, 2 weight loads + MC broadcasts
 * feed 2 MC FMAs, so from 5 rows on the FMA units, not the loads, set the pace (block_rows'
 * 4 x 8 tile needs a load per FMA). pf: also ask for the weights PF_AHEAD inputs on (the next
 * chunk's, which the first row group of a chunk reads from memory), one 64-byte line of each
 * block every 2 inputs: SmolLM2's 30 layers at 16 rows, 2 threads, AMD EPYC Zen 4: 38 -> 32 ms
 * (with PANEL_MC 12), 8 rows 33 -> 28; the hardware prefetcher alone left memory idle while the
 * FMAs ran. How far ahead pays depends on the core: hw_pf_ahead, set at load by kernels/__init__.py
 * from the CPU (prefetch_ahead_for), 128 unless measured otherwise (benchmarks/prefetch.py). */
int hw_pf_ahead = 128;
/* Rows a tile takes: AVX-512's 32 vector registers (the avx512 build: the same 256-bit code, the
 * compiler may use ymm16-31) hold 24 accumulators + 2 weights + a broadcast, AVX2's 16 hold 12. */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define PANEL_MC 12
#else
#define PANEL_MC 6
#endif
static inline void panel_rows(const float *w0, const float *w1, const float *x, long I, long k0, long k1,
                              int MC, float *acc, int pf) {
    const long ahead = hw_pf_ahead;
    __m256 a[PANEL_MC][2];
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

enum { KC = 128 };  /* inputs per pass: 8 KB of a panel's weights, read from memory once, stay in L1 for every row group */

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

/* Outputs of blocks [blk, blk + nb) (nb = 1 or 2) for all M rows. */
static void blocks_out(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M,
                       long O, long I, long blk, long nb) {
    const long o = blk * 8;
    if (nb == 2 && M > 4 && M <= MAX_PANEL_ROWS) {
        const float *w0 = Wb + blk * I * 8, *w1 = w0 + I * 8;
        const long rows0 = O - o < 8 ? O - o : 8, rows1 = O - o - 8 < 8 ? O - o - 8 : 8;
        float acc[MAX_PANEL_ROWS * 16] = {0};
        for (long k0 = 0; k0 < I; k0 += KC) {
            const long k1 = I - k0 < KC ? I : k0 + KC;
            for (long m0 = 0; m0 < M;) {
                const long mc = group_rows(M - m0, PANEL_MC);
                const float *xm = xs + m0 * I;
                float *am = acc + m0 * 16;
                switch (mc) {
                    case 1: panel_rows(w0, w1, xm, I, k0, k1, 1, am, m0 == 0); break;
                    case 2: panel_rows(w0, w1, xm, I, k0, k1, 2, am, m0 == 0); break;
                    case 3: panel_rows(w0, w1, xm, I, k0, k1, 3, am, m0 == 0); break;
                    case 4: panel_rows(w0, w1, xm, I, k0, k1, 4, am, m0 == 0); break;
                    case 5: panel_rows(w0, w1, xm, I, k0, k1, 5, am, m0 == 0); break;
#if PANEL_MC > 6
                    case 6: panel_rows(w0, w1, xm, I, k0, k1, 6, am, m0 == 0); break;
                    case 7: panel_rows(w0, w1, xm, I, k0, k1, 7, am, m0 == 0); break;
                    case 8: panel_rows(w0, w1, xm, I, k0, k1, 8, am, m0 == 0); break;
                    case 9: panel_rows(w0, w1, xm, I, k0, k1, 9, am, m0 == 0); break;
                    case 10: panel_rows(w0, w1, xm, I, k0, k1, 10, am, m0 == 0); break;
                    case 11: panel_rows(w0, w1, xm, I, k0, k1, 11, am, m0 == 0); break;
#endif
                    default: panel_rows(w0, w1, xm, I, k0, k1, PANEL_MC, am, m0 == 0); break;
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
    for (long k = 0; k < nb; k++) {
        const float *w = Wb + (blk + k) * I * 8;
        const long ok = o + 8 * k, rows = O - ok < 8 ? O - ok : 8;
        for (long m0 = 0; m0 < M; m0 += 4) {
            const long mc = M - m0 < 4 ? M - m0 : 4;
            const float *xm = xs + m0 * I;
            __m256 acc[4];
            switch (mc) {
                case 1: block_rows(w, xm, I, 1, acc); break;
                case 2: block_rows(w, xm, I, 2, acc); break;
                case 3: block_rows(w, xm, I, 3, acc); break;
                default: block_rows(w, xm, I, 4, acc); break;
            }
            for (long m = 0; m < mc; m++) store_block(acc[m], b, r, y, m0 + m, O, ok, rows);
        }
    }
}

#if defined(__AVX512F__)
/* From 5 rows, four adjacent blocks (32 outputs) per tile in 16-wide vectors: per input, the four
 * 8-float weight rows joined into two zmm, then per row of x one broadcast feeding two FMAs. Each
 * zmm FMA does the work of two of panel_rows' ymm FMAs, and the broadcasts per multiply-add halve
 * again (panel_rows' 16 outputs per broadcast in ymm: 1 load per 2 FMAs, here 1 per 2 zmm FMAs),
 * so a core with full-width 512-bit FMA units (AMD Zen 5, Xeon Gold/Platinum) is not held up by
 * its load ports. 32 registers: 2 x 12 row accumulators + 2 weights + a broadcast. */
enum { QUAD_MC = 12 };
static inline void quad_rows(const float *w0, const float *x, long I, long k0, long k1, int MC, float *acc, int pf) {
    const long pfa = hw_pf_ahead;
    const float *w1 = w0 + I * 8, *w2 = w1 + I * 8, *w3 = w2 + I * 8;
    __m512 a[QUAD_MC][2];
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
    case n: quad_rows(w, xm, I, k0, k1, n, am, m0 == 0); break;

/* Outputs of blocks [blk, blk + nb) (nb 1..4) for all M rows: four blocks and 5+ rows in
 * quad_rows' tiles, anything else as blocks_out's pairs. */
static void quads_out(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M, long O,
                      long I, long blk, long nb) {
    if (!(nb == 4 && M > 4 && M <= MAX_PANEL_ROWS)) {
        blocks_out(Wb, xs, b, r, y, M, O, I, blk, nb < 2 ? nb : 2);
        if (nb > 2) blocks_out(Wb, xs, b, r, y, M, O, I, blk + 2, nb - 2);
        return;
    }
    const float *w = Wb + blk * I * 8;
    const long o = blk * 8;
    float acc[MAX_PANEL_ROWS * 32] = {0};
    for (long k0 = 0; k0 < I; k0 += KC) {
        const long k1 = I - k0 < KC ? I : k0 + KC;
        for (long m0 = 0; m0 < M;) {
            const long mc = group_rows(M - m0, QUAD_MC);
            const float *xm = xs + m0 * I;
            float *am = acc + m0 * 32;
            switch (mc) {
                QUAD_CASE(1) QUAD_CASE(2) QUAD_CASE(3) QUAD_CASE(4) QUAD_CASE(5) QUAD_CASE(6)
                QUAD_CASE(7) QUAD_CASE(8) QUAD_CASE(9) QUAD_CASE(10) QUAD_CASE(11)
                default: quad_rows(w, xm, I, k0, k1, QUAD_MC, am, m0 == 0); break;
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
#endif

/* Wb: (ceil(O/8), I, 8), 32-byte aligned, rows past O zero. Returns 0, or -1 when the
 * prologue buffer cannot be allocated (nothing written). Up to 4 rows each block streams once
 * through a 4 x 8 tile (memory-bound); from 5 rows pairs of blocks go through a PANEL_MC x 16 tile
 * (compute-bound), the pair read from cache once per row group; in the AVX-512 build, fours of
 * blocks through quad_rows' 12 x 32 zmm tile instead (SmolLM2's 30 layers, 2 threads, AMD EPYC
 * Zen 5, vs oneDNN: 16 rows 1.23x -> 1.59x, 32 rows 0.88x -> 1.37x, 64 rows 0.53x -> 1.20x). */
int hw_small_linear_f32(const float *Wb, const float *x, const float *b, const float *r, float *y,
                        long M, long O, long I, int kind, const float *norm_w, float eps,
                        const float *cos, const float *sin, long rot_cols, long head_dim) {
    float *buf = NULL;
    if (kind != PRO_NONE) {
        buf = malloc(sizeof(float) * (size_t)(M * I));
        if (!buf) return -1;
    }
    const float *xs = prologue(kind, x, norm_w, eps, buf, M, I);
    const long nblk = (O + 7) / 8;
#if defined(__AVX512F__)
    const long nquad = (nblk + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (long q = 0; q < nquad; q++) {
        const long blk = 4 * q;
        quads_out(Wb, xs, b, r, y, M, O, I, blk, nblk - blk < 4 ? nblk - blk : 4);
    }
#else
    const long npair = (nblk + 1) / 2;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < npair; p++) {
        const long blk = 2 * p;
        blocks_out(Wb, xs, b, r, y, M, O, I, blk, nblk - blk < 2 ? 1 : 2);
    }
#endif
    free(buf);
    if (cos) rope_epilogue(y, M, O, cos, sin, rot_cols, head_dim);
    return 0;
}
