/* GGML's block formats as every quantized kernel reads them: type ids, sizes, the f16 fields, the
 * 6-bit K-quant scales, and the packed layout's header (rows in groups of 8, fmt | X8). Layouts:
 * ggml-common.h's block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0, block_q4_K,
 * block_q5_K, block_q6_K; a weight (O, I) is O rows of I / block_values blocks, row-major.
 * Scalar, the same in every variant (x86/avx2/quant_unpack.h unpacks a block into a vector). */
#ifndef HW_QUANT_FORMATS_H
#define HW_QUANT_FORMATS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  /* GGML type ids */
enum { QK = 32, QK_K = 256 };
enum { ERR_ALLOC = -1, ERR_FORMAT = -2, ERR_SHAPE = -3 };
enum { X8 = 0x100 };  /* fmt | X8: Q4_0 / Q4_1 / Q8_0 rows packed in groups of 8 (hw_repack8) */

/* Bytes per block and values per block (block_bytes: 0 for a format these kernels do not know). */
static inline long block_bytes(int fmt) {
    switch (fmt) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}
static inline long block_values(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K ? QK_K : QK; }

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline void store_f16(uint8_t *p, float v) {
    const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    memcpy(p, &h, 2);
}

/* A value the compiler may not fuse into an FMA with what follows: the reference quantizers
 * and decoders round the product before the add, and we match them bit for bit. */
static inline float rounded(float v) {
    __asm__("" : "+x"(v));
    return v;
}

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a Q4_K block's 12 bytes. */
static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- Q4_0 / Q4_1 / Q8_0 rows packed in groups of 8 (fmt | X8) ----
 * The layout (llama.cpp's q4_0_8x8 repacking, ours in detail): O rows in groups of 8, the last
 * padded with zero rows; per group and block b, the 8 rows' d (f16), Q4_1's 8 m's, then chunks:
 * chunk c is each row's quant bytes 4c .. 4c + 3, 8 rows x 4 bytes (Q4: 4 chunks, values 4c ..
 * 4c + 3 in the low nibbles, 16 + 4c .. in the high ones; Q8_0: 8 chunks of values 4c .. 4c + 3).
 * The same bytes per weight as the file's. One 32-byte load holds 4 values of 8 rows, so a
 * maddubs against 4 bytes of x (broadcast) gives the 8 rows' partial sums in lanes; a Q4 block's
 * 8 products add in int16 (|sum| <= 8 x 2 x 15 x 127 < 2^15) before one madd, and the 8 rows'
 * dw and mw are one vector each. AMD EPYC, 1 thread: ~2.3x the row-by-row kernel at 1 row of x,
 * ~1.8x from 2 rows. */

/* the f16 fields before a block's quants (a Q5 block's 4 bytes of fifth bits are its first chunk) */
static inline long hdr_bytes(int fmt) { return fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K ? 4 : 2; }
/* where in a block its f16 fields are: first, except Q6_K's d, its last 2 bytes (the packed group
 * puts them first all the same; the chunks are the block's other bytes in order) */
static inline long hdr_at(int fmt) { return fmt == Q6_K ? 208 : 0; }
static inline int packable(int fmt) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == Q8_0 || fmt == Q4_K || fmt == Q5_K ||
           fmt == Q6_K;
}

#endif
