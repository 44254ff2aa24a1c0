/* quant_linear.c's weights packed in groups of 8 rows (fmt | X8, quant_blocks.h: every format it computes):
 * each group's blocks interleaved so that one 32-byte chunk holds the same block of 8 rows, met
 * by every row of quantized x before the next (group_out), and in the avx512 build, from 4 rows
 * of x, two groups at a time in zmm (group2_out). quant_linear.c quantizes x and calls
 * hw_quant_groups; the arithmetic is its rows path's (same integers, same float epilogue). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "quant_blocks.h"

/* ---- rows packed in groups of 8 (fmt | X8: quant_blocks.h) ---- */

/* A thread reads its groups as one stream; asking for the bytes ~2 KiB ahead (one software
 * prefetch per 64-byte line) beat the hardware prefetcher alone when the weights come from DRAM:
 * 100 Q4_1 3072 x 576 matrices (110 MB) at 1 row of x, 1 thread, AMD EPYC: 11.4 -> 8.6 ms mean
 * (1280 and 2560 bytes ahead alike; 640: less). Past the end of the weight it is a no-op. */
int hw_qpf_ahead = 2048;  /* bytes; set at load per core by kernels/__init__.py (quant_prefetch_ahead_for:
                           * 8192 on AMD Zen 5, benchmarks/prefetch.py --quant) */
/* From how many rows of x the avx512 build reads two packed groups at once in zmm tiles (group2_out,
 * below; unused in the avx2 build): set at load per core by kernels/__init__.py
 * (kernels.cpu.zmm_min_rows_for). 4 where tuned (Zen 4 / 5); 1 on Intel, where a 7B-shaped model's
 * batch-1 decode from DRAM went 4.42 -> 4.84 tok/s (its weights stream faster through two groups'
 * 16-lane tiles than one's 8) and SmolLM2's lost nothing. */
int hw_zmm_min_rows = 4;
/* Rows of x per pass over a packed group: the avx512 build's 32 vector registers hold 8 int sums +
 * 8 accumulators (each group's nibbles unpacked half as often: SmolLM2's 30 Q4_1 layers + the Q8_0
 * head at 16 rows, 2 threads, AMD EPYC Zen 4: 16.8 -> 15.7 ms, 8 rows 10.0 -> 9.0, the same bits);
 * AVX2's 16 hold 4 + 4. */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define GMC 8
#else
#define GMC 4
#endif

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

/* 8 packed rows against MC (1..GMC) rows of quantized x: out[m] lane r = row r's output. The
 * weight chunks are loaded one at a time and met by every row of x before the next, so the
 * registers hold 2 chunks, MC int16 sums and MC accumulators (no spills at MC = GMC). Q5_0 / Q5_1:
 * Q4_0's / Q4_1's with each value's fifth bit from the group's first chunk (values 0..31: in
 * AVX2's int16 sums 8 pair sums could pass 2^15, so there each chunk's two go to int32 at once). */
static inline __attribute__((always_inline)) void group_tile(int fmt, int MC, const uint8_t *grp, long nb,
                                                             const int8_t *qx, const float *dx, const float *sx,
                                                             long I, __m256 out[GMC]) {
    const int five = fmt == Q5_0 || fmt == Q5_1;
    const long gb = 8 * block_bytes(fmt), h = 8 * hdr_bytes(fmt) + (five ? 32 : 0);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = grp + b * gb;
        const int8_t *xb = qx + b * QK;
        for (long o = 0; o < gb; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        __m256i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm256_setzero_si256();
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + h - 32)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + h + 32 * c));
            __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            if (five) lo = _mm256_or_si256(lo, fifth_bits(qh, c, 0)), hi = _mm256_or_si256(hi, fifth_bits(qh, c, 1));
            for (int m = 0; m < MC; m++) {
                int32_t a, z;
                memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + 16 + 4 * c, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)  /* the same integers, summed in int32 directly */
                sum[m] = _mm256_dpbusd_epi32(sum[m], lo, _mm256_set1_epi32(a));
                sum[m] = _mm256_dpbusd_epi32(sum[m], hi, _mm256_set1_epi32(z));
