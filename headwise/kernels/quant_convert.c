/* GGML blocks <-> fp32 and the packed rows (quant_blocks.h has the layouts; issue 14):
 * hw_dequantize writes the fp32 matrix (prefill runs a fp32 GEMM on it), hw_quantize makes
 * Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks from fp32 (int8 / int4 at load time), both bit for bit what
 * ggml's reference code (and the gguf package's numpy port) computes, and the K-quants Q4_K / Q5_K /
 * Q6_K by ggml's reference search (quantize_row_q{4,5,6}_K_ref; no FMA contraction,
 * every product rounded before its sum, as a numpy port computes them), and hw_repack8 packs
 * Q4_0 / Q4_1 / Q8_0 rows in the groups of 8 that quant_linear.c reads fastest, or back. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

/* ---- rows <-> packed groups of 8 ---- */

static inline void copy_to(int pack, uint8_t *row, uint8_t *grp, size_t n) {
    if (pack) memcpy(grp, row, n);
    else memcpy(row, grp, n);
}

/* nrows (<= 8) rows of blocks (row_bytes apart) <-> one packed group of nb blocks (pack = 1: to it). */
static void repack_group(int fmt, uint8_t *rows, long row_bytes, long nrows, long nb, uint8_t *grp, int pack) {
    const long bb = block_bytes(fmt), h = hdr_bytes(fmt), at = hdr_at(fmt), q0 = at ? 0 : h;
    if (pack) memset(grp, 0, (size_t)(8 * nb * bb));
    for (long r = 0; r < nrows; r++)
        for (long b = 0; b < nb; b++) {
            uint8_t *row = rows + r * row_bytes + b * bb, *g = grp + b * 8 * bb;
            for (long f = 0; f < h / 2; f++) copy_to(pack, row + at + 2 * f, g + 16 * f + 2 * r, 2);  /* d (, m) */
            for (long c = 0; c < (bb - h) / 4; c++) copy_to(pack, row + q0 + 4 * c, g + 8 * h + 32 * c + 4 * r, 4);
        }
}

/* (O, row_bytes) blocks -> packed groups (ceil(O / 8) x 8 rows), or back (pack = 0). */
int hw_repack8(int fmt, const uint8_t *src, uint8_t *dst, long O, long I, int pack) {
    if (!packable(fmt)) return ERR_FORMAT;
    if (O < 1 || I < 1 || I % block_values(fmt)) return ERR_SHAPE;
    const long nb = I / block_values(fmt), row_bytes = nb * block_bytes(fmt), G = (O + 7) / 8;
    #pragma omp parallel for schedule(static) if (O * I >= (1L << 16))
    for (long g = 0; g < G; g++) {
        const long n = O - 8 * g < 8 ? O - 8 * g : 8;
        uint8_t *rows = (uint8_t *)(pack ? src : dst) + 8 * g * row_bytes;
        uint8_t *grp = (uint8_t *)(pack ? dst : src) + g * 8 * row_bytes;
        repack_group(fmt, rows, row_bytes, n, nb, grp, pack);
    }
    return 0;
}

/* ---- dequantize: blocks -> fp32, in gguf.quants' order of operations ---- */

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

