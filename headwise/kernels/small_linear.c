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
 * Needs AVX2 + FMA.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SWIGLU = 2 };

/* The prologue for M rows into buf (M, I); returns the rows the matmul reads. */
static const float *prologue(int kind, const float *x, const float *norm_w, float eps, float *buf,
                             long M, long I) {
    if (kind == PRO_RMSNORM) {
        for (long m = 0; m < M; m++) {
            const float *xm = x + m * I;
            float *bm = buf + m * I;
            double ss = 0.0;
            for (long i = 0; i < I; i++) ss += (double)xm[i] * xm[i];
            float r = 1.0f / sqrtf((float)(ss / (double)I) + eps);
            for (long i = 0; i < I; i++) bm[i] = (xm[i] * r) * norm_w[i];
        }
        return buf;
    }
    if (kind == PRO_SWIGLU) {
        for (long m = 0; m < M; m++) {
            const float *g = x + m * 2 * I, *u = g + I;
            float *bm = buf + m * I;
            for (long i = 0; i < I; i++) bm[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        return buf;
    }
    return x;
}

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

/* Wb: (ceil(O/8), I, 8), 32-byte aligned, rows past O zero. Returns 0, or -1 when the
 * prologue buffer cannot be allocated (nothing written). */
int hw_small_linear_f32(const float *Wb, const float *x, const float *b, const float *r, float *y,
                        long M, long O, long I, int kind, const float *norm_w, float eps) {
    float *buf = NULL;
    if (kind != PRO_NONE) {
        buf = malloc(sizeof(float) * (size_t)(M * I));
        if (!buf) return -1;
    }
    const float *xs = prologue(kind, x, norm_w, eps, buf, M, I);
    const long nblk = (O + 7) / 8;
    #pragma omp parallel for schedule(static)
    for (long blk = 0; blk < nblk; blk++) {
        const float *w = Wb + blk * I * 8;
        const long o = blk * 8, rows = O - o < 8 ? O - o : 8;
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
            for (long m = 0; m < mc; m++) {
                float t[8];
                _mm256_storeu_ps(t, acc[m]);
                float *ym = y + (m0 + m) * O + o;
                const float *rm = r ? r + (m0 + m) * O + o : NULL;
                for (long k = 0; k < rows; k++) {
                    float v = t[k];
                    if (b) v += b[o + k];
                    if (rm) v += rm[k];
                    ym[k] = v;
                }
            }
        }
    }
    free(buf);
    return 0;
}