#else
                const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                                      _mm256_maddubs_epi16(hi, _mm256_set1_epi32(z)));
                sum[m] = five ? _mm256_add_epi32(sum[m], _mm256_madd_epi16(pair, _mm256_set1_epi16(1)))
                              : _mm256_add_epi16(sum[m], pair);
#endif
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 mw = fmt == Q4_1 || fmt == Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))
                                                     : _mm256_mul_ps(dw, _mm256_set1_ps(fmt == Q5_0 ? -16.0f : -8.0f));
        for (int m = 0; m < MC; m++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            const __m256 f = _mm256_cvtepi32_ps(sum[m]);
#else
            const __m256 f = _mm256_cvtepi32_ps(five ? sum[m] : _mm256_madd_epi16(sum[m], _mm256_set1_epi16(1)));
#endif
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)), f, acc[m]);
            acc[m] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(sx + m * nb + b), acc[m]);
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Q8_0's groups: 8 chunks of 4 signed values a row; the sign trick per chunk, whose pairs (up to
 * 2 x 128 x 127) need an int32 sum each. */
static inline __attribute__((always_inline)) void group_tile_q8(int MC, const uint8_t *grp, long nb, const int8_t *qx,
                                                                const float *dx, long I, __m256 out[GMC]) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;  /* unused with VNNI */
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = grp + b * 8 * 34;
        for (long o = 0; o < 8 * 34; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        __m256i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c)), a = _mm256_abs_epi8(v);
            for (int m = 0; m < MC; m++) {
                int32_t x4;
                memcpy(&x4, qx + m * I + b * QK + 4 * c, 4);
                const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x4), v);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                sum[m] = _mm256_dpbusd_epi32(sum[m], a, sx);
#else
                sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), ones));
#endif
            }
        }
        for (int m = 0; m < MC; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)),
                                     _mm256_cvtepi32_ps(sum[m]), acc[m]);
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* tile(MC, ...) for MC = mc (1 .. GMC), each MC a constant the compiler unrolls for. */
#if GMC > 4
#define TILE_MC_WIDE(tile, ...)                              \
        case 4: tile(4, __VA_ARGS__); break;                 \
        case 5: tile(5, __VA_ARGS__); break;                 \
        case 6: tile(6, __VA_ARGS__); break;                 \
        case 7: tile(7, __VA_ARGS__); break;
#else
#define TILE_MC_WIDE(tile, ...)
#endif
#define TILE_MC(tile, mc, ...)                               \
    switch (mc) {                                            \
        case 1: tile(1, __VA_ARGS__); break;                 \
        case 2: tile(2, __VA_ARGS__); break;                 \
        case 3: tile(3, __VA_ARGS__); break;                 \
        TILE_MC_WIDE(tile, __VA_ARGS__)                      \
        default: tile(GMC, __VA_ARGS__); break;              \
    }
/* group_tile's fmt comes first: one constant format per tile function */
#define TILE_Q4_0(MC, ...) group_tile(Q4_0, MC, __VA_ARGS__)
#define TILE_Q4_1(MC, ...) group_tile(Q4_1, MC, __VA_ARGS__)
#define TILE_Q5_0(MC, ...) group_tile(Q5_0, MC, __VA_ARGS__)
#define TILE_Q5_1(MC, ...) group_tile(Q5_1, MC, __VA_ARGS__)
#define TILE_Q4_K(MC, ...) group_tile_k4(0, MC, __VA_ARGS__)
#define TILE_Q5_K(MC, ...) group_tile_k4(1, MC, __VA_ARGS__)

/* Q4_K's groups: per super-block the 8 rows' d and dmin, their 12 bytes of 6-bit scales and mins
 * as 3 chunks (dword lane r = row r's bytes 4c .. 4c + 3), then 32 chunks of quants: chunk 8 k + c
 * holds each row's bytes 32 k + 4 c .. + 3, whose low nibbles are values 4 c .. of sub-block 2 k
 * and high nibbles those of sub-block 2 k + 1. Sub-block j's scale and min for the 8 rows are
 * ggml's get_scale_min_k4 on the lanes at once; w = (d sc_j) q - dmin mn_j, the rows path's.
 * Q5_K (five = 1): the same, with 8 chunks of qh between the scales and the quants: chunk c holds
 * each row's qh bytes 4 c .. 4 c + 3, whose bit j is the fifth bit of value 4 c .. of sub-block j. */
