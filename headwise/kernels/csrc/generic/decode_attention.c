/* Decode attention over strided K/V for CPU: the G query rows of each (sequence, KV head) pair
 * attend over that pair's first lengths[c] keys, in one pass over K and V.
 *
 * A decode step's attention is a read of every past key and value once; the arithmetic per
 * byte is small (G rows per key), so its speed is how fast K and V stream from memory. The
 * paged cache hands them as as_strided views of its block pool (kv.RegionGrid: sequence c's
 * keys at k + c*sk_c + h*sk_h + t*sk_t, each key D contiguous floats). Per pair, keys go in
 * tiles of TK = 8: the G x 8 scores are 8 dot products per row folded by one transposing
 * horizontal add, then one online-softmax rescale per row and tile (Milakov & Gimelshein
 * 2018, "Online normalizer calculation for softmax"), so exp and the reductions cost little
 * next to the 2 x 8 x D floats read. Scores are kept in base 2 (q pre-scaled by scale *
 * log2(e)) so exp is one exp2 polynomial. Pairs are split over the OpenMP threads of the
 * calling process (the libgomp PyTorch already loaded, as small_linear.c).
 *
 * q (C, Hkv, G, D), out (C, Hkv, G, D): contiguous. lse (C, Hkv, G): natural-log LSE of the
 * scaled scores, or NULL. lengths[c] <= 0: out 0, lse -inf. Needs AVX2 + FMA.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h" /* exp2_ps */

enum { TK = 8, MAX_G = 16, MAX_D = 256 };  /* TK: one 8-lane vector of scores (hsum8, the V update) */
enum { HW_OK = 0, HW_BAD_SHAPE = 1 };

/* [sum(a[0]), ..., sum(a[7])]: the 8 lanes of each of 8 vectors summed, by a transposing tree. */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* u0 lanes: [a0..a3 low halves | a0..a3 high halves]; u1 the same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
static inline void widen_rows(const int8_t *q, const float *sc, long s, long ss, const long r[TK], long D,
                              float *buf) {
    for (long j = 0; j < TK; j++) {
        const int8_t *row = q + r[j] * s;
        const float c = sc[r[j] * ss];
        long d = 0;
#ifdef __AVX512F__ /* 16 at a time: half the instructions of this (compute-bound) widening */
        const __m512 f16 = _mm512_set1_ps(c);
        for (; d + 16 <= D; d += 16) {
            const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d)));
            _mm512_storeu_ps(buf + j * D + d, _mm512_mul_ps(_mm512_cvtepi32_ps(w), f16));
        }
#endif
        const __m256 f = _mm256_set1_ps(c);
        for (; d < D; d += 8) {
            const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d)));
            _mm256_store_ps(buf + j * D + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), f));
        }
    }
}

/* acc[d ..] = al acc[d ..] + sum_j p_j v_j[d ..] for one row, W-bit vectors (256, 512) of type T, pv the row's
 * TK weights broadcast: four short chains (one chain of 8 FMAs: its latency, not the FMA units, would set
 * the pace). In pair(): ag (the row's acc), vr (the tile's value rows), d. */
#define PV_CHUNK(W, T, pv, al)                                                                                  \
    do {                                                                                                       \
        T a0 = _mm##W##_fmadd_ps(pv[0], _mm##W##_loadu_ps(vr[0] + d), _mm##W##_mul_ps(_mm##W##_loadu_ps(ag + d), al)); \
        T a1 = _mm##W##_mul_ps(pv[1], _mm##W##_loadu_ps(vr[1] + d));                                           \
        T a2 = _mm##W##_mul_ps(pv[2], _mm##W##_loadu_ps(vr[2] + d));                                           \
        T a3 = _mm##W##_mul_ps(pv[3], _mm##W##_loadu_ps(vr[3] + d));                                           \
        a0 = _mm##W##_fmadd_ps(pv[4], _mm##W##_loadu_ps(vr[4] + d), a0);                                       \
        a1 = _mm##W##_fmadd_ps(pv[5], _mm##W##_loadu_ps(vr[5] + d), a1);                                       \
        a2 = _mm##W##_fmadd_ps(pv[6], _mm##W##_loadu_ps(vr[6] + d), a2);                                       \
        a3 = _mm##W##_fmadd_ps(pv[7], _mm##W##_loadu_ps(vr[7] + d), a3);                                       \
        _mm##W##_storeu_ps(ag + d, _mm##W##_add_ps(_mm##W##_add_ps(a0, a1), _mm##W##_add_ps(a2, a3)));         \
    } while (0)

/* One (sequence, KV head) pair: G rows of q over n keys at k, v (key t at k + key_row(t)*sk_t).
 * ks NULL: k, v are fp32. Else k, v are int8 (cache/quantized.py's layout) and ks, vs their fp32
 * scales, one per key row, at the row's element offset / D: each tile's 8 keys and values are
 * widened into a buffer once, and the fp32 code below reads that (~1/4 of the bytes from memory). */
