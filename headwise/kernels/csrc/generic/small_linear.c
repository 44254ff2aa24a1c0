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
 * heads of a QKV projection) after the matmul (hw_rope_epilogue).
 * The tiles are per ISA (hw_gemm_f32): x86/avx2/small_linear.c, x86/avx512/small_linear.c.
 */
#include <stdlib.h>

#include "kernels.h"

int hw_pf_ahead = 128;  /* inputs; the tiles' prefetch distance (x86/avx2/gemm_f32.h's panel tile) */

/* Wb: (ceil(O/8), I, 8), 32-byte aligned, rows past O zero. Returns 0, or -1 when the
 * prologue buffer cannot be allocated (nothing written). Up to 4 rows each block streams once
 * through a 4 x 8 tile (memory-bound); from 5 rows pairs of blocks go through a 6 x 16 tile (12 x 16
 * in the avx512 variant; compute-bound), the pair read from cache once per row group; in the AVX-512 build, fours of
 * blocks through a 12 x 32 zmm tile instead (SmolLM2's 30 layers, 2 threads, AMD EPYC
 * Zen 5, vs oneDNN: 16 rows 1.23x -> 1.59x, 32 rows 0.88x -> 1.37x, 64 rows 0.53x -> 1.20x). */
int hw_small_linear_f32(const float *Wb, const float *x, const float *b, const float *r, float *y, long M, long O,
                        long I, int kind, const float *norm_w, float eps, const float *cos, const float *sin,
                        long rot_cols, long head_dim) {
    float *buf = NULL;
    if (kind != PRO_NONE) {
        buf = malloc(sizeof(float) * (size_t)(M * I));
        if (!buf) return -1;
    }
    hw_gemm_f32(Wb, hw_prologue(kind, x, norm_w, eps, buf, M, I), b, r, y, M, O, I);
    free(buf);
    if (cos) hw_rope_epilogue(y, M, O, cos, sin, rot_cols, head_dim);
    return 0;
}