static inline __m256i lane_byte(__m256i v, int k) {  /* byte k of each dword lane, as int32 */
    return _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(0xFF));
}
static inline __attribute__((always_inline)) void group_tile_k4(int five, int MC, const uint8_t *grp, long nsb,
                                                                const int8_t *qx, const float *dx, const float *sx,
                                                                long I, __m256 out[GMC]) {
    const long nb = I / QK, bb = five ? 176 : 144;
    const __m256i mask = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(0x0F);
    const __m256i bit = _mm256_set1_epi8(0x01);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p = grp + s * 8 * bb;
        for (long o = 0; o < 8 * bb; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)(p + 32)),
                      s1 = _mm256_loadu_si256((const __m256i *)(p + 64)),
                      s2 = _mm256_loadu_si256((const __m256i *)(p + 96));
        const uint8_t *q = p + (five ? 384 : 128), *qh = p + 128;  /* Q5_K: 8 chunks of fifth bits first */
        for (int k = 0; k < 4; k++) {
            __m256 dw[2], mw[2];
            for (int h = 0; h < 2; h++) {  /* sub-block j = 2 k + h */
                const int j = 2 * k + h;
                __m256i sc, mn;
                if (j < 4) {
                    sc = _mm256_and_si256(lane_byte(s0, j), m6), mn = _mm256_and_si256(lane_byte(s1, j), m6);
                } else {
                    const __m256i lo = lane_byte(s2, j - 4);
                    sc = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi32(_mm256_srli_epi32(lane_byte(s0, j - 4), 6), 4));
                    mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4), _mm256_slli_epi32(_mm256_srli_epi32(lane_byte(s1, j - 4), 6), 4));
                }
                dw[h] = rounded8(_mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
                mw[h] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)));
            }
            __m256i sum[2][GMC];
            for (int m = 0; m < MC; m++) sum[0][m] = sum[1][m] = _mm256_setzero_si256();
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
            __m256i sum32[2][GMC];
            for (int m = 0; m < MC; m++) sum32[0][m] = sum32[1][m] = _mm256_setzero_si256();
