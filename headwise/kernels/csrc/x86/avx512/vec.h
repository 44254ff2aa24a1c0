/* Vector helpers of the AVX-512 kernels: the 16-lane twins of x86/avx2/vec.h's. */
#ifndef HW_AVX512_VEC_H
#define HW_AVX512_VEC_H
#include <immintrin.h>
#include <stdint.h>

/* exp2_ps on 16 lanes: the same operations, so each lane gets exp2_ps's bits. */
static inline __m512 exp2_ps_z(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, i);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(i), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

static inline __m512 rounded16(__m512 v) {  /* as quant_unpack.h's rounded8: no FMA with what follows */
    __asm__("" : "+v"(v));
    return v;
}

/* Two 32-byte runs (a's, then b's) as one zmm; two runs of 8 f16 as 16 floats. */
static inline __m512i join_si(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline __m512 join_ph(const uint8_t *a, const uint8_t *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), 1);
}

#endif