static void pair(const void *k_, const void *v_, const float *ks, const float *vs, const float *q, float *out,
                 float *lse, long n, long G, long D, long sk_t, long sv_t, float scale, const int64_t *tab, long bs) {
    const float *k = k_, *v = v_;
    const long esize = ks ? 1 : 4;  /* bytes per stored element */
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
        long rows[TK];
        tile_rows(tab, bs, t0, nk, rows);
        if (ks) {
            widen_rows(k_, ks, sk_t, sk_t / D, rows, D, kbuf);
            widen_rows(v_, vs, sv_t, sv_t / D, rows, D, vbuf);
            for (long j = 0; j < TK; j++) kr[j] = kbuf + j * D, vr[j] = vbuf + j * D;
        } else {
            for (long j = 0; j < TK; j++) kr[j] = k + rows[j] * sk_t, vr[j] = v + rows[j] * sv_t;
        }
        /* the next tile's K and V: with the pool beyond the caches (30 layers' worth), 5-15% faster
         * than the hardware prefetcher alone (2 tiles ahead: less; in cache: ~5% slower) */
        const long tp = t0 + (ks ? 4 : 1) * TK;  /* int8: as many bytes ahead as fp32's one tile */
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
            long d = 0;
#ifdef __AVX512F__ /* 16 channels an instruction where the core has them (then the ymm loop: D % 16) */
            if (D >= 16) {
                __m512 z[TK];
                for (long j = 0; j < TK; j++) z[j] = _mm512_setzero_ps();
                for (; d + 16 <= D; d += 16) {
                    const __m512 qv = _mm512_loadu_ps(qg + d);
                    for (long j = 0; j < TK; j++) z[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[j] + d), z[j]);
                }
                for (long j = 0; j < TK; j++)
                    d8[j] = _mm256_add_ps(_mm512_castps512_ps256(z[j]), _mm512_extractf32x8_ps(z[j], 1));
            }
#endif
            for (; d < D; d += 8) {
                const __m256 qv = _mm256_load_ps(qg + d);
                for (long j = 0; j < TK; j++) d8[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + d), d8[j]);
            }
            const __m256 s = _mm256_blendv_ps(neg_inf, hsum8(d8), valid);  /* (TK,) base-2 scores */
            _mm256_store_ps(p + g * TK, s);
            mx[g] = hmax(s);
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
            l[g] = l[g] * alpha[g] + hsum(pg);
            _mm256_store_ps(p + g * TK, pg);
        }
        /* per row: its 8 weights in registers, then acc = alpha acc + sum_j p_j v_j (PV_CHUNK) */
        for (long g = 0; g < G; g++) {
            __m256 pb[TK];
            for (long j = 0; j < TK; j++) pb[j] = _mm256_broadcast_ss(p + g * TK + j);
            const __m256 al = _mm256_set1_ps(alpha[g]);
            float *ag = acc + g * D;
            long d = 0;
#ifdef __AVX512F__
            if (D >= 16) {
                __m512 pz[TK];
                for (long j = 0; j < TK; j++) pz[j] = _mm512_set1_ps(p[g * TK + j]);
                const __m512 alz = _mm512_set1_ps(alpha[g]);
                for (; d + 16 <= D; d += 16) PV_CHUNK(512, __m512, pz, alz);
            }
#endif
            for (; d < D; d += 8) PV_CHUNK(256, __m256, pb, al);
        }
    }
    for (long g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[g]);
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(out + g * D + d, _mm256_mul_ps(_mm256_load_ps(acc + g * D + d), inv));
        if (lse) lse[g] = m[g] * 0.6931471805599453f + logf(l[g]);
    }
}

enum { PARALLEL_MIN_WORK = 1 << 19 };  /* key x row x channel products below which one thread does it all */

/* Returns HW_OK, or HW_BAD_SHAPE (nothing written) unless 1 <= G <= MAX_G, 8 <= D <= MAX_D and
 * D % 8 == 0. Strides are in floats; each key's D floats are contiguous. lengths NULL: every
 * sequence has all_keys keys (a decode step over a contiguous cache). tables (C, tw), or NULL:
 * sequence c's key t is row tables[c][t / bs] * bs + t % bs of its head's plane (a paged pool's
 * block table, bs keys a block, rows sk_t apart), not row t. */
int hw_decode_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse, long C, long Hkv,
                            long G, long D, long sk_c, long sk_h, long sk_t, long sv_c, long sv_h, long sv_t,
                            const long *lengths, float scale, long all_keys, const int64_t *tables, long tw,
                            long bs) {
    if (tables && bs < 1) return HW_BAD_SHAPE;
    if (G < 1 || G > MAX_G || D < 8 || D > MAX_D || D % 8) return HW_BAD_SHAPE;
    long keys = 0;
    for (long c = 0; c < C; c++) keys += lengths ? (lengths[c] > 0 ? lengths[c] : 0) : all_keys;
    /* A batch-1 decode step's attention is ~10 us of work: on the calling thread alone it does not
     * wake the pool's other threads (who sleep after a short spin between a step's kernels) for it.
     * dynamic: ragged lengths, and a thread the OS preempts does not hold up the rest. */
    const int parallel = keys * Hkv * G * D >= PARALLEL_MIN_WORK;
    #pragma omp parallel for schedule(dynamic) if (parallel)
    for (long ch = 0; ch < C * Hkv; ch++) {
        const long c = ch / Hkv, h = ch % Hkv;
        pair(k + c * sk_c + h * sk_h, v + c * sv_c + h * sv_h, NULL, NULL, q + ch * G * D, out + ch * G * D,
             lse ? lse + ch * G : NULL, lengths ? lengths[c] : all_keys, G, D, sk_t, sv_t, scale,
             tables ? tables + c * tw : NULL, bs);
    }
    return HW_OK;
}