#endif
            const int8_t *xb = qx + (s * 8 + 2 * k) * QK;
            for (int c = 0; c < 8; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + (8 * k + c) * 32));
                __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                if (five) {  /* values 4 c .. of sub-blocks 2 k, 2 k + 1: bits 2 k, 2 k + 1 of qh bytes 4 c .. */
                    const __m256i h = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qh + c * 32)), 2 * k);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, bit), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), bit), 4));
                }
                for (int m = 0; m < MC; m++) {
                    int32_t a, z;
                    memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + QK + 4 * c, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    sum[0][m] = _mm256_dpbusd_epi32(sum[0][m], lo, _mm256_set1_epi32(a));
                    sum[1][m] = _mm256_dpbusd_epi32(sum[1][m], hi, _mm256_set1_epi32(z));
#else  /* Q4_K: 8 pair sums of at most 2 x 15 x 127 each stay within int16; Q5_K's (2 x 31 x 127) do
        * for 4 chunks: the first 4 go to int32 before the next 4 add */
                    if (five && c == 4) {
                        sum[0][m] = _mm256_madd_epi16(sum[0][m], _mm256_set1_epi16(1));
                        sum[1][m] = _mm256_madd_epi16(sum[1][m], _mm256_set1_epi16(1));
                        sum32[0][m] = sum[0][m], sum32[1][m] = sum[1][m];
                        sum[0][m] = sum[1][m] = _mm256_setzero_si256();
                    }
                    sum[0][m] = _mm256_add_epi16(sum[0][m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
                    sum[1][m] = _mm256_add_epi16(sum[1][m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(z)));
#endif
                }
            }
            for (int h = 0; h < 2; h++) {
                const long b = s * 8 + 2 * k + h;
                for (int m = 0; m < MC; m++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    const __m256 f = _mm256_cvtepi32_ps(sum[h][m]);
#else
                    const __m256 f = _mm256_cvtepi32_ps(
                        _mm256_add_epi32(sum32[h][m], _mm256_madd_epi16(sum[h][m], _mm256_set1_epi16(1))));
#endif
                    acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw[h], _mm256_broadcast_ss(dx + m * nb + b)), f, acc[m]);
                    acc[m] = _mm256_fmadd_ps(mw[h], _mm256_broadcast_ss(sx + m * nb + b), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Q6_K's groups: per super-block the 8 rows' d, then the block's other bytes as chunks (8 rows x 4
 * bytes): 32 of ql, 16 of qh, 4 of the 16 int8 scales. Sub-block j's values 4 c .. 4 c + 3 are ql
 * chunk 16 (j / 4) + 8 (j % 2) + c shifted by 4 ((j % 4) / 2) and qh chunk 32 + 8 (j / 4) + c
 * shifted by 2 (j % 4) (the rows path's unpack), minus 32. Signed weights: the sign trick, each
 * 16-value half's sum times its scale in integers (AVX2: 4 pair sums <= 4 x 2 x 32 x 127 < 2^15). */
static inline __attribute__((always_inline)) void group_tile_q6k(int MC, const uint8_t *grp, long nsb,
                                                                 const int8_t *qx, const float *dx, long I,
                                                                 __m256 out[GMC]) {
    const long nb = I / QK;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), k32 = _mm256_set1_epi8(32);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p = grp + s * 8 * 210, *ch = p + 16;
        for (long o = 0; o < 8 * 210; o += 64) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        for (int j = 0; j < 8; j++) {
            const int cq = 16 * (j / 4) + 8 * (j % 2), chh = 32 + 8 * (j / 4), sl = 4 * ((j % 4) / 2), sh = 2 * (j % 4);
            const __m256i scs = _mm256_loadu_si256((const __m256i *)(ch + 32 * (48 + j / 2)));
            const int k0 = 2 * (j % 2);  /* the two scales' bytes in each lane, sign-extended */
            const __m256i sc0 = _mm256_srai_epi32(_mm256_slli_epi32(scs, 24 - 8 * k0), 24),
                          sc1 = _mm256_srai_epi32(_mm256_slli_epi32(scs, 16 - 8 * k0), 24);
            const int8_t *xb = qx + (s * 8 + j) * QK;
            __m256i sum[2][GMC];
            for (int m = 0; m < MC; m++) sum[0][m] = sum[1][m] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(ch + 32 * (cq + c)));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(ch + 32 * (chh + c)));
                const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, sl), m4),
                                                  _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, sh), m2), 4));
                const __m256i w = _mm256_sub_epi8(q, k32), aw = _mm256_abs_epi8(w);
                for (int m = 0; m < MC; m++) {
                    int32_t a;
                    memcpy(&a, xb + m * I + 4 * c, 4);
                    const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(a), w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    sum[c / 4][m] = _mm256_dpbusd_epi32(sum[c / 4][m], aw, sx);
#else
                    sum[c / 4][m] = _mm256_add_epi16(sum[c / 4][m], _mm256_maddubs_epi16(aw, sx));
#endif
                }
            }
            for (int m = 0; m < MC; m++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                const __m256i s0 = sum[0][m], s1 = sum[1][m];
#else
                const __m256i s0 = _mm256_madd_epi16(sum[0][m], _mm256_set1_epi16(1)),
                              s1 = _mm256_madd_epi16(sum[1][m], _mm256_set1_epi16(1));
#endif
                const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1));
                acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(dx + m * nb + s * 8 + j)),
                                         _mm256_cvtepi32_ps(t), acc[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
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

/* Outputs [8 g, 8 g + 8) (those below O) of packed group g for all M rows, plus bias and residual. */
static void group_out(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                      const float *b, const float *r, float *y, long M, long O, long I, long g) {
    const long nb = I / QK, o = 8 * g, n = O - o < 8 ? O - o : 8;
    const uint8_t *grp = w + g * (I / block_values(fmt)) * 8 * block_bytes(fmt);
    for (long m0 = 0; m0 < M; m0 += GMC) {
        const long mc = M - m0 < GMC ? M - m0 : GMC;
        __m256 out[GMC];
        const int8_t *q = qx + m0 * I;
        const float *d = dx + m0 * nb, *s = sx + m0 * nb;
        switch (fmt) {
            case Q8_0: TILE_MC(group_tile_q8, mc, grp, nb, q, d, I, out) break;
            case Q4_1: TILE_MC(TILE_Q4_1, mc, grp, nb, q, d, s, I, out) break;
            case Q5_0: TILE_MC(TILE_Q5_0, mc, grp, nb, q, d, s, I, out) break;
            case Q5_1: TILE_MC(TILE_Q5_1, mc, grp, nb, q, d, s, I, out) break;
            case Q4_K: TILE_MC(TILE_Q4_K, mc, grp, I / QK_K, q, d, s, I, out) break;
            case Q5_K: TILE_MC(TILE_Q5_K, mc, grp, I / QK_K, q, d, s, I, out) break;
            case Q6_K: TILE_MC(group_tile_q6k, mc, grp, I / QK_K, q, d, I, out) break;
            default: TILE_MC(TILE_Q4_0, mc, grp, nb, q, d, s, I, out) break;
        }
        for (long m = 0; m < mc; m++) {
            float t[8];
            _mm256_storeu_ps(t, out[m]);
            store_row(t, n, b, r, y, m0 + m, O, o);
        }
    }
}
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Two packed groups (16 outputs) at once in 16-wide vectors, from hw_zmm_min_rows rows of x: per chunk the two
 * groups' 32 bytes joined into one zmm, so each broadcast of x feeds one dpbusd for 16 rows where
 * group_tile's ymm gives 8. Where the core has full-width 512-bit units (AMD Zen 5, Xeon
 * Gold/Platinum) that is twice the work per instruction; a batch-1 step stays on group_tile
 * (memory-bound there) except where hw_zmm_min_rows is 1 (Intel: these tiles stream faster). Same integers, the same float epilogue per block, per output lane. The
 * K-quants too (group2_tile_k4, group2_tile_q6k): on Zen 5, a Llama-7B-shaped matrix at 128-512 rows
 * of x, Q4_K 277-410 -> 559-738 GFLOP/s, Q6_K 177-205 -> 281-325. */
