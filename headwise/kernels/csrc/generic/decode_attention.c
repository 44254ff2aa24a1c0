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
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

enum { HW_OK = 0, HW_BAD_SHAPE = 1 };

enum { PARALLEL_MIN_WORK = 1 << 19 };  /* key x row x channel products below which one thread does it all */
/* ... or K and V bytes from which hw_decode_attention_seq spreads the heads anyway: a 7B-shaped layer's
 * 32 heads (D 128, one query row each) hold 0.5 MiB of 16-bit K / V at 32 keys, a read from DRAM
 * (the model's K / V exceed L3), ~35 us on one thread; on one thread below 2^19 products (128 keys)
 * they were ~4% of a batch-1 step there (AMD EPYC Zen 4, 2 threads). */
enum { PARALLEL_MIN_BYTES = 1 << 19 };

/* softcap > 0: scores become softcap tanh(s / softcap) before the softmax (Gemma 2); 0: plain.
 * Returns HW_OK, or HW_BAD_SHAPE (nothing written) unless 1 <= G <= MAX_G, 8 <= D <= MAX_D and
 * D % 8 == 0. Strides are in elements; each key's D elements are contiguous. et: K and V stored as
 * KV_F32, KV_BF16 or KV_F16 (kernels.h; each tile widened in registers, decode_pair.h). lengths NULL:
 * every sequence has all_keys keys (a decode step over a contiguous cache). tables (C, tw), or NULL:
 * sequence c's key t is row tables[c][t / bs] * bs + t % bs of its head's plane (a paged pool's
 * block table, bs keys a block, rows sk_t apart), not row t. */
int hw_decode_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse, long C, long Hkv,
                            long G, long D, long sk_c, long sk_h, long sk_t, long sv_c, long sv_h, long sv_t,
                            const long *lengths, float scale, long all_keys, const int64_t *tables, long tw, long bs,
                            float softcap, int et) {
    if (tables && bs < 1) return HW_BAD_SHAPE;
    if (G < 1 || G > MAX_G || D < 8 || D > MAX_D || D % 8 || et == KV_I8 || et < KV_F32 || et > KV_F16)
        return HW_BAD_SHAPE;
    const long es = hw_kv_bytes(et);
    long keys = 0;
    for (long c = 0; c < C; c++) keys += lengths ? (lengths[c] > 0 ? lengths[c] : 0) : all_keys;
    /* A batch-1 decode step's attention is ~10 us of work: on the calling thread alone it does not
     * wake the pool's other threads (who sleep after a short spin between a step's kernels) for it.
     * dynamic: ragged lengths, and a thread the OS preempts does not hold up the rest. */
    const int parallel = keys * Hkv * G * D >= PARALLEL_MIN_WORK;
    #pragma omp parallel for schedule(dynamic) if (parallel)
    for (long ch = 0; ch < C * Hkv; ch++) {
        const long c = ch / Hkv, h = ch % Hkv;
        const char *kc = (const char *)k + (c * sk_c + h * sk_h) * es, *vc = (const char *)v + (c * sv_c + h * sv_h) * es;
        const long n = lengths ? lengths[c] : all_keys;
        const int64_t *tab = tables ? tables + c * tw : NULL;
        if (softcap > 0.0f)
            hw_decode_pair_capped(kc, vc, NULL, NULL, q + ch * G * D, out + ch * G * D, lse ? lse + ch * G : NULL, n, G,
                                  D, sk_t, sv_t, scale, tab, bs, softcap, et);
        else if (et == KV_F32)
            hw_decode_pair_f32((const float *)kc, (const float *)vc, q + ch * G * D, out + ch * G * D,
                               lse ? lse + ch * G : NULL, n, G, D, sk_t, sv_t, scale, tab, bs);
        else
            hw_decode_pair(kc, vc, NULL, NULL, q + ch * G * D, out + ch * G * D, lse ? lse + ch * G : NULL, n, G, D,
                           sk_t, sv_t, scale, tab, bs, et);
    }
    return HW_OK;
}

/* One sequence's Hkv x G query rows over its n keys (hw_decoder_step's call per row): K and V stored
 * as et (KV_F32, KV_BF16, KV_F16, or KV_I8 with fp32 scales ks, vs at the rows' element offsets / D); head
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
                            const int64_t *tab, long bs, int et) {
    if ((tab && bs < 1) || G < 1 || G > MAX_G || D < 8 || D > MAX_D || D % 8 || (et == KV_I8) != (ks != NULL) ||
        (ks && (sk_h % D || sk_t % D)) || et < KV_F32 || et > KV_F16)
        return HW_BAD_SHAPE;
    const char *k = k_, *v = v_;
    const long es = hw_kv_bytes(et); /* bytes per element */
    const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
    long a = Hkv, b = threads;
    while (b) {
        const long t = a % b;
        a = b, b = t;
    }
    long nch = threads / a;
    if (nch > n / MIN_CHUNK) nch = n / MIN_CHUNK;
    if (nch <= 1) {
        const int parallel =
            threads > 1 && (n * Hkv * G * D >= PARALLEL_MIN_WORK || 2 * n * Hkv * D * es >= PARALLEL_MIN_BYTES);
        #pragma omp parallel for schedule(dynamic) if (parallel)
        for (long h = 0; h < Hkv; h++) {
            const long at = h * sk_h;
            hw_decode_pair_nolse(k + at * es, v + at * es, ks ? ks + at / D : NULL, ks ? vs + at / D : NULL,
                                 q + h * G * D, out + h * G * D, n, G, D, sk_t, scale, tab, bs, et);
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
        hw_decode_pair(k + at * es, v + at * es, ks ? ks + at / D : NULL, ks ? vs + at / D : NULL, q + h * G * D,
                       part + it * G * D, lse + it * G, len, G, D, sk_t, sk_t, scale, tab ? tab + t0 / bs : NULL, bs,
                       et);
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
