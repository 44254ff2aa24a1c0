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
 *   Q8_0: w = dw q, q -128..127     -> the sign trick: |qw| . sign(qx, qw)
 *   Q4_K: sub-block j: w = d sc_j q - dmin mn_j      (Q4_1's path)
 *   Q6_K: 16-value groups k: w = d sc_k (q - 32)     (sign trick, scales multiply the int16 pairs)
 * Output rows are split over the OpenMP threads (torch's libgomp: one pool), two weight rows at
 * a time against up to four rows of x, so one weight load serves every row of x.
 * Rows packed in groups of 8 (fmt | X8, quant_blocks.h) go through group_out, ~2x faster; in the
 * avx512 build, from 4 rows of x, two groups at a time in zmm (group2_out).
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

/* ---- rows packed in groups of 8 (fmt | X8: quant_blocks.h) ---- */

/* A thread reads its groups as one stream; asking for the bytes ~2 KiB ahead (one software
 * prefetch per 64-byte line) beat the hardware prefetcher alone when the weights come from DRAM:
 * 100 Q4_1 3072 x 576 matrices (110 MB) at 1 row of x, 1 thread, AMD EPYC: 11.4 -> 8.6 ms mean
 * (1280 and 2560 bytes ahead alike; 640: less). Past the end of the weight it is a no-op. */
int hw_qpf_ahead = 2048;  /* bytes; set at load per core by kernels/__init__.py (quant_prefetch_ahead_for:
                           * 8192 on AMD Zen 5, benchmarks/prefetch.py --quant) */
/* Rows of x per pass over a packed group: the avx512 build's 32 vector registers hold 8 int sums +
 * 8 accumulators (each group's nibbles unpacked half as often: SmolLM2's 30 Q4_1 layers + the Q8_0
 * head at 16 rows, 2 threads, AMD EPYC Zen 4: 16.8 -> 15.7 ms, 8 rows 10.0 -> 9.0, the same bits);
 * AVX2's 16 hold 4 + 4. */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define GMC 8
#else
#define GMC 4
#endif

/* 8 packed rows against MC (1..GMC) rows of quantized x: out[m] lane r = row r's output. The
 * weight chunks are loaded one at a time and met by every row of x before the next, so the
 * registers hold 2 chunks, MC int16 sums and MC accumulators (no spills at MC = GMC). */
static inline __attribute__((always_inline)) void group_tile(int fmt, int MC, const uint8_t *grp, long nb,
                                                             const int8_t *qx, const float *dx, const float *sx,
                                                             long I, __m256 out[GMC]) {
    const long gb = 8 * block_bytes(fmt), h = 8 * hdr_bytes(fmt);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = grp + b * gb;
        const int8_t *xb = qx + b * QK;
        for (long o = 0; o < gb; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        __m256i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + h + 32 * c));
            const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for (int m = 0; m < MC; m++) {
                int32_t a, z;
                memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + 16 + 4 * c, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)  /* the same integers, summed in int32 directly */
                sum[m] = _mm256_dpbusd_epi32(sum[m], lo, _mm256_set1_epi32(a));
                sum[m] = _mm256_dpbusd_epi32(sum[m], hi, _mm256_set1_epi32(z));
#else
                sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
                sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(z)));
#endif
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 mw = fmt == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))
                                      : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
        for (int m = 0; m < MC; m++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            const __m256 f = _mm256_cvtepi32_ps(sum[m]);
#else
            const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m], _mm256_set1_epi16(1)));
#endif
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)), f, acc[m]);
            acc[m] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(sx + m * nb + b), acc[m]);
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Q8_0's groups: 8 chunks of 4 signed values a row; the sign trick per chunk, whose pairs (up to
 * 2 x 128 x 127) need an int32 sum each. */
static inline __attribute__((always_inline)) void group_tile_q8(int MC, const uint8_t *grp, long nb, const int8_t *qx,
                                                                const float *dx, long I, __m256 out[GMC]) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;  /* unused with VNNI */
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = grp + b * 8 * 34;
        for (long o = 0; o < 8 * 34; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        __m256i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c)), a = _mm256_abs_epi8(v);
            for (int m = 0; m < MC; m++) {
                int32_t x4;
                memcpy(&x4, qx + m * I + b * QK + 4 * c, 4);
                const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x4), v);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                sum[m] = _mm256_dpbusd_epi32(sum[m], a, sx);
#else
                sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), ones));
#endif
            }
        }
        for (int m = 0; m < MC; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)),
                                     _mm256_cvtepi32_ps(sum[m]), acc[m]);
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