static inline __m512i join_si(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline __m512 join_ph(const uint8_t *a, const uint8_t *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), 1);
}
static inline __attribute__((always_inline)) void group2_tile(int fmt, int MC, const uint8_t *g0, const uint8_t *g1,
                                                              long nb, const int8_t *qx, const float *dx,
                                                              const float *sx, long I, __m512 out[GMC]) {
    const int five = fmt == Q5_0 || fmt == Q5_1;
    const long gb = 8 * block_bytes(fmt), h = 8 * hdr_bytes(fmt) + (five ? 32 : 0);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p0 = g0 + b * gb, *p1 = g1 + b * gb;
        const int8_t *xb = qx + b * QK;
        for (long o = 0; o < gb; o += 64) {
            _mm_prefetch((const char *)(p0 + ahead + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + ahead + o), _MM_HINT_T0);
        }
        __m512i sum[GMC];
        for (int m = 0; m < MC; m++) sum[m] = _mm512_setzero_si512();
        if (fmt == Q8_0) {  /* |w| against x with w's sign (AVX-512 has no vpsignb: negate where w < 0) */
            for (int c = 0; c < 8; c++) {
                const __m512i v = join_si(p0 + 16 + 32 * c, p1 + 16 + 32 * c), a = _mm512_abs_epi8(v);
                const __mmask64 neg = _mm512_movepi8_mask(v);
                for (int m = 0; m < MC; m++) {
                    int32_t x4;
                    memcpy(&x4, xb + m * I + 4 * c, 4);
                    const __m512i xv = _mm512_set1_epi32(x4);
                    sum[m] = _mm512_dpbusd_epi32(sum[m], a, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
                }
            }
        } else {
            const __m256i qh0 = five ? _mm256_loadu_si256((const __m256i *)(p0 + h - 32)) : _mm256_setzero_si256(),
                          qh1 = five ? _mm256_loadu_si256((const __m256i *)(p1 + h - 32)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m512i v = join_si(p0 + h + 32 * c, p1 + h + 32 * c);
                __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                if (five) {  /* the fifth bits of each group (group_tile's), joined */
                    lo = _mm512_or_si512(lo, _mm512_inserti64x4(_mm512_castsi256_si512(fifth_bits(qh0, c, 0)),
                                                                fifth_bits(qh1, c, 0), 1));
                    hi = _mm512_or_si512(hi, _mm512_inserti64x4(_mm512_castsi256_si512(fifth_bits(qh0, c, 1)),
                                                                fifth_bits(qh1, c, 1), 1));
                }
                for (int m = 0; m < MC; m++) {
                    int32_t a, z;
                    memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + 16 + 4 * c, 4);
                    sum[m] = _mm512_dpbusd_epi32(sum[m], lo, _mm512_set1_epi32(a));
                    sum[m] = _mm512_dpbusd_epi32(sum[m], hi, _mm512_set1_epi32(z));
                }
            }
        }
        const __m512 dw = join_ph(p0, p1);
        if (fmt == Q8_0) {
            for (int m = 0; m < MC; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), _mm512_cvtepi32_ps(sum[m]),
                                         acc[m]);
        } else {
            const __m512 mw = fmt == Q4_1 || fmt == Q5_1 ? join_ph(p0 + 16, p1 + 16)
                                                         : _mm512_mul_ps(dw, _mm512_set1_ps(fmt == Q5_0 ? -16.0f : -8.0f));
            for (int m = 0; m < MC; m++) {
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), _mm512_cvtepi32_ps(sum[m]),
                                         acc[m]);
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

