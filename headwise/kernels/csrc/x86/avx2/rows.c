/* Row kernels in AVX2 (both variants): greedy decoding's argmax over rows of logits, the SwiGLU
 * and GeGLU prologues' act(g) u, and a KV-cache row quantized to int8.
 *
 * argmax: each row's first index of its maximum, as torch.argmax gives it. ATen's CPU argmax walks
 * the row one element at a time (~1 ns each here: 0.27 ms for 16 rows of SmolLM2's 49,152 logits on
 * 2 threads, 2% of a 16-row decode step); this one compares 8 lanes at a time. A row holding a NaN
 * (torch.argmax returns the NaN's index) is reported, not answered: the caller asks torch for it. */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../../generic/kernels.h"
#include "vec.h"

/* The row's argmax, or -1 when the row holds a NaN. Each lane keeps its first maximum (strict >),
 * and the lanes are merged by value, then by the smaller index: the first maximum of the row. */
static long argmax_row_f32_ymm(const float *x, long n) {
    long i = 0, best = -1;
    float bv = 0.0f;
    if (n >= 8) {
        __m256 vmax = _mm256_loadu_ps(x);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
        const __m256i eight = _mm256_set1_epi32(8);
        __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            cur = _mm256_add_epi32(cur, eight);
            const __m256 v = _mm256_loadu_ps(x + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
            vmax = _mm256_blendv_ps(vmax, v, gt);
            vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
        }
        if (_mm256_movemask_ps(nan)) return -1;
        float mv[8];
        int32_t mi[8];
        _mm256_storeu_ps(mv, vmax);
        _mm256_storeu_si256((__m256i *)mi, vidx);
        best = mi[0], bv = mv[0];
        for (int l = 1; l < 8; l++)
            if (mv[l] > bv || (mv[l] == bv && mi[l] < best)) bv = mv[l], best = mi[l];
    }
    for (; i < n; i++) {  /* the tail (indices past every lane's): strictly greater only */
        if (x[i] != x[i]) return -1;
        if (best < 0 || x[i] > bv) bv = x[i], best = i;
    }
    return best;
}

/* out[r] = argmax of row r of x (R rows of n, rows `stride` floats apart), -1 for a row with a
 * NaN. Returns how many rows had one. Rows split over the OpenMP threads when there are many. */
long hw_argmax_rows(const float *x, long R, long n, long stride, int64_t *out) {
    long nans = 0;
    #pragma omp parallel for schedule(static) reduction(+ : nans) if (R > 1 && R * n >= (1L << 16))
    for (long r = 0; r < R; r++) {
        out[r] = argmax_row_f32_ymm(x + r * stride, n);
        nans += out[r] < 0;
    }
    return nans;
}

/* silu(g) u = g / (1 + e^-g) u, 8 at a time with exp2_ps (e^-g = 2^(-g log2 e), clamped to +-126
 * where 1 + e^-g is 1 or huge either way): glibc's expf, one at a time, took 4.5 ms of a 16-row
 * decode step's 30 layers on one thread (6 ns each, AMD EPYC). */
void hw_swiglu_rows(const float *x, float *out, long M, long I) {
    const __m256 nlog2e = _mm256_set1_ps(-1.4426950408889634f), one = _mm256_set1_ps(1.0f);
    const __m256 hi = _mm256_set1_ps(126.0f);
    for (long m = 0; m < M; m++) {
        const float *g = x + m * 2 * I, *u = g + I;
        float *bm = out + m * I;
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp2_ps(_mm256_min_ps(_mm256_mul_ps(gv, nlog2e), hi));
            _mm256_storeu_ps(bm + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) bm[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* gelu_tanh(g) u, GELU's tanh form (Hendrycks & Gimpel 2016; Gemma's GeGLU, torch's
 * approximate="tanh"): 0.5 g (1 + tanh(z / 2)) with z / 2 = sqrt(2 / pi) (g + 0.044715 g^3), which
 * is g / (1 + e^-z): SwiGLU's loop with z for g in the exponent (clamped as there: at z <= -87 the
 * product is 0 to fp32's precision either way). */
void hw_geglu_rows(const float *x, float *out, long M, long I) {
    const float c1 = 1.5957691216057308f, c3 = 1.5957691216057308f * 0.044715f; /* 2 sqrt(2 / pi) (1, 0.044715) */
    const __m256 nlog2e = _mm256_set1_ps(-1.4426950408889634f), one = _mm256_set1_ps(1.0f);
    const __m256 hi = _mm256_set1_ps(126.0f), v1 = _mm256_set1_ps(c1), v3 = _mm256_set1_ps(c3);
    for (long m = 0; m < M; m++) {
        const float *g = x + m * 2 * I, *u = g + I;
        float *bm = out + m * I;
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 z = _mm256_mul_ps(gv, _mm256_fmadd_ps(_mm256_mul_ps(gv, gv), v3, v1));
            const __m256 e = exp2_ps(_mm256_min_ps(_mm256_mul_ps(z, nlog2e), hi));
            _mm256_storeu_ps(bm + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) {
            const float z = g[i] * (c1 + c3 * g[i] * g[i]), e = -z * 1.4426950408889634f;
            bm[i] = g[i] / (1.0f + exp2f(e < 126.0f ? e : 126.0f)) * u[i];
        }
    }
}

/* x (D floats, D % 8 == 0) -> q (D int8) and *scale as cache/quantized.py's quantize_int8 makes them,
 * bit for bit: scale = amax|x| / 127, q = round-half-even(x / max(scale, FLT_MIN)) (a true division). */
void hw_quantize_row_i8(const float *x, long D, int8_t *q, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (long d = 0; d < D; d += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + d)));
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    float a = lanes[0];
    for (int i = 1; i < 8; i++) a = a > lanes[i] ? a : lanes[i];
    const float sc = a / 127.0f;
    const __m256 div = _mm256_set1_ps(sc > FLT_MIN ? sc : FLT_MIN);
    for (long d = 0; d < D; d += 8) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + d), div),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i i = _mm256_cvtps_epi32(r);  /* |r| <= 127: exact */
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64((__m128i *)(q + d), _mm_packs_epi16(w, w));
    }
    *scale = sc;
}
