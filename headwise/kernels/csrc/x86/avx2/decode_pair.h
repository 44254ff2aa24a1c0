/* Decode attention's one (sequence, KV head) pair in ymm, for both variants (generic/decode_attention.c
 * has the method and the drivers). The includer first defines four hooks that take the leading
 * channels in wider vectors and return how many they took (x86/avx2/decode_attention.c: none;
 * x86/avx512/decode_attention.c: every 16 in zmm):
 *   widen_row_head(row, c, D, dst)  int8 row * c -> fp32 dst
 *   widen16_row_head(row, et, D, dst)  bf16 / fp16 row -> fp32 dst
 *   dot_keys_head(qg, kr, D, d8)    d8[j] += q . k_j, per lane
 *   pv_head(pg, alpha, ag, vr, D)   ag = alpha ag + sum_j pg[j] v_j
 *   dot_keys16_head, pv16_head      the same two over bf16 / fp16 rows, widened as they are read
 *                                    (one query row a KV head: nothing to share a widened tile with)
 * after including this file (which declares them), then the ymm loops take the rest. */
#ifndef HW_DECODE_PAIR_H
#define HW_DECODE_PAIR_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../../generic/kernels.h"
#include "vec.h" /* exp2_ps, hsum_ps, hmax_ps */

#ifndef HW_DIRECT16
#define HW_DIRECT16 0 /* 1: 16-bit K / V at one query row a head are widened as read (decode_pair) */
#endif
static inline long widen_row_head(const int8_t *row, float c, long D, float *dst);
static inline long widen16_row_head(const uint16_t *row, int et, long D, float *dst);
static inline long dot_keys_head(const float *qg, const float *const kr[TK], long D, __m256 d8[TK]);
static inline long pv_head(const float *pg, float alpha, float *ag, const float *const vr[TK], long D);
static inline long dot_keys16_head(const float *qg, const uint16_t *const kr[TK], int et, long D, __m256 d8[TK]);
static inline long pv16_head(const float *pg, float alpha, float *ag, const uint16_t *const vr[TK], int et, long D);

/* [sum(a[0]), ..., sum(a[7])]: the 8 lanes of each of 8 vectors summed, by a transposing tree. */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* u0 lanes: [a0..a3 low halves | a0..a3 high halves]; u1 the same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Which row of its K/V plane key t of a sequence is: t itself (its keys one run), or with a
 * block table (a paged pool), slot tab[t / bs] * bs + t % bs. */
static inline long key_row(const int64_t *tab, long bs, long t) { return tab ? tab[t / bs] * bs + t % bs : t; }

/* The TK key rows of the tile at t0 (nk of them real; the rest repeat the last, in bounds). With
 * a table whose blocks hold a whole number of tiles, a tile never crosses a block: one lookup. */
static inline void tile_rows(const int64_t *tab, long bs, long t0, long nk, long r[TK]) {
    if (!tab || bs % TK == 0) {
        const long r0 = key_row(tab, bs, t0);
        for (long j = 0; j < TK; j++) r[j] = r0 + (j < nk ? j : nk - 1);
    } else {
        for (long j = 0; j < TK; j++) r[j] = key_row(tab, bs, t0 + (j < nk ? j : nk - 1));
    }
}

/* Key rows r[0 .. TK) of an int8 plane (row r at q + r * s, its scale at sc[r * ss], ss = s / D) as fp32
 * q * scale into buf (TK x D), the value the cache's dequantize_int8 gives (int8 -> fp32, times the fp32
 * scale). (ss from the caller: a division per row here cost more than the widening.) */
static inline void widen_rows(const int8_t *q, const float *sc, long s, long ss, const long r[TK], long D, float *buf) {
    for (long j = 0; j < TK; j++) {
        const int8_t *row = q + r[j] * s;
        const float c = sc[r[j] * ss];
        long d = widen_row_head(row, c, D, buf + j * D);
        const __m256 f = _mm256_set1_ps(c);
        for (; d < D; d += 8) {
            const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d)));
            _mm256_store_ps(buf + j * D + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), f));
        }
    }
}

