/* Decode attention's pair kernel in the avx512 variant: x86/avx2/decode_pair.h's loops with every 16
 * channels in zmm first (then the ymm loops: D % 16). */
#define HW_DIRECT16 1 /* decode_pair.h: 16-bit K / V at one query row a head widened as read (zmm hooks below) */
#include "../avx2/decode_pair.h"

/* int8 -> fp32 16 at a time: half the instructions of this (compute-bound) widening */
static inline long widen_row_head(const int8_t *row, float c, long D, float *dst) {
    long d = 0;
    const __m512 f16 = _mm512_set1_ps(c);
    for (; d + 16 <= D; d += 16) {
        const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d)));
        _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(w), f16));
    }
    return d;
}

/* bf16 / fp16 -> fp32 16 at a time (bf16: a 16-bit shift; fp16: vcvtph2ps) */
static inline long widen16_row_head(const uint16_t *row, int et, long D, float *dst) {
    long d = 0;
    for (; d + 16 <= D; d += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(row + d));
        const __m512 f = et == KV_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                       : _mm512_cvtph_ps(h);
        _mm512_storeu_ps(dst + d, f);
    }
    return d;
}

/* Every 16 channels d of q (qg) against key row j's, K(j) giving those as fp32, into z[j]; then each z[j]
 * folded to the 8 lanes of d8[j]. dot_keys_head's and dot_keys16_head's loop. */
#define DOT_KEYS_ZMM(K)                                                                                      \
    do {                                                                                                     \
        if (D >= 16) {                                                                                       \
            __m512 z[TK];                                                                                    \
            for (long j = 0; j < TK; j++) z[j] = _mm512_setzero_ps();                                        \
            for (; d + 16 <= D; d += 16) {                                                                   \
                const __m512 qv = _mm512_loadu_ps(qg + d);                                                   \
                for (long j = 0; j < TK; j++) z[j] = _mm512_fmadd_ps(qv, K(j), z[j]);                        \
            }                                                                                                \
            for (long j = 0; j < TK; j++)                                                                    \
                d8[j] = _mm256_add_ps(_mm512_castps512_ps256(z[j]), _mm512_extractf32x8_ps(z[j], 1));        \
        }                                                                                                    \
    } while (0)
#define KEY_LOAD512(j) _mm512_loadu_ps(kr[j] + d)

/* 16 channels an instruction where the core has them */
static inline long dot_keys_head(const float *qg, const float *const kr[TK], long D, __m256 d8[TK]) {
    long d = 0;
    DOT_KEYS_ZMM(KEY_LOAD512);
    return d;
}

/* ag = alpha ag + sum_j pg[j] v_j over every 16 channels, V(j) giving value row j's as fp32: pv_head's and
 * pv16_head's loop */
#define PV_ZMM(V)                                                                                            \
    do {                                                                                                     \
        if (D >= 16) {                                                                                       \
            __m512 pz[TK];                                                                                   \
            for (long j = 0; j < TK; j++) pz[j] = _mm512_set1_ps(pg[j]);                                     \
            const __m512 alz = _mm512_set1_ps(alpha);                                                        \
            for (; d + 16 <= D; d += 16) PV_CHUNK_BY(512, __m512, pz, alz, V);                               \
        }                                                                                                    \
    } while (0)

static inline long pv_head(const float *pg, float alpha, float *ag, const float *const vr[TK], long D) {
    long d = 0;
    PV_ZMM(PV_LOAD512);
    return d;
}

/* 16 bf16 / fp16 as fp32 (widen16_row_head's conversion, straight to a register) */
static inline __m512 widen16_zmm(const uint16_t *x, int et) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)x);
    return et == KV_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

#define KEY_WIDEN512(j) widen16_zmm(kr[j] + d, et)
static inline long dot_keys16_head(const float *qg, const uint16_t *const kr[TK], int et, long D, __m256 d8[TK]) {
    long d = 0;
    DOT_KEYS_ZMM(KEY_WIDEN512);
    return d;
}

#define PV_WIDEN512(j) widen16_zmm(vr16[j] + d, et)
static inline long pv16_head(const float *pg, float alpha, float *ag, const uint16_t *const vr16[TK], int et, long D) {
    long d = 0;
    PV_ZMM(PV_WIDEN512);
    return d;
}
