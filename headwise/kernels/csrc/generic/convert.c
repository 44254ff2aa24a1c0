/* GGML blocks <-> fp32 and the packed rows (quant_formats.h has the layouts; issue 14), the parts
 * that are the same in every variant: hw_repack8 packs rows in the groups of 8 that quant_group.c
 * reads fastest, or back; hw_dequantize writes the fp32 matrix (prefill runs a fp32 GEMM on it)
 * from rows or groups (x86/avx2/dequantize.c unpacks the blocks); hw_quantize makes blocks from
 * fp32, bit for bit what ggml's reference code (and the gguf package's numpy port) computes:
 * Q4_0 / Q4_1 / Q5_0 / Q5_1 here, scalar; Q8_0 (x86/avx2/quantize.c) and the K-quants' reference
 * search (x86/avx2/quantize_k.c) in vectors whose lanes compute what the scalar reference does. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_formats.h"

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

/* ---- dequantize: blocks -> fp32 ---- */

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
                hw_dequantize_row(fmt, row, o, I);
            }
            free(rows);
        }
        return rc;
    }
    #pragma omp parallel for schedule(static) if (O * I >= (1L << 16))
    for (long o = 0; o < O; o++) {
        hw_dequantize_row(fmt, w + o * row_bytes, out + o * I, I);
    }
    return 0;
}

/* ---- quantize: fp32 -> blocks, ggml's reference quantizers ---- */

/* quantize_row_q4_0_ref / quantize_row_q4_1_ref (fmt Q4_1). */
static void quantize_q4(int fmt, const float *x, uint8_t *out) {
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
        else if (fmt == Q4_K || fmt == Q5_K) hw_quantize_q4_k(x, o, fmt == Q5_K);
        else if (fmt == Q6_K) hw_quantize_q6_k(x, o);
        else if (fmt == Q8_0) hw_quantize_q8_0(x, o);
        else quantize_q4(fmt, x, o);
    }
    return 0;
}