#if GMC > 4
#define GROUP_MC_WIDE(F, ...)                                \
        case 4: group_tile(F, 4, __VA_ARGS__); break;        \
        case 5: group_tile(F, 5, __VA_ARGS__); break;        \
        case 6: group_tile(F, 6, __VA_ARGS__); break;        \
        case 7: group_tile(F, 7, __VA_ARGS__); break;
#else
#define GROUP_MC_WIDE(F, ...)
#endif
#define GROUP_MC(F, mc, ...)                                 \
    switch (mc) {                                            \
        case 1: group_tile(F, 1, __VA_ARGS__); break;        \
        case 2: group_tile(F, 2, __VA_ARGS__); break;        \
        case 3: group_tile(F, 3, __VA_ARGS__); break;        \
        GROUP_MC_WIDE(F, __VA_ARGS__)                        \
        default: group_tile(F, GMC, __VA_ARGS__); break;     \
    }

/* y[row][o .. o + n) = t + b + r (bias and residual where not NULL). */
static inline void store_row(const float *t, long n, const float *b, const float *r, float *y, long row, long O,
                             long o) {
    for (long k = 0; k < n; k++) {
        float v = t[k];
        if (b) v += b[o + k];
        if (r) v += r[row * O + o + k];
        y[row * O + o + k] = v;
    }
}