/* One sequence's Hkv x G query rows over its n keys (hw_decoder_step's call per row): K and V fp32
 * (ks NULL) or int8 with fp32 scales ks, vs at the rows' element offsets / D (pair's two kinds); head
 * h's key t at k + (h sk_h + key_row(t) sk_t) elements. On a call outside any parallel region (a
 * batch-1 step, whose pool spins between the stack's kernels) the keys are cut into chunks as well
 * as the heads, to keep every thread busy: SmolLM2's 3 heads on 2 threads left one idle a third of
 * the time. nthreads / gcd(Hkv, nthreads) chunks of at least MIN_CHUNK keys, starting at multiples
 * of TK and of bs; each (head, chunk) item's output and LSE, then out = sum_c e^(lse_c - max) out_c /
 * sum_c e^(lse_c - max). SmolLM2 at 4,000 keys, 2 threads, AMD Zen 5, attention per token: fp32
 * 6.8 -> 5.9 ms, int8 4.4 -> 3.5 (with the zmm loops and widening). Inside a parallel region (the
 * rows of a batch in parallel) the heads go one after another on the calling thread.
 * Returns HW_OK, HW_BAD_SHAPE, or -1 (no memory). */
enum { MIN_CHUNK = 64 };
int hw_decode_attention_seq(const float *q, const void *k_, const void *v_, const float *ks, const float *vs,
                            float *out, long Hkv, long G, long D, long sk_h, long sk_t, long n, float scale,
                            const int64_t *tab, long bs) {
    if ((tab && bs < 1) || G < 1 || G > MAX_G || D < 8 || D > MAX_D || D % 8 || (ks && (sk_h % D || sk_t % D)))
        return HW_BAD_SHAPE;
    const char *k = k_, *v = v_;
    const long es = ks ? 1 : 4; /* bytes per element */
    const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
    long a = Hkv, b = threads;
    while (b) {
        const long t = a % b;
        a = b, b = t;
    }
    long nch = threads / a;
    if (nch > n / MIN_CHUNK) nch = n / MIN_CHUNK;
    if (nch <= 1) {
        const int parallel = threads > 1 && n * Hkv * G * D >= PARALLEL_MIN_WORK;
        #pragma omp parallel for schedule(dynamic) if (parallel)
        for (long h = 0; h < Hkv; h++) {
            const long at = h * sk_h;
            pair(k + at * es, v + at * es, ks ? ks + at / D : NULL, ks ? vs + at / D : NULL, q + h * G * D,
                 out + h * G * D, NULL, n, G, D, sk_t, sk_t, scale, tab, bs);
        }
        return HW_OK;
    }
    const long unit = tab ? (bs % TK == 0 ? bs : bs * TK) : TK; /* a multiple of TK and of bs */
    long chunk = (n + nch - 1) / nch;
    chunk = (chunk + unit - 1) / unit * unit;
    nch = (n + chunk - 1) / chunk;
    float *part = malloc(sizeof(float) * (size_t)(Hkv * nch * G * (D + 1)));
    if (!part) return -1;
    float *lse = part + Hkv * nch * G * D;
    #pragma omp parallel for schedule(dynamic)
    for (long it = 0; it < Hkv * nch; it++) {
        const long h = it / nch, t0 = it % nch * chunk, len = n - t0 < chunk ? n - t0 : chunk;
        const long at = h * sk_h + (tab ? 0 : t0 * sk_t);
        pair(k + at * es, v + at * es, ks ? ks + at / D : NULL, ks ? vs + at / D : NULL, q + h * G * D,
             part + it * G * D, lse + it * G, len, G, D, sk_t, sk_t, scale, tab ? tab + t0 / bs : NULL, bs);
    }
    for (long hg = 0; hg < Hkv * G; hg++) { /* row g of head h; item (h, c)'s row g at (h nch + c) G + g */
        const long h = hg / G, g = hg % G;
        float mx = -INFINITY, wsum = 0.0f, *o = out + hg * D;
        for (long c = 0; c < nch; c++) mx = fmaxf(mx, lse[(h * nch + c) * G + g]);
        for (long d = 0; d < D; d++) o[d] = 0.0f;
        for (long c = 0; c < nch; c++) {
            const float wc = expf(lse[(h * nch + c) * G + g] - mx), *pc = part + ((h * nch + c) * G + g) * D;
            wsum += wc;
            for (long d = 0; d < D; d++) o[d] += wc * pc[d];
        }
        for (long d = 0; d < D; d++) o[d] /= wsum;
    }
    free(part);
    return HW_OK;
}
