/* The K-quants' reference quantizers (ggml's quantize_row_q{4,5,6}_K_ref) in AVX2 (both variants),
 * for generic/convert.c's hw_quantize. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../generic/kernels.h"
#include "quant_unpack.h"

/* ---- the K-quants' reference search. Float order matters here (a sum's rounding can flip which
 * trial scale wins): products are rounded before they are added (rounded()) and sums run in index
 * order, as ggml's C and a numpy port of it compute them. ---- */

static inline int nearest(float v) { return _mm_cvt_ss2si(_mm_set_ss(v)); }  /* round half to even */
static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* The searches below run 8 sub-blocks at once, one per lane of a ymm register: lane j computes
 * exactly what the scalar reference computes for sub-block j (the same operations in the same
 * order; the lanes never mix), so every block is bit for bit ggml's. X[i] holds value i of the 8
 * sub-blocks (a transposed view); levels are int32 lanes. AVX2 ~6x the scalar search. */

#define R8(v) rounded8(v)

static inline __m256i nearest8(__m256 v) { return _mm256_cvtps_epi32(v); } /* round half to even */
static inline __m256i clamp8(__m256i v, int lo, int hi) {
    return _mm256_min_epi32(_mm256_max_epi32(v, _mm256_set1_epi32(lo)), _mm256_set1_epi32(hi));
}
static inline __m256 blendm(__m256 a, __m256 b, __m256 m) { return _mm256_blendv_ps(a, b, m); } /* m ? b : a */
static inline __m256i blendi(__m256i a, __m256i b, __m256 m) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), m));
}

/* make_qkx2_quants(32, nmax, x, w, ..., rmin, rdelta 0.1, nstep, squared error) for 8 sub-blocks:
 * levels L (0..nmax) with x ~ scale * L - neg_min, the scale and min a weighted least-squares fit
 * over the levels each of nstep + 1 trial scales rounds x to, the best of them (and of plain
 * min-max rounding) by weighted squared error. Q4_K: nmax 15, rmin -1, nstep 20; Q5_K: 31, -0.5,
 * 15. Returns the scales; *neg_min = -min >= 0. */
