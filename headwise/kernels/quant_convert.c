/* GGML blocks <-> fp32 and the packed rows (quant_blocks.h has the layouts; issue 14):
 * hw_dequantize writes the fp32 matrix (prefill runs a fp32 GEMM on it), hw_quantize makes
 * Q8_0 / Q4_0 / Q4_1 blocks from fp32 (int8 / int4 at load time), both bit for bit what ggml's
 * reference code (and the gguf package's numpy port) computes, and hw_repack8 packs Q4_0 / Q4_1 /
 * Q8_0 rows in the groups of 8 that quant_linear.c reads fastest, or back. */
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
        } else if (fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K) {  /* dw q + m; Q4_K's m = -(dmin mn): (d sc) q - dmin mn */
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

int hw_quantize(int fmt, const float *w, uint8_t *out, long O, long I) {
    if (fmt != Q4_0 && fmt != Q4_1 && fmt != Q8_0) return ERR_FORMAT;
    if (O < 1 || I < 1 || I % QK) return ERR_SHAPE;
    const long nb = O * (I / QK), bytes = block_bytes(fmt);
    #pragma omp parallel for schedule(static) if (O * I >= (1L << 16))
    for (long k = 0; k < nb; k++) quantize_block(fmt, w + k * QK, out + k * bytes);
    return 0;
}