static inline __m512 rounded16(__m512 v) {  /* as quant_blocks.h's rounded8: no FMA with what follows */
    __asm__("" : "+v"(v));
    return v;
}
static inline __m512i lane_byte16(__m512i v, int k) { /* byte k of each dword lane, as int32 */
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xFF));
}

/* group_tile_k4 on two groups at once (16 rows in zmm lanes): each lane the ymm tile's integers and
 * float epilogue, in its order. */
static inline __attribute__((always_inline)) void group2_tile_k4(int five, int MC, const uint8_t *g0,
                                                                 const uint8_t *g1, long nsb, const int8_t *qx,
                                                                 const float *dx, const float *sx, long I,
                                                                 __m512 out[GMC]) {
    const long nb = I / QK, bb = five ? 176 : 144;
    const __m512i mask = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(0x0F);
    const __m512i bit = _mm512_set1_epi8(0x01);
    __m512 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p0 = g0 + s * 8 * bb, *p1 = g1 + s * 8 * bb;
        for (long o = 0; o < 8 * bb; o += 64) {
            _mm_prefetch((const char *)(p0 + ahead + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + ahead + o), _MM_HINT_T0);
        }
        const __m512 d = join_ph(p0, p1), dmin = join_ph(p0 + 16, p1 + 16);
        const __m512i s0 = join_si(p0 + 32, p1 + 32), s1 = join_si(p0 + 64, p1 + 64), s2 = join_si(p0 + 96, p1 + 96);
        const long qo = five ? 384 : 128;
        for (int k = 0; k < 4; k++) {
            __m512 dw[2], mw[2];
            for (int h = 0; h < 2; h++) {  /* sub-block j = 2 k + h */
                const int j = 2 * k + h;
                __m512i sc, mn;
                if (j < 4) {
                    sc = _mm512_and_si512(lane_byte16(s0, j), m6), mn = _mm512_and_si512(lane_byte16(s1, j), m6);
                } else {
                    const __m512i lo = lane_byte16(s2, j - 4);
                    sc = _mm512_or_si512(_mm512_and_si512(lo, m4),
                                         _mm512_slli_epi32(_mm512_srli_epi32(lane_byte16(s0, j - 4), 6), 4));
                    mn = _mm512_or_si512(_mm512_srli_epi32(lo, 4),
                                         _mm512_slli_epi32(_mm512_srli_epi32(lane_byte16(s1, j - 4), 6), 4));
                }
                dw[h] = rounded16(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
                mw[h] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
            }
            __m512i sum[2][GMC];
            for (int m = 0; m < MC; m++) sum[0][m] = sum[1][m] = _mm512_setzero_si512();
            const int8_t *xb = qx + (s * 8 + 2 * k) * QK;
            const __m128i sh = _mm_cvtsi32_si128(2 * k);
            for (int c = 0; c < 8; c++) {
                const __m512i v = join_si(p0 + qo + (8 * k + c) * 32, p1 + qo + (8 * k + c) * 32);
                __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                if (five) {  /* values 4 c .. of sub-blocks 2 k, 2 k + 1: bits 2 k, 2 k + 1 of qh bytes 4 c .. */
                    const __m512i h = _mm512_srl_epi16(join_si(p0 + 128 + c * 32, p1 + 128 + c * 32), sh);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(h, bit), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 1), bit), 4));
                }
                for (int m = 0; m < MC; m++) {
                    int32_t a, z;
                    memcpy(&a, xb + m * I + 4 * c, 4), memcpy(&z, xb + m * I + QK + 4 * c, 4);
                    sum[0][m] = _mm512_dpbusd_epi32(sum[0][m], lo, _mm512_set1_epi32(a));
                    sum[1][m] = _mm512_dpbusd_epi32(sum[1][m], hi, _mm512_set1_epi32(z));
                }
            }
            for (int h = 0; h < 2; h++) {
                const long b = s * 8 + 2 * k + h;
                for (int m = 0; m < MC; m++) {
                    const __m512 f = _mm512_cvtepi32_ps(sum[h][m]);
                    acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw[h], _mm512_set1_ps(dx[m * nb + b])), f, acc[m]);
                    acc[m] = _mm512_fmadd_ps(mw[h], _mm512_set1_ps(sx[m * nb + b]), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* group_tile_q6k on two groups at once, as group2_tile_k4 is group_tile_k4's. */
static inline __attribute__((always_inline)) void group2_tile_q6k(int MC, const uint8_t *g0, const uint8_t *g1,
                                                                  long nsb, const int8_t *qx, const float *dx,
                                                                  long I, __m512 out[GMC]) {
    const long nb = I / QK;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03), k32 = _mm512_set1_epi8(32);
    __m512 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();
    const long ahead = hw_qpf_ahead;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p0 = g0 + s * 8 * 210, *p1 = g1 + s * 8 * 210, *c0 = p0 + 16, *c1 = p1 + 16;
        for (long o = 0; o < 8 * 210; o += 64) {
            _mm_prefetch((const char *)(p0 + ahead + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(p1 + ahead + o), _MM_HINT_T0);
        }
        const __m512 d = join_ph(p0, p1);
        for (int j = 0; j < 8; j++) {
            const int cq = 16 * (j / 4) + 8 * (j % 2), chh = 32 + 8 * (j / 4);
            const __m128i sl = _mm_cvtsi32_si128(4 * ((j % 4) / 2)), sh = _mm_cvtsi32_si128(2 * (j % 4));
            const __m512i scs = join_si(c0 + 32 * (48 + j / 2), c1 + 32 * (48 + j / 2));
            const int k0 = 2 * (j % 2);  /* the two scales' bytes in each lane, sign-extended */
            const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(scs, 24 - 8 * k0), 24),
                          sc1 = _mm512_srai_epi32(_mm512_slli_epi32(scs, 16 - 8 * k0), 24);
            const int8_t *xb = qx + (s * 8 + j) * QK;
            __m512i sum[2][GMC];
            for (int m = 0; m < MC; m++) sum[0][m] = sum[1][m] = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                const __m512i ql = join_si(c0 + 32 * (cq + c), c1 + 32 * (cq + c));
                const __m512i qh = join_si(c0 + 32 * (chh + c), c1 + 32 * (chh + c));
                const __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi16(ql, sl), m4),
                                                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(qh, sh), m2), 4));
                const __m512i w = _mm512_sub_epi8(q, k32), aw = _mm512_abs_epi8(w);
                const __mmask64 neg = _mm512_movepi8_mask(w);
                for (int m = 0; m < MC; m++) {
                    int32_t a;
                    memcpy(&a, xb + m * I + 4 * c, 4);
                    const __m512i xv = _mm512_set1_epi32(a);
                    sum[c / 4][m] = _mm512_dpbusd_epi32(sum[c / 4][m], aw,
                                                        _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
                }
            }
            for (int m = 0; m < MC; m++) {
                const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(sum[0][m], sc0), _mm512_mullo_epi32(sum[1][m], sc1));
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[m * nb + s * 8 + j])),
                                         _mm512_cvtepi32_ps(t), acc[m]);
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