static __m256 fit_scale_min8(const __m256 X[32], const __m256 W[32], __m256i L[32], __m256 *neg_min, int nmax,
                             float rmin, int nstep) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 min = X[0], max = X[0], sum_w = W[0], sum_x = R8(_mm256_mul_ps(W[0], X[0]));
    for (int i = 1; i < 32; i++) {
        min = _mm256_min_ps(X[i], min), max = _mm256_max_ps(X[i], max); /* x < min ? x : min */
        sum_w = _mm256_add_ps(sum_w, W[i]), sum_x = _mm256_add_ps(sum_x, R8(_mm256_mul_ps(W[i], X[i])));
    }
    min = blendm(min, zero, _mm256_cmp_ps(min, zero, _CMP_GT_OQ));
    const __m256 min0 = min, sign = _mm256_set1_ps(-0.0f);
    const __m256 flat = _mm256_cmp_ps(max, min, _CMP_EQ_OQ);
    __m256 iscale = _mm256_div_ps(_mm256_set1_ps((float)nmax), _mm256_sub_ps(max, min));
    __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.0f), iscale), best = zero;
    for (int i = 0; i < 32; i++) {
        L[i] = clamp8(nearest8(R8(_mm256_mul_ps(iscale, _mm256_sub_ps(X[i], min)))), 0, nmax);
        const __m256 diff = _mm256_sub_ps(_mm256_add_ps(R8(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(L[i]))), min), X[i]);
        best = _mm256_add_ps(best, R8(_mm256_mul_ps(W[i], R8(_mm256_mul_ps(diff, diff)))));
    }
    for (int step = 0; step <= nstep; step++) {
        __m256i trial[32];
        /* min is the best trial's so far, as in ggml (a better trial moves the grid of the next) */
        iscale = _mm256_div_ps(_mm256_set1_ps(rmin + rounded(0.1f * step) + (float)nmax), _mm256_sub_ps(max, min));
        __m256 sl = zero, sl2 = zero, sxl = zero;
        for (int i = 0; i < 32; i++) {
            trial[i] = clamp8(nearest8(R8(_mm256_mul_ps(iscale, _mm256_sub_ps(X[i], min)))), 0, nmax);
            const __m256 l = _mm256_cvtepi32_ps(trial[i]), wl = R8(_mm256_mul_ps(W[i], l));
            sl = _mm256_add_ps(sl, wl), sl2 = _mm256_add_ps(sl2, R8(_mm256_mul_ps(wl, l)));
            sxl = _mm256_add_ps(sxl, R8(_mm256_mul_ps(wl, X[i])));
        }
        const __m256 D = _mm256_sub_ps(R8(_mm256_mul_ps(sum_w, sl2)), R8(_mm256_mul_ps(sl, sl)));
        const __m256 ok = _mm256_cmp_ps(D, zero, _CMP_GT_OQ);
        if (_mm256_testz_ps(ok, ok)) continue;
        __m256 s = _mm256_div_ps(_mm256_sub_ps(R8(_mm256_mul_ps(sum_w, sxl)), R8(_mm256_mul_ps(sum_x, sl))), D);
        __m256 m = _mm256_div_ps(_mm256_sub_ps(R8(_mm256_mul_ps(sl2, sum_x)), R8(_mm256_mul_ps(sl, sxl))), D);
        const __m256 pos = _mm256_cmp_ps(m, zero, _CMP_GT_OQ);
        m = blendm(m, zero, pos), s = blendm(s, _mm256_div_ps(sxl, sl2), pos);
        __m256 err = zero;
        for (int i = 0; i < 32; i++) {
            const __m256 diff =
                _mm256_sub_ps(_mm256_add_ps(R8(_mm256_mul_ps(s, _mm256_cvtepi32_ps(trial[i]))), m), X[i]);
            err = _mm256_add_ps(err, R8(_mm256_mul_ps(W[i], R8(_mm256_mul_ps(diff, diff)))));
        }
        const __m256 better = _mm256_and_ps(ok, _mm256_cmp_ps(err, best, _CMP_LT_OQ));
        for (int i = 0; i < 32; i++) L[i] = blendi(L[i], trial[i], better);
        best = blendm(best, err, better), scale = blendm(scale, s, better), min = blendm(min, m, better);
    }
    for (int i = 0; i < 32; i++) L[i] = blendi(L[i], _mm256_setzero_si256(), flat);
    *neg_min = _mm256_xor_ps(blendm(min, min0, flat), sign); /* -min */
    return blendm(scale, zero, flat);
}

/* quantize_row_q4_K_ref / quantize_row_q5_K_ref (five): 256 values in 8 sub-blocks of 32, each fit
 * by fit_scale_min8 (weights rms + |x|); the sub-blocks' scales and mins in 6 bits of the block's d
 * and dmin (f16), the levels rounded again against those. Block: d, dmin, 12 bytes of scales /
 * mins, (Q5_K: 32 bytes of fifth bits, bit j of byte l for value l of sub-block j), 128 of nibbles. */
