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
 * Rows packed in groups of 8 (fmt | X8, quant_blocks.h) go through quant_group.c, ~2x faster.
 *
 * quant_convert.c has dequantize, quantize and the packing; the Python entry points of all of
 * them are at the end of this file.
 */
#ifdef HW_MODULE
#include "pyargs.h" /* Python.h before any system header, as CPython asks */
#endif
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "quant_blocks.h"

/* ---- x: fp32 rows -> int8 blocks of 32 ---- */

/* Row-major x (M, I) -> q (M, I) int8, d and s (M, I / 32): d = amax / 127, q = round-to-even(x / d)
 * (x times 1 / d in fp32, as llama.cpp's quantize_row_q8_0 does), s = d * sum(q). */
static void quantize_x(const float *x, long M, long I, int8_t *q, float *d, float *s) {
    const long nb = I / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    #pragma omp parallel for schedule(static) if (M * I >= (1L << 16))
    for (long mb = 0; mb < M * nb; mb++) {
        const float *xb = x + mb * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float dd = _mm_cvtss_f32(h) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        __m256i i[4];
        for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
        __m256i t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_hadd_epi32(t4, t4);
        t4 = _mm_hadd_epi32(t4, t4);
        _mm256_storeu_si256((__m256i *)(q + mb * QK), pack32(i));
        d[mb] = dd;
        s[mb] = dd * (float)_mm_cvtsi128_si32(t4);
    }
}
/* 8 int32 sums of 4 adjacent u8 x s8 products (the same in both ISAs: no pair saturates, as
 * |u| <= 128 and |s| <= 127 keep a pair within int16). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* qw . qx of one block as 8 int32 partial sums. */
static inline __attribute__((always_inline)) __m256i block_dot(int fmt, const wblock *w, __m256i qx) {
    if (fmt == Q8_0) return dot_u8s8(_mm256_abs_epi8(w->q), _mm256_sign_epi8(qx, w->q));
    if (fmt == Q6_K)  /* int16 pairs, each 16-value half times its scale */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w->q), _mm256_sign_epi8(qx, w->q)), w->mul);
    return dot_u8s8(w->q, qx);  /* unsigned 4-bit weights */
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* NR (1, 2) weight rows from w0 (row_bytes apart) against MC (1..4) rows of quantized x:
 * out[r][m] = sum over blocks of dw dx (qw . qx) + mw sx. NR, MC, fmt: constants at each call. */
static inline __attribute__((always_inline)) void tile(int fmt, int NR, int MC, const uint8_t *w0, long row_bytes,
                                                       const int8_t *qx, const float *dx, const float *sx, long I,
                                                       float out[2][4]) {
    const long nb = I / QK;
    __m256 acc[2][4];
    float msum[2][4];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MC; m++) acc[r][m] = _mm256_setzero_ps(), msum[r][m] = 0.0f;
    for (long b = 0; b < nb; b++) {
        wblock w[2];
        for (int r = 0; r < NR; r++) w[r] = unpack(fmt, w0 + r * row_bytes, b);
        for (int m = 0; m < MC; m++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qx + m * I + b * QK));
            const float d = dx[m * nb + b], s = sx[m * nb + b];
            for (int r = 0; r < NR; r++) {
                const __m256 p = _mm256_cvtepi32_ps(block_dot(fmt, &w[r], q));
                acc[r][m] = _mm256_fmadd_ps(_mm256_set1_ps(w[r].dw * d), p, acc[r][m]);
                if (fmt != Q8_0 && fmt != Q6_K) msum[r][m] += w[r].mw * s;
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MC; m++) out[r][m] = hsum8(acc[r][m]) + msum[r][m];
}

#define TILE_MC(F, NR, mc, ...)                              \
    switch (mc) {                                            \
        case 1: tile(F, NR, 1, __VA_ARGS__); break;          \
        case 2: tile(F, NR, 2, __VA_ARGS__); break;          \
        case 3: tile(F, NR, 3, __VA_ARGS__); break;          \
        default: tile(F, NR, 4, __VA_ARGS__); break;         \
    }