static void dequantize_row(int fmt, const uint8_t *row, float *out, long I) {
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

int hw_dequantize(int fmt, const uint8_t *w, float *out, long O, long I) {
    const int packed = (fmt & X8) != 0;
    fmt &= ~X8;
    if (!block_bytes(fmt) || (packed && !packable(fmt))) return ERR_FORMAT;
    if (O < 1 || I < 1 || I % block_values(fmt)) return ERR_SHAPE;
    const long row_bytes = I / block_values(fmt) * block_bytes(fmt);
    if (packed) {  /* each group back to rows in a scratch, then as rows */
        int rc = 0;
        #pragma omp parallel for schedule(static) if (O * I >= (1L << 16))
        for (long g = 0; g < (O + 7) / 8; g++) {
            const long n = O - 8 * g < 8 ? O - 8 * g : 8;
            uint8_t *rows = malloc((size_t)(8 * row_bytes));
            if (!rows) {
                #pragma omp atomic write
                rc = ERR_ALLOC;
                continue;
            }
            repack_group(fmt, rows, row_bytes, n, I / block_values(fmt), (uint8_t *)w + g * 8 * row_bytes, 0);
            for (long k = 0; k < n; k++) {
                uint8_t *row = rows + k * row_bytes;
                float *o = out + (8 * g + k) * I;
                switch (fmt) {
                    case Q4_1: dequantize_row(Q4_1, row, o, I); break;
                    case Q5_0: dequantize_row(Q5_0, row, o, I); break;
                    case Q5_1: dequantize_row(Q5_1, row, o, I); break;
                    case Q8_0: dequantize_row(Q8_0, row, o, I); break;
                    case Q4_K: dequantize_row(Q4_K, row, o, I); break;
                    case Q5_K: dequantize_row(Q5_K, row, o, I); break;
                    case Q6_K: dequantize_row(Q6_K, row, o, I); break;
                    default: dequantize_row(Q4_0, row, o, I); break;
                }
            }
            free(rows);
        }
        return rc;
    }
    #pragma omp parallel for schedule(static) if (O * I >= (1L << 16))
    for (long o = 0; o < O; o++) {
        switch (fmt) {  /* constant fmt: each case is its own loop */
            case Q4_0: dequantize_row(Q4_0, w + o * row_bytes, out + o * I, I); break;
            case Q4_1: dequantize_row(Q4_1, w + o * row_bytes, out + o * I, I); break;
            case Q5_0: dequantize_row(Q5_0, w + o * row_bytes, out + o * I, I); break;
            case Q5_1: dequantize_row(Q5_1, w + o * row_bytes, out + o * I, I); break;
            case Q8_0: dequantize_row(Q8_0, w + o * row_bytes, out + o * I, I); break;
            case Q4_K: dequantize_row(Q4_K, w + o * row_bytes, out + o * I, I); break;
            case Q5_K: dequantize_row(Q5_K, w + o * row_bytes, out + o * I, I); break;
            default: dequantize_row(Q6_K, w + o * row_bytes, out + o * I, I); break;
        }
    }
    return 0;
}

/* ---- quantize: fp32 -> Q8_0 / Q4_0 / Q4_1, ggml's reference quantizers ---- */

static inline void store_f16(uint8_t *p, float v) {
    const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    memcpy(p, &h, 2);
}

static void quantize_block(int fmt, const float *x, uint8_t *out) {
    if (fmt == Q8_0) {  /* quantize_row_q8_0_ref: d = amax / 127, q = roundf(x * (1 / d)) */
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
        return;
    }
    float d, id, lo;
    if (fmt == Q4_0) {  /* quantize_row_q4_0_ref: d = (the value of largest |x|) / -8, q = x / d + 8 */
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        d = max / -8.0f, lo = 0.0f;
        store_f16(out, d);
    } else {  /* quantize_row_q4_1_ref: d = (max - min) / 15, q = (x - min) / d, m = min */
        float min = x[0], max = x[0];
        for (int j = 1; j < QK; j++) min = x[j] < min ? x[j] : min, max = x[j] > max ? x[j] : max;
        d = (max - min) / 15.0f, lo = min;
        store_f16(out, d), store_f16(out + 2, min);
    }
    id = d != 0.0f ? 1.0f / d : 0.0f;
    const float add = fmt == Q4_0 ? 8.5f : 0.5f;  /* + 0.5, then truncate: round half up */
    uint8_t *qs = out + (fmt == Q4_0 ? 2 : 4);
    for (int j = 0; j < QK / 2; j++) {
        const int a = (int)(rounded((x[j] - lo) * id) + add), c = (int)(rounded((x[j + 16] - lo) * id) + add);
        qs[j] = (uint8_t)((a < 15 ? a : 15) | ((c < 15 ? c : 15) << 4));
    }
}

/* quantize_row_q5_0_ref: d = (the value of largest |x|) / -16, q = x / d + 16 in 5 bits, the
 * fifth bits of the 32 values in a 32-bit mask after d. quantize_row_q5_1_ref (one): d = (max -
 * min) / 31, q = (x - min) / d, m = min after d. */
static void quantize_q5(const float *x, uint8_t *out, int one) {
    float d, lo = 0.0f, add = 16.5f;
    if (!one) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        d = max / -16.0f;
    } else {
        float min = x[0], max = x[0];
        for (int j = 1; j < QK; j++) min = x[j] < min ? x[j] : min, max = x[j] > max ? x[j] : max;
        d = (max - min) / 31.0f, lo = min, add = 0.5f;
        store_f16(out + 2, min);
    }
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_f16(out, d);
    uint8_t *qh = out + (one ? 4 : 2), *qs = qh + 4;
    uint32_t high = 0;
    for (int j = 0; j < QK / 2; j++) {
        int a, c;
        if (!one) {
            a = (int8_t)(rounded(x[j] * id) + add), c = (int8_t)(rounded(x[j + 16] * id) + add);
            a = a < 31 ? a : 31, c = c < 31 ? c : 31;
        } else {
            a = (uint8_t)(rounded((x[j] - lo) * id) + add), c = (uint8_t)(rounded((x[j + 16] - lo) * id) + add);
        }
        qs[j] = (uint8_t)((a & 15) | ((c & 15) << 4));
        high |= (uint32_t)((a >> 4) & 1) << j | (uint32_t)((c >> 4) & 1) << (j + 16);
    }
    memcpy(qh, &high, 4);
}