#define TILE2_Q4_K(MC, ...) group2_tile_k4(0, MC, __VA_ARGS__)
#define TILE2_Q5_K(MC, ...) group2_tile_k4(1, MC, __VA_ARGS__)
#define TILE2_Q6_K(MC, g0, g1, nsb, qx, dx, sx, I, out) group2_tile_q6k(MC, g0, g1, nsb, qx, dx, I, out)
#define GROUP2_MC_K(tile, mc, ...)                      \
    switch (mc) {                                       \
        case 1: tile(1, __VA_ARGS__); break;            \
        case 2: tile(2, __VA_ARGS__); break;            \
        case 3: tile(3, __VA_ARGS__); break;            \
        case 4: tile(4, __VA_ARGS__); break;            \
        case 5: tile(5, __VA_ARGS__); break;            \
        case 6: tile(6, __VA_ARGS__); break;            \
        case 7: tile(7, __VA_ARGS__); break;            \
        default: tile(GMC, __VA_ARGS__); break;         \
    }

#define GROUP2_MC(F, mc, ...)                                \
    switch (mc) {                                            \
        case 1: group2_tile(F, 1, __VA_ARGS__); break;       \
        case 2: group2_tile(F, 2, __VA_ARGS__); break;       \
        case 3: group2_tile(F, 3, __VA_ARGS__); break;       \
        case 4: group2_tile(F, 4, __VA_ARGS__); break;       \
        case 5: group2_tile(F, 5, __VA_ARGS__); break;       \
        case 6: group2_tile(F, 6, __VA_ARGS__); break;       \
        case 7: group2_tile(F, 7, __VA_ARGS__); break;       \
        default: group2_tile(F, GMC, __VA_ARGS__); break;    \
    }

