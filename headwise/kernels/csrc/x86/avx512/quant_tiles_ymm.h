/* The avx512 variant's ymm tiles on packed groups of 8 rows (x86/avx2/quant_group.c has the layout):
 * 8 rows of x a pass (AVX-512's 32 registers), the products summed in int32 by VNNI's dpbusd (the
 * same integers as the avx2 variant's maddubs pairs). quant_group.c runs them on one group at a
 * time, below hw_zmm_min_rows rows of x and on a matrix's last odd group. */
#ifndef HW_AVX512_QUANT_TILES_YMM_H
#define HW_AVX512_QUANT_TILES_YMM_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../../generic/kernels.h"
#include "../avx2/quant_unpack.h"
#include "../avx2/quant_x8.h"

/* Rows of x per pass over a packed group: the avx512 variant's 32 vector registers hold 8 int sums +
 * 8 accumulators (each group's nibbles unpacked half as often: SmolLM2's 30 Q4_1 layers + the Q8_0
 * head at 16 rows, 2 threads, AMD EPYC Zen 4: 16.8 -> 15.7 ms, 8 rows 10.0 -> 9.0, the same bits);
 * AVX2's 16 hold 4 + 4. */
#define GMC 8

/* One weight line `ahead` bytes on: non-temporally where hw_qpf_nta says (generic/quant_linear.c). */
static inline __attribute__((always_inline)) void prefetch_weight(const uint8_t *p, int nta) {
    if (nta) _mm_prefetch((const char *)p, _MM_HINT_NTA);
    else _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* 8 packed rows against MC (1..GMC) rows of quantized x: out[m] lane r = row r's output. The
 * weight chunks are loaded one at a time and met by every row of x before the next, so the
 * registers hold 2 chunks, MC int32 sums and MC accumulators (no spills at MC = GMC). Q5_0 / Q5_1:
 * Q4_0's / Q4_1's with each value's fifth bit from the group's first chunk. */
static inline __attribute__((always_inline)) void tile_q4q5_8x8_q8_ymm(int fmt, int MC, const uint8_t *grp, long nb,
                                                                       const int8_t *qx, const float *dx,
                                                                       const float *sx, long I, __m256 out[GMC]) {
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
                sum[m] = _mm256_dpbusd_epi32(sum[m], lo, _mm256_set1_epi32(a));
                sum[m] = _mm256_dpbusd_epi32(sum[m], hi, _mm256_set1_epi32(z));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 mw = fmt == Q4_1 || fmt == Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))
                                                     : _mm256_mul_ps(dw, _mm256_set1_ps(fmt == Q5_0 ? -16.0f : -8.0f));
        for (int m = 0; m < MC; m++) {
            const __m256 f = _mm256_cvtepi32_ps(sum[m]);
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)), f, acc[m]);
            acc[m] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(sx + m * nb + b), acc[m]);
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Q8_0's groups: 8 chunks of 4 signed values a row; the sign trick per chunk, whose pairs (up to
 * 2 x 128 x 127) need an int32 sum each. */
static inline __attribute__((always_inline)) void tile_q8_0_8x8_q8_ymm(int MC, const uint8_t *grp, long nb,
                                                                       const int8_t *qx, const float *dx, long I,
                                                                       __m256 out[GMC]) {
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
                sum[m] = _mm256_dpbusd_epi32(sum[m], a, sx);
            }
        }
        for (int m = 0; m < MC; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + m * nb + b)),
                                     _mm256_cvtepi32_ps(sum[m]), acc[m]);
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

/* Q4_K's groups: per super-block the 8 rows' d and dmin, their 12 bytes of 6-bit scales and mins
 * as 3 chunks (dword lane r = row r's bytes 4c .. 4c + 3), then 32 chunks of quants: chunk 8 k + c
 * holds each row's bytes 32 k + 4 c .. + 3, whose low nibbles are values 4 c .. of sub-block 2 k
 * and high nibbles those of sub-block 2 k + 1. Sub-block j's scale and min for the 8 rows are
 * ggml's get_scale_min_k4 on the lanes at once; w = (d sc_j) q - dmin mn_j, the rows path's.
 * Q5_K (five = 1): the same, with 8 chunks of qh between the scales and the quants: chunk c holds
 * each row's qh bytes 4 c .. 4 c + 3, whose bit j is the fifth bit of value 4 c .. of sub-block j. */
