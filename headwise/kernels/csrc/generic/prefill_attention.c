/* Causal (or unmasked) attention of a prefill on CPU: softmax(q k^T * scale) v for many query rows.
 *
 * A prefill's attention is T queries against S keys per head, T x S x D multiply-adds twice:
 * arithmetic, not a memory stream. Per (batch, KV head, block of PQ tokens) the G query heads of
 * the KV group are G x PQ rows against the same K and V blocks (the GQA fold), so each block of
 * PK keys is read once for all of them: scores S = Q K^T as register tiles (K transposed once per
 * call into (D, PK) blocks, so the vectors run over keys), an online softmax per row in base 2 (q pre-scaled by
 * scale * log2 e; Milakov & Gimelshein 2018), and O += P V as register tiles over channels, O
 * kept in a per-thread buffer that stays in L1/L2. The avx2 build's tiles are 3 rows x 32 keys
 * and 2 rows x 32 channels in ymm; the avx512 build's 6 rows x 64 keys and 6 rows x 64 channels
 * in zmm (PK 64: the per-row softmax work spread over twice the keys; on SmolLM2's shape, H 9,
 * Hkv 3, D 64, 2 threads, AMD EPYC Zen 5, best of 20 with other work running: T = 512 2.05 ms with
 * the ymm tiles and PK 32 -> 1.46 ms; T = 2048 48.5 -> 25.5 ms). benchmarks/prefill_attention.py
 * has it against PyTorch's SDPA. With causal, query t of T
 * sees keys up to t + S - T (bottom-right aligned, as a prefill that follows a cache), so a block
 * of queries stops at its last query's key and only the blocks on the diagonal are masked.
 * Work items are split over the OpenMP threads of the calling process (dynamic: later query
 * blocks see more keys).
 *
 * A sliding window (Mistral, Gemma: query at position p sees keys p - left .. p) rides on causal:
 * causal = 2 + left. A block of queries then starts at the key block holding its first query's
 * first key (the keys before that key are never read: packed as zeros, V from it on), and the
 * scores of keys before a row's window are set to -1e30
 * before the softmax: finite, so a row whose first block holds none of its keys yet does not
 * make 0 * inf; the next block's real maximum rescales that block's weight to exactly 0. (The
 * window travels in causal so the binding in module.c keeps its arguments; a parameter of its
 * own is the tidier form.)
 *
 * q (B, H, T, D), k, v (B, Hkv, S, D), out (B, H, T, D): each row's D floats contiguous, the other
 * strides given (floats). lse (B, H, T) contiguous natural-log LSE, or NULL. H = G Hkv. D a multiple
 * of 8 up to MAX_PD, G up to MAX_PG. The tiles are per ISA (hw_pa_scores, hw_pa_softmax, hw_pa_pv:
 * x86/avx2/prefill_attention.c, x86/avx512/prefill_attention.c).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { MAX_PG = 16, MAX_PD = 256 };
#define PACK_BYTES (8L << 20) /* packed K at a time: pairs of (batch, KV head) up to this, at least one */
/* hw_pa_queries (x86/avx2/, x86/avx512/prefill_attention.c): query tokens per block, at most
 * (a block's rows are G x that many; each key block is read once
 * per block): PK, so that a causal block's diagonal tile is square. Against 16, the
 * first tuning (benchmarks/prefill_query_block.py, AMD EPYC Zen 5, 2 threads, SmolLM2's and a
 * Llama-8B's shapes, T = 128-4096): the avx512 build with 64 1.11x (geometric mean; 1.11-1.18x
 * from T = 512, 0.96-1.01x at 128), 128 no better; the avx2 build with 32 1.01-1.03x, 64 0.95x
 * (0.81x at T = 128). Fewer where the blocks would not give every thread two (query_block). Any
 * size gives the same bits: a row meets its keys in the same key blocks. prefill_query_block()
 * (module.c) sets it. */

static long query_block(long B, long Hkv, long T) {
    const long want = 2L * omp_get_max_threads();
    long pq = hw_pa_queries;
    while (pq > 16 && B * Hkv * ((T + pq - 1) / pq) < want) pq /= 2;
    return pq;
}
/* A thread's buffers, for R = G PQ rows of D channels (one allocation, each part 64-byte aligned). */
static int scratch_alloc(struct pa_scratch *w, long R, long D) {
    const long a = 16, RD = (R * D + a - 1) / a * a, Ra = (R + a - 1) / a * a;  /* floats, rounded to 64 bytes */
    const long PK = hw_pa_keys, n = 2 * RD + R * PK + 3 * Ra;
    float *f = w->mem = aligned_alloc(64, (size_t)n * sizeof(float));
    if (!f) return -1;
    w->qs = f, f += RD;
    w->os = f, f += RD;
    w->kt = NULL; /* points into the call's packed K (pack_keys), block by block */
    w->p = f, f += R * PK;
    w->m = f, f += Ra;
    w->l = f, f += Ra;
    w->alpha = f;
    return 0;
}