void hw_quantize_q4_k(const float *x, uint8_t *out, int five) {
    const int nmax = five ? 31 : 15;
    const __m256i lane32 = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 X[32], W[32], sum_x2 = _mm256_setzero_ps();
    __m256i Lv[32];
    for (int i = 0; i < 32; i++) {
        X[i] = _mm256_i32gather_ps(x + i, lane32, 4);
        sum_x2 = _mm256_add_ps(sum_x2, R8(_mm256_mul_ps(X[i], X[i])));
    }
    const __m256 av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, _mm256_set1_ps(32.0f)));
    for (int i = 0; i < 32; i++) W[i] = _mm256_add_ps(av_x, _mm256_andnot_ps(sign, X[i]));
    __m256 mins_v;
    const __m256 scales_v = five ? fit_scale_min8(X, W, Lv, &mins_v, 31, -0.5f, 15)
                                 : fit_scale_min8(X, W, Lv, &mins_v, 15, -1.0f, 20);
    float scales[8], mins[8], max_scale = 0.0f, max_min = 0.0f;
    _mm256_storeu_ps(scales, scales_v), _mm256_storeu_ps(mins, mins_v);
    for (int j = 0; j < 8; j++) {
        max_scale = scales[j] > max_scale ? scales[j] : max_scale;
        max_min = mins[j] > max_min ? mins[j] : max_min;
    }
    uint8_t *sc = out + 4;
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f, inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    memset(sc, 0, 12);
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)nearest(inv_scale * scales[j]), lm = (uint8_t)nearest(inv_min * mins[j]);
        ls = ls < 63 ? ls : 63, lm = lm < 63 ? lm : 63;
        if (j < 4) {
            sc[j] = ls, sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 15) | ((lm & 15) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6), sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    store_f16(out, max_scale / 63.0f), store_f16(out + 2, max_min / 63.0f);
    const float d = f16(out), dmin = f16(out + 2);
    uint8_t L[QK_K];
    int32_t lanes[8];
    for (int i = 0; i < 32; i++) {  /* the search's levels, back in value order */
        _mm256_storeu_si256((__m256i *)lanes, Lv[i]);
        for (int j = 0; j < 8; j++) L[32 * j + i] = (uint8_t)lanes[j];
    }
    for (int j = 0; j < 8; j++) {
        int s, m;
        k4_scale_min(sc, j, &s, &m);
        const float dj = d * s, mj = dmin * m;
        if (dj == 0.0f) continue;
        const __m256 vd = _mm256_set1_ps(dj), vm = _mm256_set1_ps(mj);
        for (int i = 0; i < 32; i += 8) {
            const __m256 v = _mm256_div_ps(_mm256_add_ps(_mm256_loadu_ps(x + 32 * j + i), vm), vd);
            _mm256_storeu_si256((__m256i *)lanes, clamp8(nearest8(v), 0, nmax));
            for (int k = 0; k < 8; k++) L[32 * j + i + k] = (uint8_t)lanes[k];
        }
    }
    uint8_t *q = out + (five ? 48 : 16), *qh = out + 16;
    if (five) memset(qh, 0, 32);
    for (int j = 0; j < QK_K; j += 64, q += 32)
        for (int l = 0; l < 32; l++) {
            q[l] = (uint8_t)((L[j + l] & 15) | ((L[j + l + 32] & 15) << 4));
            if (five) qh[l] |= (uint8_t)(((L[j + l] >> 4) << (j / 32)) | ((L[j + l + 32] >> 4) << (j / 32 + 1)));
        }
}

/* make_qx_quants(16, 32, x, L, rmse_type 1) for 8 sub-blocks of 16 (X[i]: value i of each):
 * levels L (0..63, x ~ scale * (L - 32)) for the scale, among 19 trials around -32 / (the value
 * of largest |x|), that fits best weighted by x^2. Returns the scales. */