/* Outputs [8 g, 8 g + 8) (those below O) of packed group g for all M rows, plus bias and residual. */
static void group_out(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                      const float *b, const float *r, float *y, long M, long O, long I, long g) {
    const long nb = I / QK, o = 8 * g, n = O - o < 8 ? O - o : 8;
    const uint8_t *grp = w + g * nb * 8 * block_bytes(fmt);
    for (long m0 = 0; m0 < M; m0 += GMC) {
        const long mc = M - m0 < GMC ? M - m0 : GMC;
        __m256 out[GMC];
        if (fmt == Q8_0) {
            switch (mc) {
                case 1: group_tile_q8(1, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
                case 2: group_tile_q8(2, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
                case 3: group_tile_q8(3, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
#if GMC > 4
                case 4: group_tile_q8(4, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
                case 5: group_tile_q8(5, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
                case 6: group_tile_q8(6, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
                case 7: group_tile_q8(7, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
#endif
                default: group_tile_q8(GMC, grp, nb, qx + m0 * I, dx + m0 * nb, I, out); break;
            }
        } else if (fmt == Q4_1) {
            GROUP_MC(Q4_1, mc, grp, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else {
            GROUP_MC(Q4_0, mc, grp, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        }
        for (long m = 0; m < mc; m++) {
            float t[8];
            _mm256_storeu_ps(t, out[m]);
            store_row(t, n, b, r, y, m0 + m, O, o);
        }
    }
}
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Two packed groups (16 outputs) at once in 16-wide vectors, from ZMIN rows of x: per chunk the two
 * groups' 32 bytes joined into one zmm, so each broadcast of x feeds one dpbusd for 16 rows where
 * group_tile's ymm gives 8. Where the core has full-width 512-bit units (AMD Zen 5, Xeon
 * Gold/Platinum) that is twice the work per instruction; a batch-1 step stays on group_tile
 * (memory-bound there). Same integers, the same float epilogue per block, per output lane. */
enum { ZMIN = 4 };
static inline __m512i join_si(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline __m512 join_ph(const uint8_t *a, const uint8_t *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), 1);
}
static inline __attribute__((always_inline)) void group2_tile(int fmt, int MC, const uint8_t *g0, const uint8_t *g1,
                                                              long nb, const int8_t *qx, const float *dx,
                                                              const float *sx, long I, __m512 out[GMC]) {
    const long gb = 8 * block_bytes(fmt), h = 8 * hdr_bytes(fmt);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p0 = g0 + b * gb, *p1 = g1 + b * gb;
        const int8_t *xb = qx + b * QK;
        for (long o = 0; o < gb; o += 64) {
            _mm_prefetch((const char *)(p0 + ahead + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + ahead + o), _MM_HINT_T0);
        }
        __m512i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm512_setzero_si512();
        if (fmt == Q8_0) {  /* |w| against x with w's sign (AVX-512 has no vpsignb: negate where w < 0) */
            for (int c = 0; c < 8; c++) {
                const __m512i v = join_si(p0 + 16 + 32 * c, p1 + 16 + 32 * c), a = _mm512_abs_epi8(v);
                const __mmask64 neg = _mm512_movepi8_mask(v);
                for (int m = 0; m < MC; m++) {
                    int32_t x4;
                    memcpy(&x4, xb + m * I + 4 * c, 4);
                    const __m512i xv = _mm512_set1_epi32(x4);
                    sum[m] = _mm512_dpbusd_epi32(sum[m], a, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
                }
            }
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i v = join_si(p0 + h + 32 * c, p1 + h + 32 * c);
                const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                for (int m = 0; m < MC; m++) {
                    int32_t a, z;
                    memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + 16 + 4 * c, 4);
                    sum[m] = _mm512_dpbusd_epi32(sum[m], lo, _mm512_set1_epi32(a));
                    sum[m] = _mm512_dpbusd_epi32(sum[m], hi, _mm512_set1_epi32(z));
                }
            }
        }
        const __m512 dw = join_ph(p0, p1);
        if (fmt == Q8_0) {
            for (int m = 0; m < MC; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), _mm512_cvtepi32_ps(sum[m]),
                                         acc[m]);
        } else {
            const __m512 mw = fmt == Q4_1 ? join_ph(p0 + 16, p1 + 16) : _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f));
            for (int m = 0; m < MC; m++) {
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), _mm512_cvtepi32_ps(sum[m]),
                                         acc[m]);
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

#define GROUP2_MC(F, mc, ...)                                \
    switch (mc) {                                            \
        case 1: group2_tile(F, 1, __VA_ARGS__); break;       \
        case 2: group2_tile(F, 2, __VA_ARGS__); break;       \
        case 3: group2_tile(F, 3, __VA_ARGS__); break;       \
        case 4: group2_tile(F, 4, __VA_ARGS__); break;       \
        case 5: group2_tile(F, 5, __VA_ARGS__); break;       \
        case 6: group2_tile(F, 6, __VA_ARGS__); break;       \
        case 7: group2_tile(F, 7, __VA_ARGS__); break;       \
        default: group2_tile(F, GMC, __VA_ARGS__); break;    \
    }

/* Outputs [8 g, 8 g + 16) (those below O) of packed groups g and g + 1 for all M rows, plus bias and residual. */
static void group2_out(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                       const float *b, const float *r, float *y, long M, long O, long I, long g) {
    const long nb = I / QK, o = 8 * g, n = O - o < 16 ? O - o : 16;
    const uint8_t *g0 = w + g * nb * 8 * block_bytes(fmt), *g1 = g0 + nb * 8 * block_bytes(fmt);
    for (long m0 = 0; m0 < M; m0 += GMC) {
        const long mc = M - m0 < GMC ? M - m0 : GMC;
        __m512 out[GMC];
        if (fmt == Q8_0) {
            GROUP2_MC(Q8_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q4_1) {
            GROUP2_MC(Q4_1, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else {
            GROUP2_MC(Q4_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        }
        for (long m = 0; m < mc; m++) {
            float t[16];
            _mm512_storeu_ps(t, out[m]);
            store_row(t, n, b, r, y, m0 + m, O, o);
        }
    }
}
#define HAVE_GROUP2 1
#endif

#define PARALLEL_ROWS(F)                                                                        \
    _Pragma("omp parallel for schedule(static) if (par)") for (long p = 0; p < npair; p++)      \
        rows_out(F, w, row_bytes, qx, dx, sx, b, r, y, M, O, I, 2 * p, O - 2 * p < 2 ? 1 : 2);

int hw_quant_linear(int fmt, const uint8_t *w, const float *x, const float *b, const float *r, float *y, long M,
                    long O, long I, int kind, const float *norm_w, float eps, const float *cos, const float *sin,
                    long rot_cols, long head_dim) {
    const int packed = (fmt & X8) != 0;
    fmt &= ~X8;
    if (!block_bytes(fmt) || (packed && fmt != Q4_0 && fmt != Q4_1 && fmt != Q8_0)) return ERR_FORMAT;
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
        const long ng = (O + 7) / 8;
#ifdef HAVE_GROUP2
        if (M >= ZMIN) {
            #pragma omp parallel for schedule(static) if (par)
            for (long q = 0; q < (ng + 1) / 2; q++) {
                if (2 * q + 1 < ng) group2_out(fmt, w, qx, dx, sx, b, r, y, M, O, I, 2 * q);
                else group_out(fmt, w, qx, dx, sx, b, r, y, M, O, I, 2 * q);
            }
        } else
#endif
        {
            #pragma omp parallel for schedule(static) if (par)
            for (long g = 0; g < ng; g++) group_out(fmt, w, qx, dx, sx, b, r, y, M, O, I, g);
        }
    } else {
        switch (fmt) {
            case Q4_0: PARALLEL_ROWS(Q4_0) break;
            case Q4_1: PARALLEL_ROWS(Q4_1) break;
            case Q8_0: PARALLEL_ROWS(Q8_0) break;
            case Q4_K: PARALLEL_ROWS(Q4_K) break;
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
        return PyErr_Format(PyExc_ValueError, "%s: unknown format (GGML ids: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, "
                                              "Q6_K=14; quantize: 2, 3, 8)", name);
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
