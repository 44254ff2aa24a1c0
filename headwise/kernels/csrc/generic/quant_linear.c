/* Linear layers computed from GGML-quantized weights as stored in a GGUF file (issue 14):
 * y = prologue(x) @ W^T + b + r (+ RoPE), for a few rows of fp32 x, with no fp32 copy of W.
 *
 * A weight (O, I) is O rows of I / block_values blocks, row-major (ggml-common.h's block_q4_0,
 * block_q4_1, block_q8_0, block_q4_K, block_q6_K; GGML type ids below). A decode step reads each
 * weight byte once, so bytes per weight set the speed: Q4_1 is 5 bits a weight vs fp32's 32.
 *
 * The method is llama.cpp's ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0: each row of x is quantized once
 * per call to int8 in blocks of 32 (dx = amax / 127, qx = round(x / dx), sx = dx * sum(qx)), so a
 * weight block times an x block is an integer dot product (u8 x s8 pairs: _mm256_maddubs_epi16,
 * or AVX-512 VNNI's dpbusd) scaled once by dw * dx. Formats with an offset (w = dw q + mw) add
 * mw * sx per block. The K-quants' 256-value super-blocks are 8 sub-blocks of 32, each with its
 * own scale (and min), so every format meets x in the same 32-blocks.
 *   Q4_0: w = dw (q - 8), q 0..15   -> dw * dx * qw.qx with mw = -8 dw
 *   Q4_1: w = dw q + mw             -> unsigned q against qx, + mw sx
 *   Q5_0, Q5_1: Q4_0's and Q4_1's with a fifth bit per value (q 0..31, Q5_0's mw = -16 dw)
 *   Q8_0: w = dw q, q -128..127     -> the sign trick: |qw| . sign(qx, qw)
 *   Q4_K: sub-block j: w = d sc_j q - dmin mn_j      (Q4_1's path)
 *   Q5_K: Q4_K's with a fifth bit per value (q 0..31)
 *   Q6_K: 16-value groups k: w = d sc_k (q - 32)     (sign trick, scales multiply the int16 pairs)
 * Output rows are split over the OpenMP threads (torch's libgomp: one pool), two weight rows at
 * a time against up to four rows of x, so one weight load serves every row of x.
 * Rows packed in groups of 8 (fmt | X8, quant_formats.h) go through quant_group.c, ~2x faster.
 * Per ISA: x86/avx2/quant_rows.h (the rows), quant_group.c (the groups); quantize.c, dequantize.c,
 * repack.c the conversions.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "quant_formats.h"

/* A thread reads its groups as one stream; asking for the bytes ~2 KiB ahead (one software
 * prefetch per 64-byte line) beat the hardware prefetcher alone when the weights come from DRAM:
 * 100 Q4_1 3072 x 576 matrices (110 MB) at 1 row of x, 1 thread, AMD EPYC: 11.4 -> 8.6 ms mean
 * (1280 and 2560 bytes ahead alike; 640: less). Past the end of the weight it is a no-op. */
int hw_qpf_ahead = 2048;  /* bytes; set at load per core by kernels/__init__.py (quant_prefetch_ahead_for:
                           * 8192 on AMD Zen 5, benchmarks/prefetch.py --quant) */
/* From how many rows of x the avx512 variant reads two packed groups at once in zmm tiles (x86/avx512/quant_group.c;
 * unused in the avx2 variant): set at load per core by kernels/__init__.py
 * (kernels.cpu.zmm_min_rows_for). 4 where tuned (Zen 4 / 5); 1 on Intel, where a 7B-shaped model's
 * batch-1 decode from DRAM went 4.42 -> 4.84 tok/s (its weights stream faster through two groups'
 * 16-lane tiles than one's 8) and SmolLM2's lost nothing. */
int hw_zmm_min_rows = 4;
/* Weights a decode step reads once, prefetched with NTA (kept out of L2 / L3, where they would evict
 * the activations, KV and the next layer's lines for nothing) or T0: set at load per core by
 * kernels/__init__.py (kernels.cpu.quant_prefetch_nta_for; 1 on AMD Zen 4, where a 7B-shaped Q4_K
 * layer from DRAM at 1 row of x ran ~1.03x faster, benchmarks/dram_stream.py). */
int hw_qpf_nta = 0;

int hw_quant_linear(int fmt, const uint8_t *w, const float *x, const float *b, const float *r, float *y, long M, long O,
                    long I, int kind, const float *norm_w, float eps, const float *cos, const float *sin, long rot_cols,
                    long head_dim) {
    const int packed = (fmt & X8) != 0;
    fmt &= ~X8;
    if (!block_bytes(fmt) || (packed && !packable(fmt))) return ERR_FORMAT;
    if (M < 1 || O < 1 || I < 1 || I % block_values(fmt)) return ERR_SHAPE;
    const long nb = I / QK;
    float *buf = kind != PRO_NONE ? malloc(sizeof(float) * (size_t)(M * I)) : NULL;
    int8_t *qx = malloc((size_t)(M * I));
    /* dx, sx (M nb each) and xs: -32 times each 16 values' sum of qx (M 2 nb), for the packed Q6_K tiles */
    float *dx = malloc(sizeof(float) * (size_t)(4 * M * nb));
    if ((kind != PRO_NONE && !buf) || !qx || !dx) {
        free(buf), free(qx), free(dx);
        return ERR_ALLOC;
    }
    float *sx = dx + M * nb;
    int32_t *xs = (int32_t *)(dx + 2 * M * nb);
    hw_quantize_x_q8(hw_prologue(kind, x, norm_w, eps, buf, M, I), M, I, qx, dx, sx);
    if (packed && fmt == Q6_K)
        for (long k = 0; k < 2 * M * nb; k++) {
            int32_t t = 0;
            for (int i = 0; i < 16; i++) t += qx[16 * k + i];
            xs[k] = -32 * t;
        }
    /* One thread below ~1M multiply-adds (~35 us of work, a batch-1 576 x 1536), where waking
     * the pool can cost more than it saves: on a busy machine (2 cores, 2 other jobs) a batch-1
     * 576 x 576 took 147 us on 2 threads vs 29 us on one (medians). Not tuned on an idle one. */
    const int par = M * O * I >= (1L << 18);
    if (packed)
        hw_quant_groups(fmt, w, qx, dx, sx, xs, b, r, y, M, O, I, par);
    else
        hw_quant_rows(fmt, w, qx, dx, sx, b, r, y, M, O, I, par);
    free(buf), free(qx), free(dx);
    if (cos) hw_rope_epilogue(y, M, O, cos, sin, rot_cols, head_dim);
    return 0;
}