/* 8 bf16 (et KV_BF16: the high half of an fp32, so a 16-bit shift) or fp16 (F16C's vcvtph2ps) -> fp32 */
static inline __m256 widen16_ps(const uint16_t *x, int et) {
    const __m128i h = _mm_loadu_si128((const __m128i *)x);
    if (et == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Key rows r[0 .. TK) of a 16-bit plane (row r at x + r * s) as fp32 into buf (TK x D): exact, as
 * torch's .float() of the stored bf16 / fp16 values. */
static inline void widen16_rows(const uint16_t *x, int et, long s, const long r[TK], long D, float *buf) {
    for (long j = 0; j < TK; j++) {
        const uint16_t *row = x + r[j] * s;
        long d = widen16_row_head(row, et, D, buf + j * D);
        for (; d < D; d += 8) _mm256_store_ps(buf + j * D + d, widen16_ps(row + d, et));
    }
}

/* x (D floats, D % 8 == 0) -> D bf16 or fp16 (et), each rounded to nearest even as torch's .to(): fp16
 * by F16C (overflow to inf), bf16 by adding 0x7fff + the kept lowest bit (a NaN stays a quiet NaN). */
void hw_store_row_16(const float *x, long D, uint16_t *out, int et) {
    for (long d = 0; d < D; d += 8) {
        const __m256 v = _mm256_loadu_ps(x + d);
        __m128i h;
        if (et == KV_BF16) {
            const __m256i b = _mm256_castps_si256(v);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
            const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
            h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        } else
            h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(out + d), h);
    }
}

/* acc[d ..] = al acc[d ..] + sum_j p_j v_j[d ..] for one row, W-bit vectors (256, 512) of type T, pv the row's
 * TK weights broadcast: four short chains (one chain of 8 FMAs: its latency, not the FMA units, would set
 * the pace). In decode_pair(): ag (the row's acc), vr (the tile's value rows), d. */
#define PV_CHUNK_BY(W, T, pv, al, V)                                                                        \
    do {                                                                                                       \
        T a0 = _mm##W##_fmadd_ps(pv[0], V(0), _mm##W##_mul_ps(_mm##W##_loadu_ps(ag + d), al));                 \
        T a1 = _mm##W##_mul_ps(pv[1], V(1));                                                                   \
        T a2 = _mm##W##_mul_ps(pv[2], V(2));                                                                   \
        T a3 = _mm##W##_mul_ps(pv[3], V(3));                                                                   \
        a0 = _mm##W##_fmadd_ps(pv[4], V(4), a0);                                                               \
        a1 = _mm##W##_fmadd_ps(pv[5], V(5), a1);                                                               \
        a2 = _mm##W##_fmadd_ps(pv[6], V(6), a2);                                                               \
        a3 = _mm##W##_fmadd_ps(pv[7], V(7), a3);                                                               \
        _mm##W##_storeu_ps(ag + d, _mm##W##_add_ps(_mm##W##_add_ps(a0, a1), _mm##W##_add_ps(a2, a3)));         \
    } while (0)
/* V(j): value row j's channels d.. as fp32: read (vr) or widened from 16 bits as read (vr16, et) */
#define PV_LOAD256(j) _mm256_loadu_ps(vr[j] + d)
#define PV_LOAD512(j) _mm512_loadu_ps(vr[j] + d)
#define PV_WIDEN256(j) widen16_ps(vr16[j] + d, et)
#define PV_CHUNK(W, T, pv, al) PV_CHUNK_BY(W, T, pv, al, PV_LOAD##W)

/* d8[j] += q's channels d.. (qg) times key row j's, K(j) giving them as fp32, 8 at a time to D: the
 * ymm channels the wider hooks left. In decode_pair(): qg, d8, d, D; kr (read) or kr16, et (widened). */
#define DOT_KEYS_YMM(K)                                                                                   \
    for (; d < D; d += 8) {                                                                               \
        const __m256 qv = _mm256_load_ps(qg + d);                                                         \
        for (long j = 0; j < TK; j++) d8[j] = _mm256_fmadd_ps(qv, K(j), d8[j]);                           \
    }
#define KEY_LOAD256(j) _mm256_loadu_ps(kr[j] + d)
#define KEY_WIDEN256(j) widen16_ps(kr16[j] + d, et)

/* Soft-capped base-2 scores (Gemma 2's attn_logit_softcapping): s = natural score * log2 e becomes
 * cap tanh(s ln 2 / cap) log2 e, tanh y = 1 - 2 / (e^2y + 1) with e^2y = 2^(2 s / cap), clamped to
 * 2^+-60 where tanh is +-1 in fp32 already. */
static inline __m256 softcap_ps(__m256 s, float cap) {
    const __m256 x = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(s, _mm256_set1_ps(2.0f / cap)), _mm256_set1_ps(-60.0f)),
                                   _mm256_set1_ps(60.0f));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(exp2_ps(x), one)));
    return _mm256_mul_ps(t, _mm256_set1_ps(cap * 1.4426950408889634f));
}

