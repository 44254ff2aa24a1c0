/* The linear kernels' prologue (RMSNorm, SwiGLU) and RoPE epilogue as calls of their own, for the
 * rows of a prefill, whose matmuls oneDNN runs: the same arithmetic as around small_linear.c's
 * matmul (common.h), rows split over the OpenMP threads. In PyTorch ops, SwiGLU over a 512-row
 * step is a SiLU on a strided view and a multiply, and the half-split RoPE of the q and k heads
 * five ops with temporaries: ~8% of a 512-token fp32 prefill step of SmolLM2 here.
 * Needs AVX2 + FMA (common.h). */
#include "common.h"

enum { ROWS_PER_TASK = 8 };  /* rows a thread takes at a time: a few KB each, even splits of a step */

/* out (M, I) = prologue(x) for kind PRO_RMSNORM (x (M, I)) or PRO_SWIGLU (x (M, 2I)). */
void hw_rows_prologue(int kind, const float *x, const float *norm_w, float eps, float *out, long M, long I) {
    const long in = kind == PRO_SWIGLU ? 2 * I : I;
    #pragma omp parallel for schedule(static) if (M > ROWS_PER_TASK)
    for (long m0 = 0; m0 < M; m0 += ROWS_PER_TASK) {
        const long mc = M - m0 < ROWS_PER_TASK ? M - m0 : ROWS_PER_TASK;
        prologue(kind, x + m0 * in, norm_w, eps, out + m0 * I, mc, I);
    }
}

/* RoPE in place on the first rot_cols of y's O columns, cos/sin (M, head_dim / 2) per row. */
void hw_rope_rows(float *y, long M, long O, const float *cos, const float *sin, long rot_cols, long head_dim) {
    const long h = head_dim / 2;
    #pragma omp parallel for schedule(static) if (M > ROWS_PER_TASK)
    for (long m0 = 0; m0 < M; m0 += ROWS_PER_TASK) {
        const long mc = M - m0 < ROWS_PER_TASK ? M - m0 : ROWS_PER_TASK;
        rope_epilogue(y + m0 * O, mc, O, cos + m0 * h, sin + m0 * h, rot_cols, head_dim);
    }
}