/* ---- the K-quants' reference search. Float order matters here (a sum's rounding can flip which
 * trial scale wins): products are rounded before they are added (rounded()) and sums run in index
 * order, as ggml's C and a numpy port of it compute them. ---- */

static inline int nearest(float v) { return _mm_cvt_ss2si(_mm_set_ss(v)); }  /* round half to even */
static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* make_qkx2_quants(32, nmax, x, w, ..., rmin, rdelta 0.1, nstep, squared error): levels L (0..nmax)
 * with x ~ scale * L - neg_min, the scale and min a weighted least-squares fit over the levels each
 * of nstep + 1 trial scales rounds x to, the best of them (and of plain min-max rounding) by
 * weighted squared error. Q4_K: nmax 15, rmin -1, nstep 20; Q5_K: 31, -0.5, 15. Returns scale;
 * *neg_min = -min >= 0. */
static float fit_scale_min(const float *x, const float *w, uint8_t *L, float *neg_min, int nmax, float rmin,
                           int nstep) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = rounded(sum_w * x[0]);
    for (int i = 1; i < 32; i++) {
        min = x[i] < min ? x[i] : min, max = x[i] > max ? x[i] : max;
        sum_w += w[i], sum_x += rounded(w[i] * x[i]);
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, 32);
        *neg_min = -min;
        return 0.0f;
    }
    float iscale = (float)nmax / (max - min), scale = 1.0f / iscale, best = 0.0f;
    for (int i = 0; i < 32; i++) {
        L[i] = (uint8_t)clampi(nearest(rounded(iscale * (x[i] - min))), 0, nmax);
        const float diff = rounded(scale * L[i]) + min - x[i];
        best += rounded(w[i] * rounded(diff * diff));
    }
    for (int step = 0; step <= nstep; step++) {
        uint8_t trial[32];
        iscale = (rmin + rounded(0.1f * step) + (float)nmax) / (max - min);
        float sl = 0.0f, sl2 = 0.0f, sxl = 0.0f;
        for (int i = 0; i < 32; i++) {
            const int l = clampi(nearest(rounded(iscale * (x[i] - min))), 0, nmax);
            const float wl = rounded(w[i] * l);
            trial[i] = (uint8_t)l;
            sl += wl, sl2 += rounded(wl * l), sxl += rounded(wl * x[i]);
        }
        const float D = rounded(sum_w * sl2) - rounded(sl * sl);
        if (!(D > 0)) continue;
        float s = (rounded(sum_w * sxl) - rounded(sum_x * sl)) / D, m = (rounded(sl2 * sum_x) - rounded(sl * sxl)) / D;
        if (m > 0) m = 0, s = sxl / sl2;
        float err = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float diff = rounded(s * trial[i]) + m - x[i];
            err += rounded(w[i] * rounded(diff * diff));
        }
        if (err < best) memcpy(L, trial, 32), best = err, scale = s, min = m;
    }
    *neg_min = -min;
    return scale;
}

/* quantize_row_q4_K_ref / quantize_row_q5_K_ref (five): 256 values in 8 sub-blocks of 32, each fit
 * by fit_scale_min (weights rms + |x|); the sub-blocks' scales and mins in 6 bits of the block's d
 * and dmin (f16), the levels rounded again against those. Block: d, dmin, 12 bytes of scales /
 * mins, (Q5_K: 32 bytes of fifth bits, bit j of byte l for value l of sub-block j), 128 of nibbles. */