/* Outputs [8 g, 8 g + 16) (those below O) of packed groups g and g + 1 for all M rows, plus bias and residual. */
static void group2_out(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx,
                       const float *b, const float *r, float *y, long M, long O, long I, long g) {
    const long nb = I / QK, o = 8 * g, n = O - o < 16 ? O - o : 16, nblk = I / block_values(fmt);
    const uint8_t *g0 = w + g * nblk * 8 * block_bytes(fmt), *g1 = g0 + nblk * 8 * block_bytes(fmt);
    for (long m0 = 0; m0 < M; m0 += GMC) {
        const long mc = M - m0 < GMC ? M - m0 : GMC;
        __m512 out[GMC];
        if (fmt == Q4_K) {
            GROUP2_MC_K(TILE2_Q4_K, mc, g0, g1, nblk, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q5_K) {
            GROUP2_MC_K(TILE2_Q5_K, mc, g0, g1, nblk, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q6_K) {
            GROUP2_MC_K(TILE2_Q6_K, mc, g0, g1, nblk, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q8_0) {
            GROUP2_MC(Q8_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q4_1) {
            GROUP2_MC(Q4_1, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q5_0) {
            GROUP2_MC(Q5_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else if (fmt == Q5_1) {
            GROUP2_MC(Q5_1, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        } else {
            GROUP2_MC(Q4_0, mc, g0, g1, nb, qx + m0 * I, dx + m0 * nb, sx + m0 * nb, I, out)
        }
        for (long m = 0; m < mc; m++) {
            float t[16];
            _mm512_storeu_ps(t, out[m]);
            store_row(t, n, b, r, y, m0 + m, O, o);
        }
    }
}
#define HAVE_GROUP2 1
#endif

void hw_quant_groups(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, const float *b,
                     const float *r, float *y, long M, long O, long I, int par) {
    const long ng = (O + 7) / 8;
#ifdef HAVE_GROUP2
    if (M >= hw_zmm_min_rows) {
        #pragma omp parallel for schedule(static) if (par)
        for (long q = 0; q < (ng + 1) / 2; q++) {
            if (2 * q + 1 < ng) group2_out(fmt, w, qx, dx, sx, b, r, y, M, O, I, 2 * q);
            else group_out(fmt, w, qx, dx, sx, b, r, y, M, O, I, 2 * q);
        }
        return;
    }
#endif
    #pragma omp parallel for schedule(static) if (par)
    for (long g = 0; g < ng; g++) group_out(fmt, w, qx, dx, sx, b, r, y, M, O, I, g);
}
