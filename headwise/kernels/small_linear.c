/* Small-batch fp32 linear for CPU decoding: y = prologue(x) @ W^T + b + r, M rows of x.
 *
 * A one-token decode step is a chain of matrix-vector products whose speed is how fast
 * the weights stream from memory. Each weight row here is read from memory once for
 * all M rows of x (the M dot products reuse it from L1), four rows at a time with the
 * next four prefetched, split over the OpenMP threads of the calling process (PyTorch's
 * own pool: this library links the libgomp that torch already loaded).
 *
 * The prologue saves the op that would otherwise run before the matmul:
 *   PRO_NONE     x as given, (M, I)
 *   PRO_RMSNORM  x / rms(x) * norm_w, (M, I); rms = sqrt(mean(x^2) + eps), in fp32
 *   PRO_SWIGLU   x is (M, 2I) = [gate | up]; silu(gate) * up, (M, I)
 * and b (O,) and r (M, O) (a residual) are added to the output when not NULL.
 * Layouts: W (O, I), x, r, y row-major and contiguous. Needs AVX2 + FMA.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SWIGLU = 2 };

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *w, const float *x, long I) {
    __m256 a = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= I; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a);
    float t = hsum(a);
    for (; i < I; i++) t += w[i] * x[i];
    return t;
}

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

/* Returns 0, or -1 when the prologue buffer cannot be allocated (nothing written). */
int hw_small_linear_f32(const float *W, const float *x, const float *b, const float *r, float *y,
                        long M, long O, long I, int kind, const float *norm_w, float eps) {
    float *buf = NULL;
    if (kind != PRO_NONE) {
        buf = malloc(sizeof(float) * (size_t)(M * I));
        if (!buf) return -1;
    }
    const float *xs = prologue(kind, x, norm_w, eps, buf, M, I);
    const long nblk = (O + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (long blk = 0; blk < nblk; blk++) {
        const long o = blk * 4, rows = O - o < 4 ? O - o : 4;
        const float *w0 = W + o * I;
        for (long m = 0; m < M; m++) {
            const float *xm = xs + m * I;
            float acc[4];
            if (rows == 4) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                long i = 0;
                for (; i + 8 <= I; i += 8) {
                    if (m == 0 && blk + 1 < nblk) {     /* the next block's rows, on first touch */
                        _mm_prefetch((const char *)(w0 + 4 * I + i), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w0 + 5 * I + i), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w0 + 6 * I + i), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w0 + 7 * I + i), _MM_HINT_T0);
                    }
                    __m256 xv = _mm256_loadu_ps(xm + i);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + I + i), xv, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 2 * I + i), xv, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 3 * I + i), xv, a3);
                }
                acc[0] = hsum(a0); acc[1] = hsum(a1); acc[2] = hsum(a2); acc[3] = hsum(a3);
                for (; i < I; i++)
                    for (int k = 0; k < 4; k++) acc[k] += w0[k * I + i] * xm[i];
            } else {
                for (long k = 0; k < rows; k++) acc[k] = dot(w0 + k * I, xm, I);
            }
            float *ym = y + m * O + o;
            for (long k = 0; k < rows; k++) {
                float v = acc[k];
                if (b) v += b[o + k];
                if (r) v += r[m * O + o + k];
                ym[k] = v;
            }
        }
    }
    free(buf);
    return 0;
}