static void quantize_k45(const float *x, uint8_t *out, int five) {
    const int nmax = five ? 31 : 15;
    uint8_t L[QK_K], *sc = out + 4;
    float scales[8], mins[8], max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 8; j++) {
        const float *xj = x + 32 * j;
        float w[32], sum_x2 = 0.0f;
        for (int l = 0; l < 32; l++) sum_x2 += rounded(xj[l] * xj[l]);
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xj[l]);
        scales[j] = five ? fit_scale_min(xj, w, L + 32 * j, &mins[j], 31, -0.5f, 15)
                         : fit_scale_min(xj, w, L + 32 * j, &mins[j], 15, -1.0f, 20);
        max_scale = scales[j] > max_scale ? scales[j] : max_scale;
        max_min = mins[j] > max_min ? mins[j] : max_min;
    }
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
    for (int j = 0; j < 8; j++) {
        int s, m;
        k4_scale_min(sc, j, &s, &m);
        const float dj = d * s, mj = dmin * m;
        if (dj == 0.0f) continue;
        for (int i = 0; i < 32; i++) L[32 * j + i] = (uint8_t)clampi(nearest((x[32 * j + i] + mj) / dj), 0, nmax);
    }
    uint8_t *q = out + (five ? 48 : 16), *qh = out + 16;
    if (five) memset(qh, 0, 32);
    for (int j = 0; j < QK_K; j += 64, q += 32)
        for (int l = 0; l < 32; l++) {
            q[l] = (uint8_t)((L[j + l] & 15) | ((L[j + l + 32] & 15) << 4));
            if (five) qh[l] |= (uint8_t)(((L[j + l] >> 4) << (j / 32)) | ((L[j + l + 32] >> 4) << (j / 32 + 1)));
        }
}

/* make_qx_quants(16, 32, x, L, rmse_type 1): levels L (0..63, x ~ scale * (L - 32)) for the
 * scale, among 19 trials around -32 / (the value of largest |x|), that fits best weighted by x^2. */
static float fit_scale_signed(const float *x, int8_t *L) {
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < 16; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax < 1e-15f) {  /* GROUP_MAX_EPS: all zero */
        memset(L, 0, 16);
        return 0.0f;
    }
    float scale = 0.0f, best = 0.0f;
    for (int t = 0; t <= 18; t++) {  /* t = 0: the plain scale; then offsets -9 .. 9 tenths, 0 skipped */
        const int off = t == 0 ? 0 : t <= 9 ? t - 10 : t - 9;
        const float iscale = t == 0 ? -32.0f / max : -(32.0f + rounded(0.1f * off)) / max;
        float sumlx = 0.0f, suml2 = 0.0f;
        for (int i = 0; i < 16; i++) {
            const int l = clampi(nearest(rounded(iscale * x[i])), -32, 31);
            const float w = rounded(x[i] * x[i]);
            sumlx += rounded(rounded(w * x[i]) * l), suml2 += rounded(rounded(w * l) * l);
        }
        if (t == 0 || (suml2 > 0 && rounded(sumlx * sumlx) > rounded(best * suml2))) {
            for (int i = 0; i < 16; i++) L[i] = (int8_t)(clampi(nearest(rounded(iscale * x[i])), -32, 31) + 32);
            scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f, best = rounded(scale * sumlx);
        }
    }
    return scale;
}

/* quantize_row_q6_K_ref: 256 values in 16 sub-blocks of 16, each fit by fit_scale_signed; the
 * scales as int8 of the block's d (f16) and the 6-bit levels rounded again against them. Block:
 * 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d. */
static void quantize_q6_k(const float *x, uint8_t *out) {
    int8_t L[QK_K];
    float scales[16], max_scale = 0.0f, max_abs = 0.0f;
    for (int b = 0; b < 16; b++) {
        scales[b] = fit_scale_signed(x + 16 * b, L + 16 * b);
        if (fabsf(scales[b]) > max_abs) max_abs = fabsf(scales[b]), max_scale = scales[b];
    }
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

int hw_quantize(int fmt, const float *w, uint8_t *out, long O, long I) {
    if (!block_bytes(fmt)) return ERR_FORMAT;  /* every format these kernels know */
    const long bv = block_values(fmt);
    if (O < 1 || I < 1 || I % bv) return ERR_SHAPE;
    const long nb = O * (I / bv), bytes = block_bytes(fmt);
    #pragma omp parallel for schedule(static) if (O * I >= (1L << 16))
    for (long k = 0; k < nb; k++) {
        const float *x = w + k * bv;
        uint8_t *o = out + k * bytes;
        if (fmt == Q5_0 || fmt == Q5_1) quantize_q5(x, o, fmt == Q5_1);
        else if (fmt == Q4_K || fmt == Q5_K) quantize_k45(x, o, fmt == Q5_K);
        else if (fmt == Q6_K) quantize_q6_k(x, o);
        else quantize_block(fmt, x, o);
    }
    return 0;
}
