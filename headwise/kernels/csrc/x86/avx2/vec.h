/* What the linear kernels (small_linear.c, quant_linear.c) do around their matmuls: the
 * prologue that replaces the op before it (RMSNorm, SwiGLU) and the RoPE epilogue after it.
 * One copy, so both kernels compute them the same way; and the vector 2^x they and
 * decode_attention.c use. */
#ifndef HW_COMMON_H
#define HW_COMMON_H
#include <immintrin.h>
#include <math.h>

/* 2^x for x <= 126 (decode_attention.c: scores minus their running max; the SwiGLU prologue),
 * Cephes exp2f: x = i + f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial (relative error
 * ~2e-7), 2^i into the exponent bits. x below -126 is clamped (callers zero the lanes that must
 * be exactly 0). */
static inline __m256 exp2_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 i = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, i);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(i), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

#if defined(__AVX512F__)
/* exp2_ps on 16 lanes: the same operations, so each lane gets exp2_ps's bits. */
static inline __m512 exp2_ps_z(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, i);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(i), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}
#endif

enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SWIGLU = 2 };

/* The prologue for M rows into buf (M, I); returns the rows the matmul reads. */
static inline const float *prologue(int kind, const float *x, const float *norm_w, float eps, float *buf,
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
        /* silu(g) u = g / (1 + e^-g) u, 8 at a time with exp2_ps (e^-g = 2^(-g log2 e), clamped to
         * +-126 where 1 + e^-g is 1 or huge either way): glibc's expf, one at a time, took 4.5 ms
         * of a 16-row decode step's 30 layers on one thread (6 ns each, AMD EPYC) */
        const __m256 nlog2e = _mm256_set1_ps(-1.4426950408889634f), one = _mm256_set1_ps(1.0f);
        const __m256 hi = _mm256_set1_ps(126.0f);
        for (long m = 0; m < M; m++) {
            const float *g = x + m * 2 * I, *u = g + I;
            float *bm = buf + m * I;
            long i = 0;
            for (; i + 8 <= I; i += 8) {
                const __m256 gv = _mm256_loadu_ps(g + i);
                const __m256 e = exp2_ps(_mm256_min_ps(_mm256_mul_ps(gv, nlog2e), hi));
                _mm256_storeu_ps(bm + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
            }
            for (; i < I; i++) bm[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        return buf;
    }
    return x;
}

/* RoPE on the first rot_cols outputs of each row, in heads of head_dim channels (half-split
 * layout, HF's rotate_half): out[i] = y[i] c_i - y[i + h] s_i, out[i + h] = y[i + h] c_i + y[i] s_i,
 * h = head_dim / 2, with cos/sin (M, h) the angles of each row's position. It runs after the
 * matmul because a head's two halves come from different blocks; M x rot_cols elements, a few
 * microseconds, in place of a separate rotation op per layer. */
static inline void rope_epilogue(float *y, long M, long O, const float *cos, const float *sin, long rot_cols,
                                 long head_dim) {
    const long h = head_dim / 2;
    for (long m = 0; m < M; m++) {
        const float *c = cos + m * h, *s = sin + m * h;
        for (long o = 0; o + head_dim <= rot_cols; o += head_dim) {
            float *lo = y + m * O + o, *hi = lo + h;
            for (long i = 0; i < h; i++) {
                const float a = lo[i], b = hi[i];
                lo[i] = a * c[i] - b * s[i];
                hi[i] = b * c[i] + a * s[i];
            }
        }
    }
}

#endif