/* One (sequence, KV head) pair: G rows of q over n keys at k, v (key t at k + key_row(t)*sk_t).
 * et (kernels.h's KV_*): KV_F32, k and v fp32; KV_I8, int8 (cache/quantized.py's layout) with ks, vs
 * their fp32 scales, one per key row, at the row's element offset / D; KV_BF16 / KV_F16, 16-bit. The
 * stored kinds' tiles of 8 keys and values are widened into a buffer (in L1) once, and the fp32 code
 * below reads that (1/4 or 1/2 of fp32's bytes from memory), G rows per widened key. */
static inline __attribute__((always_inline)) void decode_pair(const void *k_, const void *v_, const float *ks,
                                                              const float *vs, const float *q, float *out, float *lse,
                                                              long n, long G, long D, long sk_t, long sv_t, float scale,
                                                              const int64_t *tab, long bs, float cap, int et) {
    const float *k = k_, *v = v_;
    const long esize = hw_kv_bytes(et);  /* bytes per stored element */
    /* 16-bit K / V and one query row, in the avx512 variant (HW_DIRECT16): each element widened as it
     * is read, the same fp32 values and products as the tile's buffer gives, one store and load fewer
     * (more rows share a widened tile). A 7B-shaped layer's 32 heads, bf16, the K / V beyond L3, AMD
     * Zen 4, 2 threads: 1.03x at 128 keys, 1.00x at 1,024, 1.18x at 4,096; in cache ~1.3x. In ymm (the
     * avx2 variant) 0.87-0.90x from DRAM: the values' loads then wait for the scores. */
    const int direct = HW_DIRECT16 && (et == KV_BF16 || et == KV_F16) && G == 1;
    float kbuf[TK * MAX_D] __attribute__((aligned(64))), vbuf[TK * MAX_D] __attribute__((aligned(64)));
    if (n <= 0) {
        for (long i = 0; i < G * D; i++) out[i] = 0.0f;
        if (lse) for (long g = 0; g < G; g++) lse[g] = -INFINITY;
        return;
    }
    float qs[MAX_G * MAX_D] __attribute__((aligned(32)));   /* q * scale * log2(e) */
    float acc[MAX_G * MAX_D] __attribute__((aligned(32)));  /* sum_t 2^(s_t - m) v_t per row */
    float p[MAX_G * TK] __attribute__((aligned(32)));       /* this tile's weights per row */
    /* per row: running max (base 2), sum, rescale, this tile's max; rows G.. are padding */
    float m[MAX_G] __attribute__((aligned(32))), l[MAX_G], alpha[MAX_G] __attribute__((aligned(32)));
    float mx[MAX_G] __attribute__((aligned(32)));
    const float c = scale * 1.4426950408889634f;
    for (long i = 0; i < G * D; i++) qs[i] = q[i] * c, acc[i] = 0.0f;
    for (long g = 0; g < MAX_G; g++) m[g] = -INFINITY, mx[g] = 0.0f, l[g] = 0.0f;
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), neg_inf = _mm256_set1_ps(-INFINITY);

    for (long t0 = 0; t0 < n; t0 += TK) {
        const long nk = n - t0 < TK ? n - t0 : TK;
        /* keys past n repeat the last one (in bounds) and get weight 0 */
        const float *kr[TK], *vr[TK];
        const uint16_t *kr16[TK], *vr16[TK];
        long rows[TK];
        tile_rows(tab, bs, t0, nk, rows);
        if (direct) {
            for (long j = 0; j < TK; j++)
                kr16[j] = (const uint16_t *)k_ + rows[j] * sk_t, vr16[j] = (const uint16_t *)v_ + rows[j] * sv_t;
        } else if (et == KV_I8) {
            widen_rows(k_, ks, sk_t, sk_t / D, rows, D, kbuf);
            widen_rows(v_, vs, sv_t, sv_t / D, rows, D, vbuf);
            for (long j = 0; j < TK; j++) kr[j] = kbuf + j * D, vr[j] = vbuf + j * D;
        } else if (et != KV_F32) {
            widen16_rows(k_, et, sk_t, rows, D, kbuf);
            widen16_rows(v_, et, sv_t, rows, D, vbuf);
            for (long j = 0; j < TK; j++) kr[j] = kbuf + j * D, vr[j] = vbuf + j * D;
        } else {
            for (long j = 0; j < TK; j++) kr[j] = k + rows[j] * sk_t, vr[j] = v + rows[j] * sv_t;
        }
        /* the next tile's K and V: with the pool beyond the caches (30 layers' worth), 5-15% faster
         * than the hardware prefetcher alone (2 tiles ahead: less; in cache: ~5% slower) */
        const long tp = t0 + 4 / esize * TK;  /* int8, 16-bit: as many bytes ahead as fp32's one tile */
        if (tp < n) {
            const long np = n - tp < TK ? n - tp : TK;
            tile_rows(tab, bs, tp, np, rows);
            for (long j = 0; j < np; j++)
                for (long d = 0; d < D * esize; d += 64) {
                    _mm_prefetch((const char *)k_ + rows[j] * sk_t * esize + d, _MM_HINT_T0);
                    _mm_prefetch((const char *)v_ + rows[j] * sv_t * esize + d, _MM_HINT_T0);
                }
        }
        const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)nk), _CMP_LT_OQ);
        for (long g = 0; g < G; g++) {
            const float *qg = qs + g * D;
            __m256 d8[TK];
            for (long j = 0; j < TK; j++) d8[j] = _mm256_setzero_ps();
            long d;
            if (direct) {
                d = dot_keys16_head(qg, kr16, et, D, d8);
                DOT_KEYS_YMM(KEY_WIDEN256)
            } else {
                d = dot_keys_head(qg, kr, D, d8);
                DOT_KEYS_YMM(KEY_LOAD256)
            }
            __m256 s = hsum8(d8);  /* (TK,) base-2 scores */
            if (cap > 0.0f) s = softcap_ps(s, cap);  /* before the mask, as the reference */
            s = _mm256_blendv_ps(neg_inf, s, valid);
            _mm256_store_ps(p + g * TK, s);
            mx[g] = hmax_ps(s);
        }
        /* the rescales of 8 rows in one vector exp2: ~0 on the first tile (m = -inf), where acc and l are 0 */
        for (long g = 0; g < G; g += 8) {
            const __m256 m0 = _mm256_load_ps(m + g), mn = _mm256_max_ps(m0, _mm256_load_ps(mx + g));
            _mm256_store_ps(alpha + g, exp2_ps(_mm256_sub_ps(m0, mn)));
            _mm256_store_ps(m + g, mn);
        }
        for (long g = 0; g < G; g++) {
            const __m256 s = _mm256_load_ps(p + g * TK);
            const __m256 pg = _mm256_and_ps(exp2_ps(_mm256_sub_ps(s, _mm256_set1_ps(m[g]))), valid);
            l[g] = l[g] * alpha[g] + hsum_ps(pg);
            _mm256_store_ps(p + g * TK, pg);
        }
        /* per row: its 8 weights in registers, then acc = alpha acc + sum_j p_j v_j (PV_CHUNK) */
        for (long g = 0; g < G; g++) {
            __m256 pb[TK];
            for (long j = 0; j < TK; j++) pb[j] = _mm256_broadcast_ss(p + g * TK + j);
            const __m256 al = _mm256_set1_ps(alpha[g]);
            float *ag = acc + g * D;
            if (direct) {
                for (long d = pv16_head(p + g * TK, alpha[g], ag, vr16, et, D); d < D; d += 8)
                    PV_CHUNK_BY(256, __m256, pb, al, PV_WIDEN256);
            } else {
                for (long d = pv_head(p + g * TK, alpha[g], ag, vr, D); d < D; d += 8) PV_CHUNK(256, __m256, pb, al);
            }
        }
    }
    for (long g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[g]);
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(out + g * D + d, _mm256_mul_ps(_mm256_load_ps(acc + g * D + d), inv));
        if (lse) lse[g] = m[g] * 0.6931471805599453f + logf(l[g]);
    }
}

