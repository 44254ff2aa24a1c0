/* What the linear kernels do around their matmuls, one copy for all of them: the prologue that
 * replaces the op before it (RMSNorm, SwiGLU, GeGLU) and the RoPE epilogue after it; and both as calls
 * of their own (rows_prologue, rope_rows) for the rows of a prefill, whose matmuls oneDNN runs,
 * rows split over the OpenMP threads. In PyTorch ops, SwiGLU over a 512-row step is a SiLU on a
 * strided view and a multiply, and the half-split RoPE of the q and k heads five ops with
 * temporaries: ~8% of a 512-token fp32 prefill step of SmolLM2 here. */
#include <math.h>

#include "kernels.h"

enum { ROWS_PER_TASK = 8 };  /* rows a thread takes at a time: a few KB each, even splits of a step */

/* RMSNorm in fp32, the sum of squares in fp64 (torch's F.rms_norm agrees to an ulp). */
static void rmsnorm_rows(const float *x, const float *norm_w, float eps, float *buf, long M, long I) {
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * I;
        float *bm = buf + m * I;
        double ss = 0.0;
        for (long i = 0; i < I; i++) ss += (double)xm[i] * xm[i];
        float r = 1.0f / sqrtf((float)(ss / (double)I) + eps);
        for (long i = 0; i < I; i++) bm[i] = (xm[i] * r) * norm_w[i];
    }
}

const float *hw_prologue(int kind, const float *x, const float *norm_w, float eps, float *buf, long M, long I) {
    if (kind == PRO_RMSNORM) {
        rmsnorm_rows(x, norm_w, eps, buf, M, I);
        return buf;
    }
    if (kind == PRO_SWIGLU) {
        hw_swiglu_rows(x, buf, M, I);
        return buf;
    }
    if (kind == PRO_GEGLU) {
        hw_geglu_rows(x, buf, M, I);
        return buf;
    }
    return x;
}

/* RoPE on the first rot_cols outputs of each row, in heads of head_dim channels (half-split
 * layout, HF's rotate_half): out[i] = y[i] c_i - y[i + h] s_i, out[i + h] = y[i + h] c_i + y[i] s_i,
 * h = head_dim / 2, with cos/sin (M, h) the angles of each row's position. It runs after the
 * matmul because a head's two halves come from different blocks; M x rot_cols elements, a few
 * microseconds, in place of a separate rotation op per layer. */
void hw_rope_epilogue(float *y, long M, long O, const float *cos, const float *sin, long rot_cols, long head_dim) {
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

/* out (M, I) = prologue(x) for kind PRO_RMSNORM (x (M, I)) or PRO_SWIGLU / PRO_GEGLU (x (M, 2I)). */
void hw_rows_prologue(int kind, const float *x, const float *norm_w, float eps, float *out, long M, long I) {
    const long in = kind == PRO_SWIGLU || kind == PRO_GEGLU ? 2 * I : I;
    #pragma omp parallel for schedule(static) if (M > ROWS_PER_TASK)
    for (long m0 = 0; m0 < M; m0 += ROWS_PER_TASK) {
        const long mc = M - m0 < ROWS_PER_TASK ? M - m0 : ROWS_PER_TASK;
        hw_prologue(kind, x + m0 * in, norm_w, eps, out + m0 * I, mc, I);
    }
}

/* RoPE in place on the first rot_cols of y's O columns, cos/sin (M, head_dim / 2) per row. */
void hw_rope_rows(float *y, long M, long O, const float *cos, const float *sin, long rot_cols, long head_dim) {
    const long h = head_dim / 2;
    #pragma omp parallel for schedule(static) if (M > ROWS_PER_TASK)
    for (long m0 = 0; m0 < M; m0 += ROWS_PER_TASK) {
        const long mc = M - m0 < ROWS_PER_TASK ? M - m0 : ROWS_PER_TASK;
        hw_rope_epilogue(y + m0 * O, mc, O, cos + m0 * h, sin + m0 * h, rot_cols, head_dim);
    }
}

/* Qwen3's and Gemma 3's QK-norm, then RoPE: in each row of y (M, O) = [q heads | k heads | ...], RMSNorm
 * over each of the H q heads' D channels (weights qn) and the Hkv k heads' (kn; either NULL: not
 * normed), in place, then the rotation of each of those H + Hkv heads' first rd channels (half-split
 * within them: rd = D, or Phi-3's partial rotary rd < D), cos/sin (M, rd / 2) (cos NULL: none).
 * The norm comes between the projection and the rotation, so it cannot be the matmul's epilogue. */
void hw_qk_norm_rope_rows(float *y, long M, long O, long H, long Hkv, long D, long rd, const float *qn,
                          const float *kn, float eps, const float *cos, const float *sin) {
    const long h = rd / 2;
    #pragma omp parallel for schedule(static) if (M > ROWS_PER_TASK)
    for (long m = 0; m < M; m++)
        for (long j = 0; j < H + Hkv; j++) {
            const float *w = j < H ? qn : kn;
            float *lo = y + m * O + j * D, *hi = lo + h;
            if (w) rmsnorm_rows(lo, w, eps, lo, 1, D); /* element by element: in place is safe */
            if (!cos) continue;
            const float *c = cos + m * h, *s = sin + m * h;
            for (long i = 0; i < h; i++) {
                const float a = lo[i], b = hi[i];
                lo[i] = a * c[i] - b * s[i];
                hi[i] = b * c[i] + a * s[i];
            }
        }
}