/* Outputs [o, o + nr) (nr = 1, 2) for all M rows of x, plus bias and residual. */
static inline __attribute__((always_inline)) void rows_out(int fmt, const uint8_t *w, long row_bytes,
                                                           const int8_t *qx, const float *dx, const float *sx,
                                                           const float *b, const float *r, float *y, long M,
                                                           long O, long I, long o, long nr) {
    const uint8_t *w0 = w + o * row_bytes;
    const long nb = I / QK;
    for (long m0 = 0; m0 < M; m0 += 4) {
        const long mc = M - m0 < 4 ? M - m0 : 4;
        const int8_t *q = qx + m0 * I;
        const float *d = dx + m0 * nb, *s = sx + m0 * nb;
        float out[2][4];
        if (nr == 2) {
            TILE_MC(fmt, 2, mc, w0, row_bytes, q, d, s, I, out)
        } else {
            TILE_MC(fmt, 1, mc, w0, row_bytes, q, d, s, I, out)
        }
        for (long k = 0; k < nr; k++)
            for (long m = 0; m < mc; m++) {
                float v = out[k][m];
                if (b) v += b[o + k];
                if (r) v += r[(m0 + m) * O + o + k];
                y[(m0 + m) * O + o + k] = v;
            }
    }
}


#define PARALLEL_ROWS(F)                                                                        \
    _Pragma("omp parallel for schedule(static) if (par)") for (long p = 0; p < npair; p++)      \
        rows_out(F, w, row_bytes, qx, dx, sx, b, r, y, M, O, I, 2 * p, O - 2 * p < 2 ? 1 : 2);

int hw_quant_linear(int fmt, const uint8_t *w, const float *x, const float *b, const float *r, float *y, long M,
                    long O, long I, int kind, const float *norm_w, float eps, const float *cos, const float *sin,
                    long rot_cols, long head_dim) {
    const int packed = (fmt & X8) != 0;
    fmt &= ~X8;
    if (!block_bytes(fmt) || (packed && !packable(fmt))) return ERR_FORMAT;
    if (M < 1 || O < 1 || I < 1 || I % block_values(fmt)) return ERR_SHAPE;
    const long nb = I / QK, row_bytes = I / block_values(fmt) * block_bytes(fmt);
    float *buf = kind != PRO_NONE ? malloc(sizeof(float) * (size_t)(M * I)) : NULL;
    int8_t *qx = malloc((size_t)(M * I));
    float *dx = malloc(sizeof(float) * (size_t)(2 * M * nb));
    if ((kind != PRO_NONE && !buf) || !qx || !dx) {
        free(buf), free(qx), free(dx);
        return ERR_ALLOC;
    }
    float *sx = dx + M * nb;
    quantize_x(prologue(kind, x, norm_w, eps, buf, M, I), M, I, qx, dx, sx);
    /* One thread below ~1M multiply-adds (~35 us of work, a batch-1 576 x 1536), where waking
     * the pool can cost more than it saves: on a busy machine (2 cores, 2 other jobs) a batch-1
     * 576 x 576 took 147 us on 2 threads vs 29 us on one (medians). Not tuned on an idle one. */
    const int par = M * O * I >= (1L << 18);
    const long npair = (O + 1) / 2;
    if (packed) {
        hw_quant_groups(fmt, w, qx, dx, sx, b, r, y, M, O, I, par);
    } else {
        switch (fmt) {
            case Q4_0: PARALLEL_ROWS(Q4_0) break;
            case Q4_1: PARALLEL_ROWS(Q4_1) break;
            case Q5_0: PARALLEL_ROWS(Q5_0) break;
            case Q5_1: PARALLEL_ROWS(Q5_1) break;
            case Q8_0: PARALLEL_ROWS(Q8_0) break;
            case Q4_K: PARALLEL_ROWS(Q4_K) break;
            case Q5_K: PARALLEL_ROWS(Q5_K) break;
            default: PARALLEL_ROWS(Q6_K) break;
        }
    }
    free(buf), free(qx), free(dx);
    if (cos) rope_epilogue(y, M, O, cos, sin, rot_cols, head_dim);
    return 0;
}
#ifdef HW_MODULE /* the extension's Python entry points (_module.c's method table lists them) */