static inline __attribute__((always_inline)) void tile_q4q5_k_8x8_q8_ymm(int five, int MC, const uint8_t *grp, long nsb,
                                                                         const int8_t *qx, const float *dx,
                                                                         const float *sx, long I, __m256 out[GMC]) {
    const long nb = I / QK, bb = five ? 176 : 144;
    const __m256i mask = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(0x0F);
    const __m256i bit = _mm256_set1_epi8(0x01);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    const int nta = hw_qpf_nta;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p = grp + s * 8 * bb;
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
            const int8_t *xb = qx + (s * 8 + 2 * k) * QK;
            for (int c = 0; c < 8; c++) {
                /* a line an iteration (the block's 18 or 22 lines in its first ones), not all at the block's
                 * start: the 7B-shaped file's matmuls from DRAM at 1 row, 2 threads, Zen 4, with
                 * tile_q6_k_8x8_q8_ymm's: 1.09x (1.14x at 3072 bytes ahead); no change while the memory
                 * is saturated (another VM's traffic) */
                if (64 * (8 * k + c) < 8 * bb) prefetch_weight(p + ahead + 64 * (8 * k + c), nta);
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
                    sum[0][m] = _mm256_dpbusd_epi32(sum[0][m], lo, _mm256_set1_epi32(a));
                    sum[1][m] = _mm256_dpbusd_epi32(sum[1][m], hi, _mm256_set1_epi32(z));
                }
            }
            for (int h = 0; h < 2; h++) {
                const long b = s * 8 + 2 * k + h;
                for (int m = 0; m < MC; m++) {
                    const __m256 f = _mm256_cvtepi32_ps(sum[h][m]);
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
 * shifted by 2 (j % 4) (the rows path's unpack), minus 32. The unsigned values q (0 .. 63) meet qx
 * in dpbusd, each 16-value half's sum starting from xs = -32 sum(qx) over those 16 values
 * (generic/quant_linear.c): sum (q - 32) qx, the integers the sign trick gave, without the
 * subtract, abs and sign per chunk. The half sums times their scales in integers, then the float
 * epilogue sub-block by sub-block, in order.
 * Up to 2 rows of x (decode) the four sub-blocks that share a qh chunk are unpacked together (each
 * ql chunk once for two of them). The block's lines are prefetched an iteration or two at a time
 * rather than all at its start: a burst of 27 prefetches ahead of a loop this fast stalled it from DRAM
 * (0.6x). A 7B-shaped Q6_K layer at 1 row of x, AMD EPYC Zen 4, against the sign trick: 1.3x from
 * L3, 1.2x from DRAM on 1 thread, 1.0-1.1x on 2 (benchmarks/dram_stream.py --fmt q6_k). */
static inline __attribute__((always_inline)) void tile_q6_k_8x8_q8_ymm(int MC, const uint8_t *grp, long nsb,
                                                                       const int8_t *qx, const float *dx,
                                                                       const int32_t *xs, long I, __m256 out[GMC]) {
    const long nb = I / QK, n16 = I / 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[GMC];
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    const long ahead = hw_qpf_ahead;
    const int nta = hw_qpf_nta;
    for (long s = 0; s < nsb; s++) {
        const uint8_t *p = grp + s * 8 * 210, *ch = p + 16;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        for (int jj = 0; jj < 2; jj++) {  /* sub-blocks 4 jj .. 4 jj + 3 */
            __m256i sum[4][2][2];  /* [j - 4 jj][half][row of x], up to 2 rows */
            if (MC <= 2) {
                for (int j = 0; j < 4; j++)
                    for (int m = 0; m < MC; m++)
                        for (int h = 0; h < 2; h++)
                            sum[j][h][m] = _mm256_set1_epi32(xs[m * n16 + 2 * (s * 8 + 4 * jj + j) + h]);
                for (int c = 0; c < 8; c++) {
                    const long o = 128 * (8 * jj + c);
                    prefetch_weight(p + ahead + o, nta);
                    if (o + 64 < 8 * 210) prefetch_weight(p + ahead + o + 64, nta);
                    const __m256i la = _mm256_loadu_si256((const __m256i *)(ch + 32 * (16 * jj + c))),
                                  lb = _mm256_loadu_si256((const __m256i *)(ch + 32 * (16 * jj + 8 + c))),
                                  qh = _mm256_loadu_si256((const __m256i *)(ch + 32 * (32 + 8 * jj + c)));
                    __m256i q[4];  /* sub-block 4 jj + j: its ql nibble, qh's bits 2 j, 2 j + 1 as bits 4, 5 */
                    q[0] = _mm256_or_si256(_mm256_and_si256(la, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
                    q[1] = _mm256_or_si256(_mm256_and_si256(lb, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
                    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), m4), _mm256_and_si256(qh, m30));
                    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
                    for (int j = 0; j < 4; j++)
                        for (int m = 0; m < MC; m++) {
                            int32_t a;
                            memcpy(&a, qx + m * I + (s * 8 + 4 * jj + j) * QK + 4 * c, 4);
                            sum[j][c / 4][m] = _mm256_dpbusd_epi32(sum[j][c / 4][m], q[j], _mm256_set1_epi32(a));
                        }
                }
            }
            for (int j = 4 * jj; j < 4 * jj + 4; j++) {
                const __m256i scs = _mm256_loadu_si256((const __m256i *)(ch + 32 * (48 + j / 2)));
                const int k0 = 2 * (j % 2);  /* the two scales' bytes in each lane, sign-extended */
                const __m256i sc0 = _mm256_srai_epi32(_mm256_slli_epi32(scs, 24 - 8 * k0), 24),
                              sc1 = _mm256_srai_epi32(_mm256_slli_epi32(scs, 16 - 8 * k0), 24);
                __m256i one[2][GMC];  /* from 3 rows of x: sub-block j alone */
                if (MC > 2) {
                    const int cq = 16 * (j / 4) + 8 * (j % 2), chh = 32 + 8 * (j / 4), sl = 4 * ((j % 4) / 2),
                              sh = 2 * (j % 4);
                    for (int m = 0; m < MC; m++)
                        for (int h = 0; h < 2; h++) one[h][m] = _mm256_set1_epi32(xs[m * n16 + 2 * (s * 8 + j) + h]);
                    for (int c = 0; c < 8; c++) {
                        if (64 * (8 * j + c) < 8 * 210) prefetch_weight(p + ahead + 64 * (8 * j + c), nta);
                        const __m256i ql = _mm256_loadu_si256((const __m256i *)(ch + 32 * (cq + c)));
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(ch + 32 * (chh + c)));
                        const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, sl), m4),
                                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, sh), m2), 4));
                        for (int m = 0; m < MC; m++) {
                            int32_t a;
                            memcpy(&a, qx + m * I + (s * 8 + j) * QK + 4 * c, 4);
                            one[c / 4][m] = _mm256_dpbusd_epi32(one[c / 4][m], q, _mm256_set1_epi32(a));
                        }
                    }
                }
                for (int m = 0; m < MC; m++) {
                    const __m256i s0 = MC <= 2 ? sum[j - 4 * jj][0][m & 1] : one[0][m],
                                  s1 = MC <= 2 ? sum[j - 4 * jj][1][m & 1] : one[1][m];
                    const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1));
                    acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(dx + m * nb + s * 8 + j)),
                                             _mm256_cvtepi32_ps(t), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < MC; m++) out[m] = acc[m];
}

#endif
