/* The quantized linear's row-major weights in AVX2: quant_rows.h's tiles over maddubs' int16 pairs. */
#include <immintrin.h>

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#include "quant_rows.h"