/* decode_pair for generic/decode_attention.c's calls, each its own copy with that call's constants
 * (fp32 K/V; no LSE; neither; with a soft-cap, any K/V, LSE or not), as one file's constant
 * propagation made them before the split: the uncapped copies keep no trace of the cap. The element
 * kind is a constant of each copy too (a switch here, outside the loops). */
#define DECODE_PAIR_KINDS(call)                   \
    switch (et) {                                 \
    case KV_I8: call(KV_I8); break;               \
    case KV_BF16: call(KV_BF16); break;           \
    case KV_F16: call(KV_F16); break;             \
    default: call(KV_F32); break;                 \
    }
void hw_decode_pair(const void *k, const void *v, const float *ks, const float *vs, const float *q, float *out,
                    float *lse, long n, long G, long D, long sk_t, long sv_t, float scale, const int64_t *tab,
                    long bs, int et) {
#define CALL(E) decode_pair(k, v, ks, vs, q, out, lse, n, G, D, sk_t, sv_t, scale, tab, bs, 0.0f, E)
    DECODE_PAIR_KINDS(CALL)
#undef CALL
}
void hw_decode_pair_f32(const float *k, const float *v, const float *q, float *out, float *lse, long n, long G, long D,
                        long sk_t, long sv_t, float scale, const int64_t *tab, long bs) {
    decode_pair(k, v, NULL, NULL, q, out, lse, n, G, D, sk_t, sv_t, scale, tab, bs, 0.0f, KV_F32);
}
void hw_decode_pair_capped(const void *k, const void *v, const float *ks, const float *vs, const float *q, float *out,
                           float *lse, long n, long G, long D, long sk_t, long sv_t, float scale, const int64_t *tab,
                           long bs, float cap, int et) {
    decode_pair(k, v, ks, vs, q, out, lse, n, G, D, sk_t, sv_t, scale, tab, bs, cap, et);
}
void hw_decode_pair_nolse(const void *k, const void *v, const float *ks, const float *vs, const float *q, float *out,
                          long n, long G, long D, long sk_t, float scale, const int64_t *tab, long bs, int et) {
#define CALL(E) decode_pair(k, v, ks, vs, q, out, NULL, n, G, D, sk_t, sk_t, scale, tab, bs, 0.0f, E)
    DECODE_PAIR_KINDS(CALL)
#undef CALL
}

#endif
