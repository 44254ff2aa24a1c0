/* GGML blocks -> fp32 rows in AVX2 (both variants), in gguf.quants' order of operations (each product
 * rounded before an add, as numpy computes it). generic/convert.c's hw_dequantize calls it per row. */
#include <immintrin.h>
#include <stdint.h>

#include "../../generic/kernels.h"
#include "quant_unpack.h"

/* out[0..32) = q * d (d_lo for the first 16 values, d_hi for the rest), + m when add_m. */
static inline void emit32(float *out, __m256i q, float d_lo, float d_hi, float m, int add_m) {
    for (int k = 0; k < 4; k++) {
        const __m128i bytes = k < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8 * (k % 2))));
        __m256 o = rounded8(_mm256_mul_ps(v, _mm256_set1_ps(k < 2 ? d_lo : d_hi)));
        if (add_m) o = _mm256_add_ps(o, _mm256_set1_ps(m));
        _mm256_storeu_ps(out + 8 * k, o);
    }
}

static inline __attribute__((always_inline)) void dequantize_row(int fmt, const uint8_t *row, float *out, long I) {
    for (long b = 0; b < I / QK; b++) {
        const wblock w = unpack(fmt, row, b);
        float *o = out + b * QK;
        if (fmt == Q4_0) {
            emit32(o, _mm256_sub_epi8(w.q, _mm256_set1_epi8(8)), w.dw, w.dw, 0.0f, 0);
        } else if (fmt == Q5_0) {
            emit32(o, _mm256_sub_epi8(w.q, _mm256_set1_epi8(16)), w.dw, w.dw, 0.0f, 0);
        } else if (fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K) {  /* dw q + m; K's m = -(dmin mn) */
            emit32(o, w.q, w.dw, w.dw, w.mw, 1);
        } else if (fmt == Q8_0) {
            emit32(o, w.q, w.dw, w.dw, 0.0f, 0);
        } else {  /* Q6_K: (d sc_k) q per 16 values */
            const int8_t *sc = (const int8_t *)(row + (b / 8) * 210 + 192);
            const int j = (int)(b % 8);
            emit32(o, w.q, w.dw * (float)sc[2 * j], w.dw * (float)sc[2 * j + 1], 0.0f, 0);
        }
    }
}

void hw_dequantize_row(int fmt, const uint8_t *row, float *out, long I) {
    switch (fmt) {  /* constant fmt: each case is its own loop */
        case Q4_0: dequantize_row(Q4_0, row, out, I); break;
        case Q4_1: dequantize_row(Q4_1, row, out, I); break;
        case Q5_0: dequantize_row(Q5_0, row, out, I); break;
        case Q5_1: dequantize_row(Q5_1, row, out, I); break;
        case Q8_0: dequantize_row(Q8_0, row, out, I); break;
        case Q4_K: dequantize_row(Q4_K, row, out, I); break;
        case Q5_K: dequantize_row(Q5_K, row, out, I); break;
        default: dequantize_row(Q6_K, row, out, I); break;
    }
}