static __m256 fit_scale_signed8(const __m256 X[16], __m256i L[16]) {
    const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    __m256 amax = zero, max = zero;
    for (int i = 0; i < 16; i++) {
        const __m256 a = _mm256_andnot_ps(sign, X[i]), bigger = _mm256_cmp_ps(a, amax, _CMP_GT_OQ);
        amax = blendm(amax, a, bigger), max = blendm(max, X[i], bigger);
    }
    const __m256 none = _mm256_cmp_ps(amax, _mm256_set1_ps(1e-15f), _CMP_LT_OQ); /* GROUP_MAX_EPS: all zero */
    __m256 scale = zero, best = zero;
    __m256 Wx[16];
    for (int i = 0; i < 16; i++) Wx[i] = R8(_mm256_mul_ps(R8(_mm256_mul_ps(X[i], X[i])), X[i])); /* w x, w = x^2 */
    for (int t = 0; t <= 18; t++) {  /* t = 0: the plain scale; then offsets -9 .. 9 tenths, 0 skipped */
        const int off = t == 0 ? 0 : t <= 9 ? t - 10 : t - 9;
        const float num = t == 0 ? -32.0f : -(32.0f + rounded(0.1f * off));
        const __m256 iscale = _mm256_div_ps(_mm256_set1_ps(num), max);
        __m256i trial[16];
        __m256 sumlx = zero, suml2 = zero;
        for (int i = 0; i < 16; i++) {
            trial[i] = clamp8(nearest8(R8(_mm256_mul_ps(iscale, X[i]))), -32, 31);
            const __m256 l = _mm256_cvtepi32_ps(trial[i]), w = R8(_mm256_mul_ps(X[i], X[i]));
            sumlx = _mm256_add_ps(sumlx, R8(_mm256_mul_ps(Wx[i], l)));
            suml2 = _mm256_add_ps(suml2, R8(_mm256_mul_ps(R8(_mm256_mul_ps(w, l)), l)));
        }
        __m256 take = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        if (t > 0)
            take = _mm256_and_ps(_mm256_cmp_ps(suml2, zero, _CMP_GT_OQ),
                                 _mm256_cmp_ps(R8(_mm256_mul_ps(sumlx, sumlx)), R8(_mm256_mul_ps(best, suml2)),
                                               _CMP_GT_OQ));
        const __m256 s = blendm(_mm256_div_ps(sumlx, suml2), zero, _mm256_cmp_ps(suml2, zero, _CMP_EQ_OQ));
        for (int i = 0; i < 16; i++) L[i] = blendi(L[i], _mm256_add_epi32(trial[i], _mm256_set1_epi32(32)), take);
        scale = blendm(scale, s, take), best = blendm(best, R8(_mm256_mul_ps(s, sumlx)), take);
    }
    for (int i = 0; i < 16; i++) L[i] = blendi(L[i], _mm256_setzero_si256(), none);
    return blendm(scale, zero, none);
}

/* quantize_row_q6_K_ref: 256 values in 16 sub-blocks of 16, each fit by fit_scale_signed8 (two
 * runs of 8); the scales as int8 of the block's d (f16) and the 6-bit levels rounded again against
 * them. Block: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d. */
void hw_quantize_q6_k(const float *x, uint8_t *out) {
    int8_t L[QK_K];
    float scales[16], max_scale = 0.0f, max_abs = 0.0f;
    const __m256i lane16 = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
    int32_t lanes[8];
    for (int half = 0; half < 2; half++) {  /* sub-blocks 8 half .. 8 half + 7 */
        __m256 X[16];
        __m256i Lv[16];
        for (int i = 0; i < 16; i++) X[i] = _mm256_i32gather_ps(x + 128 * half + i, lane16, 4);
        _mm256_storeu_ps(scales + 8 * half, fit_scale_signed8(X, Lv));
        for (int i = 0; i < 16; i++) {
            _mm256_storeu_si256((__m256i *)lanes, Lv[i]);
            for (int j = 0; j < 8; j++) L[16 * (8 * half + j) + i] = (int8_t)lanes[j];
        }
    }
    for (int b = 0; b < 16; b++)
        if (fabsf(scales[b]) > max_abs) max_abs = fabsf(scales[b]), max_scale = scales[b];
    memset(out, 0, 210);
    if (max_abs < 1e-15f) return;  /* d = 0, every level 0 */
    const float iscale = -128.0f / max_scale;
    store_f16(out + 208, 1.0f / iscale);
    const float d = f16(out + 208);
    int8_t *sc = (int8_t *)(out + 192);
    for (int b = 0; b < 16; b++) {
        const int v = nearest(iscale * scales[b]);
        sc[b] = (int8_t)(v < 127 ? v : 127);
    }
    for (int b = 0; b < 16; b++) {
        const float db = d * sc[b];
        if (db == 0.0f) continue;
        for (int i = 0; i < 16; i++) L[16 * b + i] = (int8_t)(clampi(nearest(x[16 * b + i] / db), -32, 31) + 32);
    }
    uint8_t *ql = out, *qh = out + 128;
    for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32)
        for (int l = 0; l < 32; l++) {
            const int a = L[j + l], b = L[j + l + 32], c = L[j + l + 64], e = L[j + l + 96];
            ql[l] = (uint8_t)((a & 15) | ((c & 15) << 4)), ql[l + 32] = (uint8_t)((b & 15) | ((e & 15) << 4));
            qh[l] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
        }
}

