/* Decode attention's pair kernel in AVX2: decode_pair.h's ymm loops with no wider heads. */
#include "decode_pair.h"

static inline long widen_row_head(const int8_t *row, float c, long D, float *dst) { return 0; }
static inline long widen16_row_head(const uint16_t *row, int et, long D, float *dst) { return 0; }
static inline long dot_keys_head(const float *qg, const float *const kr[TK], long D, __m256 d8[TK]) { return 0; }
static inline long pv_head(const float *pg, float alpha, float *ag, const float *const vr[TK], long D) { return 0; }
static inline long dot_keys16_head(const float *qg, const uint16_t *const kr[TK], int et, long D, __m256 d8[TK]) {
    return 0;
}
static inline long pv16_head(const float *pg, float alpha, float *ag, const uint16_t *const vr[TK], int et, long D) {
    return 0;
}