/* Keys [s0, s0 + nk) of one KV head transposed into dst (D, PK), zeros before key lo (outside every
 * window: never read) and past nk: the layout the score tiles read. Rows are read whole (K's rows
 * may be far apart: 3C floats in a layer's fused QKV). */
static void pack_keys(float *dst, const float *kh, long sk_t, long s0, long nk, long lo, long D) {
    const long PK = hw_pa_keys, j0 = lo > s0 ? lo - s0 : 0;
    if (j0 > 0 || nk < PK) memset(dst, 0, (size_t)(D * PK) * sizeof(float)); /* whole rows: not column by column */
    for (long j = j0; j < nk; j++) {
        const float *kr = kh + (s0 + j) * sk_t;
        for (long d = 0; d < D; d++) dst[d * PK + j] = kr[d];
    }
}

/* One work item: the G heads of KV head (b, hk) for tokens [t0, t0 + nt); kp: that head's packed keys. */
static void block(struct pa_scratch *w, const float *q, const float *kp, const float *v, float *out, float *lse, long b,
                  long hk, long t0, long nt, long H, long Hkv, long T, long S, long D, long sq_b, long sq_h, long sq_t,
                  long sv_b, long sv_h, long sv_t, long so_b, long so_h, long so_t, float scale, int causal, long left,
                  float cap) {
    const long G = H / Hkv, R = G * nt, off = S - T, PK = hw_pa_keys;
    const float c = scale * 1.4426950408889634f;
    for (long g = 0; g < G; g++)
        for (long i = 0; i < nt; i++) {
            const float *qr = q + b * sq_b + (hk * G + g) * sq_h + (t0 + i) * sq_t;
            float *dst = w->qs + (g * nt + i) * D;
            for (long d = 0; d < D; d++) dst[d] = qr[d] * c;
        }
    for (long r = 0; r < R * D; r++) w->os[r] = 0.0f;
    for (long r = 0; r < R; r++) w->m[r] = -INFINITY, w->l[r] = 0.0f;
    const float *vh = v + b * sv_b + hk * sv_h;
    /* keys the block's last query sees (causal), else all */
    long nkeys = causal ? t0 + nt + off : S;
    if (nkeys > S) nkeys = S;
    /* with a window, the key block holding the first key of the block's first query: earlier blocks
     * are never read (keys before a row's window in the blocks read are masked below) */
    const long vlo = left >= 0 && t0 + off - left > 0 ? t0 + off - left : 0, first = vlo / PK * PK;
    for (long s0 = first; s0 < nkeys; s0 += PK) {
        const long nk = nkeys - s0 < PK ? nkeys - s0 : PK;
        w->kt = (float *)kp + s0 * D; /* block s0 / PK of the pair's packed keys: (D, PK) */
        hw_pa_scores(w, R, D, nk);
        if (cap > 0.0f) /* Gemma 2: base-2 scores s become cap tanh(s ln 2 / cap) log2 e, before masks */
            for (long r = 0; r < R; r++) {
                float *pr = w->p + r * PK;
                for (long j = 0; j < nk; j++) {
                    const float x = fminf(fmaxf(pr[j] * (2.0f / cap), -60.0f), 60.0f); /* 2^x = e^(2 tanh's arg) */
                    pr[j] = (1.0f - 2.0f / (exp2f(x) + 1.0f)) * (cap * 1.4426950408889634f);
                }
            }
        if (left >= 0 && s0 < t0 + nt - 1 + off - left) /* some row's window starts inside or after it */
            for (long r = 0; r < R; r++) {
                long lo = t0 + r % nt + off - left - s0; /* the row's first key, relative to s0 */
                if (lo > nk) lo = nk;
                for (long j = 0; j < lo; j++) w->p[r * PK + j] = -1e30f;
            }
        /* online softmax per row; keys past the row's limit (or past nk) weigh 0 */
        const int diagonal = causal && s0 + PK - 1 > t0 + off;  /* some row may not see every key */
        hw_pa_softmax(w, R, nt, nk, diagonal, t0, off, s0);
        /* V from the block's first key in a window (vlo): before it every row's weight is 0 and the
         * values are never read (a cache may hold anything there) */
        const long jo = vlo > s0 ? vlo - s0 : 0;
        w->p += jo;
        hw_pa_pv(w, vh + (s0 + jo) * sv_t, sv_t, nk - jo, R, D);
        w->p -= jo;
    }
    for (long g = 0; g < G; g++)
        for (long i = 0; i < nt; i++) {
            const long r = g * nt + i, h = hk * G + g;
            float *o = out + b * so_b + h * so_h + (t0 + i) * so_t;
            const float l = w->l[r];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (long d = 0; d < D; d++) o[d] = w->os[r * D + d] * inv;
            if (lse) lse[(b * H + h) * T + t0 + i] = l > 0.0f ? (w->m[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
        }
}

/* causal: 0 none, 1 bottom-right causal, 2 + left causal within a window of left + 1 keys.
 * softcap > 0: scores softcap tanh(s / softcap) before masks (Gemma 2); 0: plain.
 * Returns 0, 1 for a shape the kernel does not take (nothing written), -1 without memory. */
int hw_prefill_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse, long B, long H,
                             long Hkv, long T, long S, long D, long sq_b, long sq_h, long sq_t, long sk_b, long sk_h,
                             long sk_t, long sv_b, long sv_h, long sv_t, long so_b, long so_h, long so_t, float scale,
                             int causal, float softcap) {
    if (Hkv < 1 || H % Hkv || H / Hkv > MAX_PG || D < 8 || D > MAX_PD || D % 8 || T < 1 || S < 0 ||
        (causal && S < T) || causal < 0)
        return 1;
    const long left = causal >= 2 ? (long)causal - 2 : -1; /* the window's left edge; -1: none */
    const long PQ = query_block(B, Hkv, T), nqb = (T + PQ - 1) / PQ, pairs = B * Hkv;
    /* K packed once per call (pack_keys), key blocks [kb0, nkb) of each (batch, KV head) pair: every query
     * block of the pair reads them. Each query block transposing its own blocks took 29% of the kernel's
     * time at the seed's layer shape (T 2048, H 12, D 64, K rows 3C apart; perf, 1 thread, AMD EPYC Zen 4).
     * At most PACK_BYTES of pairs at a time, so a long context holds no second K. */
    const long PK = hw_pa_keys, nkb = (S + PK - 1) / PK, per = nkb * PK * D; /* floats a pair */
    const long first_key = left >= 0 && S - T - left > 0 ? S - T - left : 0;  /* any query's first key */
    const long kb0 = first_key / PK;
    long chunk = per ? PACK_BYTES / (long)sizeof(float) / per : pairs;
    chunk = chunk < 1 ? 1 : chunk > pairs ? pairs : chunk;
    float *kp = aligned_alloc(64, (size_t)(chunk * per + 16) * sizeof(float));
    if (!kp) return -1;
    int failed = 0;
    #pragma omp parallel
    {
        struct pa_scratch ws, *w = &ws;
        const int ok = scratch_alloc(w, (H / Hkv) * PQ, D) == 0;
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        for (long c0 = 0; c0 < pairs; c0 += chunk) {
            const long np = pairs - c0 < chunk ? pairs - c0 : chunk, nb = nkb - kb0;
            #pragma omp for schedule(static)
            for (long u = 0; u < np * nb; u++) {
                const long pair = c0 + u / nb, s0 = (kb0 + u % nb) * PK;
                pack_keys(kp + (pair - c0) * per + s0 * D, k + pair / Hkv * sk_b + pair % Hkv * sk_h, sk_t, s0,
                          S - s0 < PK ? S - s0 : PK, first_key, D);
            }
            #pragma omp for schedule(dynamic, 1)
            for (long it = 0; it < np * nqb; it++) {
                if (!ok) continue;
                const long qb = nqb - 1 - it % nqb, pair = c0 + it / nqb; /* the longest (last) query blocks first */
                const long hk = pair % Hkv, b = pair / Hkv, t0 = qb * PQ;
                block(w, q, kp + (pair - c0) * per, v, out, lse, b, hk, t0, T - t0 < PQ ? T - t0 : PQ, H, Hkv, T, S,
                      D, sq_b, sq_h, sq_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, scale, causal != 0, left, softcap);
            }
        }
        if (ok) free(w->mem);
    }
    free(kp);
    return failed ? -1 : 0;
}
