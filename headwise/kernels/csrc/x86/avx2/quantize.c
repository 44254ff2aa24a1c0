/* fp32 -> int8 blocks of 32 in AVX2 (both variants): rows of x for the quantized linear (q8 blocks
 * with their sums) and Q8_0 weight blocks (ggml's reference quantizer, bit for bit). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../../generic/kernels.h"
#include "quant_unpack.h"

/* Row-major x (M, I) -> q (M, I) int8, d and s (M, I / 32): d = amax / 127, q = round-to-even(x / d)
 * (x times 1 / d in fp32, as llama.cpp's quantize_row_q8_0 does), s = d * sum(q). */
void hw_quantize_x_q8(const float *x, long M, long I, int8_t *q, float *d, float *s) {
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
/* quantize_row_q8_0_ref: d = amax / 127, q = roundf(x * (1 / d)) */
void hw_quantize_q8_0(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    store_f16(out, d);
    /* roundf, half away from zero, branch-free: v - trunc(v) is exact, so the test is too */
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    __m256i i[4];
    for (int k = 0; k < 4; k++) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), _mm256_set1_ps(id));
        const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), half, _CMP_GE_OQ);
        const __m256 step = _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(v, sign)));  /* +-1 or 0 */
        i[k] = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
    }
    _mm256_storeu_si256((__m256i *)(out + 2), pack32(i));
}
