/* Helpers of the kernels on rows packed in groups of 8 (fmt | X8, generic/quant_formats.h), shared by
 * x86/avx2/quant_group.c and x86/avx512/quant_group.c. */
#ifndef HW_QUANT_X8_H
#define HW_QUANT_X8_H
#include <immintrin.h>

/* A Q5 group's fifth bits for chunk c: qh holds the 8 rows' 32-bit masks (dword lane r = row r);
 * byte j of lane r gets 0x10 where value 4c + j (lo) or 16 + 4c + j (hi) has its fifth bit,
 * matching the chunk's nibbles. The mask's byte k = c / 2 (lo; 2 + c / 2 for hi) spread over the
 * lane's 4 bytes, each byte then tested for its own bit 4 (c % 2) + j. */
static inline __m256i fifth_bits(__m256i qh, int c, int hi) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                            8, 8, 8, 8, 12, 12, 12, 12);
    const __m256i bit = _mm256_set1_epi32((int)(0x08040201u << (4 * (c % 2))));
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(qh, _mm256_add_epi8(spread, _mm256_set1_epi8(
                                                                  (char)(2 * hi + c / 2)))), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(0x10));
}

/* byte k of each dword lane, as int32 */
static inline __m256i lane_byte(__m256i v, int k) {
    return _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(0xFF));
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

#endif
