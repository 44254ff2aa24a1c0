/* What the linear kernels (small_linear.c, quant_linear.c) do around their matmuls: the
 * prologue that replaces the op before it (RMSNorm, SwiGLU) and the RoPE epilogue after it.
 * One copy, so both kernels compute them the same way. */
#ifndef HW_COMMON_H
#define HW_COMMON_H
#include <math.h>

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
        for (long m = 0; m < M; m++) {
            const float *g = x + m * 2 * I, *u = g + I;
            float *bm = buf + m * I;
            for (long i = 0; i < I; i++) bm[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
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
