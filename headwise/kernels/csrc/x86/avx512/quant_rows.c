/* The quantized linear's row-major weights with AVX-512 VNNI: x86/avx2/quant_rows.h's ymm tiles, the
 * products summed in int32 by dpbusd (the same integers as the avx2 variant's maddubs + madd). */
#include <immintrin.h>

static inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }

#include "../avx2/quant_rows.h"