static PyObject *hw_result(const char *name, int rc) {
    if (rc == 0) Py_RETURN_NONE;
    if (rc == ERR_ALLOC) return PyErr_Format(PyExc_MemoryError, "%s: could not allocate its buffers", name);
    if (rc == ERR_FORMAT)
        return PyErr_Format(PyExc_ValueError, "%s: unknown format (GGML ids: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, "
                                              "Q5_K=13, Q6_K=14; quantize: 2, 3, 6, 8, 12, 14)", name);
    return PyErr_Format(PyExc_ValueError, "%s: sizes must be positive, inputs a multiple of the block", name);
}

/* quant_linear(fmt, w, x, b, r, y, M, O, I, prologue, norm_w, eps, cos, sin, rot_cols, head_dim) -> None */
PyObject *hwpy_quant_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *w;
    const float *x, *b, *r, *norm_w, *cos, *sin;
    float *y, eps;
    long fmt, M, O, I, kind, rot_cols, head_dim;
    if (!(hw_nargs("quant_linear", nargs, 16) && HW_L(0, fmt) && HW_P(1, w) && HW_P(2, x) && HW_P(3, b) &&
          HW_P(4, r) && HW_P(5, y) && HW_L(6, M) && HW_L(7, O) && HW_L(8, I) && HW_L(9, kind) && HW_P(10, norm_w) &&
          HW_F(11, eps) && HW_P(12, cos) && HW_P(13, sin) && HW_L(14, rot_cols) && HW_L(15, head_dim)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_quant_linear((int)fmt, w, x, b, r, y, M, O, I, (int)kind, norm_w, eps, cos, sin, rot_cols, head_dim);
    Py_END_ALLOW_THREADS
    return hw_result("quant_linear", rc);
}

/* dequantize(fmt, w, out, O, I) -> None */
PyObject *hwpy_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *w;
    float *out;
    long fmt, O, I;
    if (!(hw_nargs("dequantize", nargs, 5) && HW_L(0, fmt) && HW_P(1, w) && HW_P(2, out) && HW_L(3, O) &&
          HW_L(4, I)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_dequantize((int)fmt, w, out, O, I);
    Py_END_ALLOW_THREADS
    return hw_result("dequantize", rc);
}

/* repack8(fmt, src, dst, O, I, pack) -> None: Q4_0 / Q4_1 / Q8_0 rows to groups of 8 (pack = 1) or back */
PyObject *hwpy_repack8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *src;
    uint8_t *dst;
    long fmt, O, I, pack;
    if (!(hw_nargs("repack8", nargs, 6) && HW_L(0, fmt) && HW_P(1, src) && HW_P(2, dst) && HW_L(3, O) &&
          HW_L(4, I) && HW_L(5, pack)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_repack8((int)fmt, src, dst, O, I, (int)pack);
    Py_END_ALLOW_THREADS
    return hw_result("repack8", rc);
}

/* quantize(fmt, w, out, O, I) -> None */
PyObject *hwpy_quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *w;
    uint8_t *out;
    long fmt, O, I;
    if (!(hw_nargs("quantize", nargs, 5) && HW_L(0, fmt) && HW_P(1, w) && HW_P(2, out) && HW_L(3, O) &&
          HW_L(4, I)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_quantize((int)fmt, w, out, O, I);
    Py_END_ALLOW_THREADS
    return hw_result("quantize", rc);
}
#endif
