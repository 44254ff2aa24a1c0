/* Causal (or unmasked) attention of a prefill on CPU: softmax(q k^T * scale) v for many query rows.
 *
 * A prefill's attention is T queries against S keys per head, T x S x D multiply-adds twice:
 * arithmetic, not a memory stream. Per (batch, KV head, block of PQ tokens) the G query heads of
 * the KV group are G x PQ rows against the same K and V blocks (the GQA fold), so each block of
 * PK keys is read once for all of them: scores S = Q K^T as register tiles (K's block transposed
 * first, so the vectors run over keys), an online softmax per row in base 2 (q pre-scaled by
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
 * q (B, H, T, D), k, v (B, Hkv, S, D), out (B, H, T, D): each row's D floats contiguous, the other
 * strides given (floats). lse (B, H, T) contiguous natural-log LSE, or NULL. H = G Hkv. Needs
 * AVX2 + FMA; D a multiple of 8 up to MAX_PD, G up to MAX_PG.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "common.h" /* exp2_ps */

#if defined(__AVX512F__)
enum { PK = 64 }; /* keys per block: four zmm of scores a row */
#else
enum { PK = 32 };
#endif
enum { MAX_PG = 16, MAX_PD = 256 };
/* Query tokens per block, at most (a block's rows are G x that many; each key block is transposed
 * and read once per block): PK, so that a causal block's diagonal tile is square. Against 16, the
 * first tuning (benchmarks/prefill_query_block.py, AMD EPYC Zen 5, 2 threads, SmolLM2's and a
 * Llama-8B's shapes, T = 128-4096): the avx512 build with 64 1.11x (geometric mean; 1.11-1.18x
 * from T = 512, 0.96-1.01x at 128), 128 no better; the avx2 build with 32 1.01-1.03x, 64 0.95x
 * (0.81x at T = 128). Fewer where the blocks would not give every thread two (query_block). Any
 * size gives the same bits: a row meets its keys in the same key blocks. prefill_query_block()
 * (_module.c) sets it. */
int hw_pa_queries = PK;

static long query_block(long B, long Hkv, long T) {
    const long want = 2L * omp_get_max_threads();
    long pq = hw_pa_queries;
    while (pq > 16 && B * Hkv * ((T + pq - 1) / pq) < want) pq /= 2;
    return pq;
}
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define SRB 6 /* 32 vector registers: 6 rows x 4 accumulators + 4 operands (macros: the #if below) */
#define ORB 6
#else
#define SRB 3 /* 16: 3 x 4 + 4 for the scores; 2 x 4 + 4 + 1 for P V */
#define ORB 2
#endif

/* A thread's buffers, for R = G PQ rows of D channels (one allocation, each part 64-byte aligned). */
struct scratch {
    float *qs;  /* (R, D) the rows' queries, pre-scaled */
    float *os;  /* (R, D) their outputs so far (unnormalized) */
    float *kt;  /* (D, PK) a key block transposed */
    float *p;   /* (R, PK) scores, then probabilities */
    float *m, *l, *alpha;  /* (R) */
    void *mem;
};

static int scratch_alloc(struct scratch *w, long R, long D) {
    const long a = 16, RD = (R * D + a - 1) / a * a, Ra = (R + a - 1) / a * a;  /* floats, rounded to 64 bytes */
    const long n = 2 * RD + D * PK + R * PK + 3 * Ra;
    float *f = w->mem = aligned_alloc(64, (size_t)n * sizeof(float));
    if (!f) return -1;
    w->qs = f, f += RD;
    w->os = f, f += RD;
    w->kt = f, f += D * PK;
    w->p = f, f += R * PK;
    w->m = f, f += Ra;
    w->l = f, f += Ra;
    w->alpha = f;
    return 0;
}

/* Scores of rows [r0, r0 + RB) against the PK keys of kt (D x PK): p[r][0..PK). */
static inline __attribute__((always_inline)) void score_tile(const float *qs, const float *kt, float *p, long D,
                                                             int RB) {
    __m256 a[SRB][4];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
    for (long d = 0; d < D; d++) {
        const float *kd = kt + d * PK;
        const __m256 k0 = _mm256_load_ps(kd), k1 = _mm256_load_ps(kd + 8), k2 = _mm256_load_ps(kd + 16),
                     k3 = _mm256_load_ps(kd + 24);
        for (int r = 0; r < RB; r++) { /* RB is a constant at each call site: unrolled */
            const __m256 b = _mm256_broadcast_ss(qs + r * D + d);
            a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(b, k2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(b, k3, a[r][3]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < 4; c++) _mm256_store_ps(p + r * PK + 8 * c, a[r][c]);
}

/* os rows [r0, r0 + RB), channels [d0, d0 + 8 NV): os = os * alpha + P V over the block's nk keys. */
static inline __attribute__((always_inline)) void pv_tile(float *os, const float *p, const float *alpha,
                                                          const float *v, long sv_t, long nk, long D, long d0,
                                                          int RB, int NV) {
    __m256 a[ORB][4];
    for (int r = 0; r < RB; r++) {
        const __m256 s = _mm256_broadcast_ss(alpha + r);
        for (int c = 0; c < NV; c++) a[r][c] = _mm256_mul_ps(_mm256_loadu_ps(os + r * D + d0 + 8 * c), s);
    }
    for (long j = 0; j < nk; j++) {
        const float *vj = v + j * sv_t + d0;
        __m256 w[4];
        for (int c = 0; c < NV; c++) w[c] = _mm256_loadu_ps(vj + 8 * c);
        for (int r = 0; r < RB; r++) {
            const __m256 b = _mm256_broadcast_ss(p + r * PK + j);
            for (int c = 0; c < NV; c++) a[r][c] = _mm256_fmadd_ps(b, w[c], a[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NV; c++) _mm256_storeu_ps(os + r * D + d0 + 8 * c, a[r][c]);
}

#if defined(__AVX512F__)
/* The avx512 build's tiles: scores of 12 rows x 32 keys (two zmm a row), P V of 6 rows x 64 channels. */
#define SRBZ 6
#define ORBZ 6
static inline __attribute__((always_inline)) void score_tile_z(const float *qs, const float *kt, float *p, long D,
                                                               int RB) {
    __m512 a[SRBZ][4];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (long d = 0; d < D; d++) {
        const float *kd = kt + d * PK;
        const __m512 k0 = _mm512_load_ps(kd), k1 = _mm512_load_ps(kd + 16), k2 = _mm512_load_ps(kd + 32),
                     k3 = _mm512_load_ps(kd + 48);
        for (int r = 0; r < RB; r++) {
            const __m512 b = _mm512_set1_ps(qs[r * D + d]);
            a[r][0] = _mm512_fmadd_ps(b, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(b, k1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(b, k2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(b, k3, a[r][3]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(p + r * PK + 16 * c, a[r][c]);
}

static inline __attribute__((always_inline)) void pv_tile_z(float *os, const float *p, const float *alpha,
                                                            const float *v, long sv_t, long nk, long D, long d0,
                                                            int RB, int NV) {
    __m512 a[ORBZ][4];
    for (int r = 0; r < RB; r++) {
        const __m512 s = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < NV; c++) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(os + r * D + d0 + 16 * c), s);
    }
    for (long j = 0; j < nk; j++) {
        const float *vj = v + j * sv_t + d0;
        __m512 w[4];
        for (int c = 0; c < NV; c++) w[c] = _mm512_loadu_ps(vj + 16 * c);
        for (int r = 0; r < RB; r++) {
            const __m512 b = _mm512_set1_ps(p[r * PK + j]);
            for (int c = 0; c < NV; c++) a[r][c] = _mm512_fmadd_ps(b, w[c], a[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(os + r * D + d0 + 16 * c, a[r][c]);
}
#define SCORE_CASE_Z(n) \
    case n: score_tile_z(w->qs + r * D, w->kt, w->p + r * PK, D, n); break;
#define PVZ_CASES(n)                                                                      \
    switch (nv) {                                                                         \
        case 1: pv_tile_z(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 1); break;             \
        case 2: pv_tile_z(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 2); break;             \
        case 3: pv_tile_z(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 3); break;             \
        default: pv_tile_z(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 4); break;            \
    }
#endif

#define SCORE_CASE(n) \
    case n: score_tile(w->qs + r * D, w->kt, w->p + r * PK, D, n); break;
#define PV_CASES(n)                                                                       \
    switch (nv) {                                                                         \
        case 1: pv_tile(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 1); break;               \
        case 2: pv_tile(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 2); break;               \
        case 3: pv_tile(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 3); break;               \
        default: pv_tile(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 4); break;              \
    }

/* One work item: the G heads of KV head (b, hk) for tokens [t0, t0 + nt). */
static void block(struct scratch *w, const float *q, const float *k, const float *v, float *out, float *lse,
                  long b, long hk, long t0, long nt, long H, long Hkv, long T, long S, long D, long sq_b, long sq_h,
                  long sq_t, long sk_b, long sk_h, long sk_t, long sv_b, long sv_h, long sv_t, long so_b, long so_h,
                  long so_t, float scale, int causal) {
    const long G = H / Hkv, R = G * nt, off = S - T;
    const float c = scale * 1.4426950408889634f;
    for (long g = 0; g < G; g++)
        for (long i = 0; i < nt; i++) {
            const float *qr = q + b * sq_b + (hk * G + g) * sq_h + (t0 + i) * sq_t;
            float *dst = w->qs + (g * nt + i) * D;
            for (long d = 0; d < D; d++) dst[d] = qr[d] * c;
        }
    for (long r = 0; r < R * D; r++) w->os[r] = 0.0f;
    for (long r = 0; r < R; r++) w->m[r] = -INFINITY, w->l[r] = 0.0f;
    const float *kh = k + b * sk_b + hk * sk_h, *vh = v + b * sv_b + hk * sv_h;
    /* keys the block's last query sees (causal), else all */
    long nkeys = causal ? t0 + nt + off : S;
    if (nkeys > S) nkeys = S;
#if defined(__AVX512F__)
    const __m512 lanez = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), zero = _mm256_setzero_ps();
#endif
    for (long s0 = 0; s0 < nkeys; s0 += PK) {
        const long nk = nkeys - s0 < PK ? nkeys - s0 : PK;
        for (long d = 0; d < D; d++) {
            float *kd = w->kt + d * PK;
            for (long j = 0; j < nk; j++) kd[j] = kh[(s0 + j) * sk_t + d];
            for (long j = nk; j < PK; j++) kd[j] = 0.0f;
        }
#if defined(__AVX512F__)
        for (long r = 0; r < R;) {
            const long rb = R - r < SRBZ ? R - r : SRBZ;
            switch (rb) {
                SCORE_CASE_Z(1) SCORE_CASE_Z(2) SCORE_CASE_Z(3) SCORE_CASE_Z(4) SCORE_CASE_Z(5)
                default: score_tile_z(w->qs + r * D, w->kt, w->p + r * PK, D, SRBZ); break;
            }
            r += rb;
        }
#else
        for (long r = 0; r < R;) {
            const long rb = R - r < SRB ? R - r : SRB;
            switch (rb) {
                SCORE_CASE(1) SCORE_CASE(2)
                default: score_tile(w->qs + r * D, w->kt, w->p + r * PK, D, SRB); break;
            }
            r += rb;
        }
#endif
        /* online softmax per row; keys past the row's limit (or past nk) weigh 0 */
        const int diagonal = causal && s0 + PK - 1 > t0 + off;  /* some row may not see every key */
        for (long r = 0; r < R; r++) {
            const long i = r % nt;
            long lim = nk;  /* keys of this block the row sees */
            if (diagonal) {
                const long last = t0 + i + off - s0;  /* the row's last key, relative to s0 */
                lim = last + 1 < nk ? last + 1 : nk;
            }
            float *pr = w->p + r * PK;
            if (lim <= 0) {  /* nothing in this block for this row */
                w->alpha[r] = 1.0f;
                for (long j = 0; j < PK; j++) pr[j] = 0.0f;
                continue;
            }
            const int full = lim == PK;  /* every key of the block: no lane to mask */
#if defined(__AVX512F__)
            const __m512 limz = _mm512_set1_ps((float)lim);
            __m512 mxz = _mm512_set1_ps(-INFINITY);
            for (int cb = 0; cb < PK / 16; cb++) {
                __m512 s = _mm512_load_ps(pr + 16 * cb);
                if (!full) {
                    const __mmask16 valid =
                        _mm512_cmp_ps_mask(_mm512_add_ps(lanez, _mm512_set1_ps(16.0f * cb)), limz, _CMP_LT_OQ);
                    s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), s);
                    _mm512_store_ps(pr + 16 * cb, s);
                }
                mxz = _mm512_max_ps(mxz, s);
            }
            const float mx = _mm512_reduce_max_ps(mxz);  /* max is exact: any order */
#else
            const __m256 limv = _mm256_set1_ps((float)lim);
            __m256 mxv = _mm256_set1_ps(-INFINITY);
            for (int cb = 0; cb < PK / 8; cb++) {
                __m256 s = _mm256_load_ps(pr + 8 * cb);
                if (!full) {
                    const __m256 valid =
                        _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.0f * cb)), limv, _CMP_LT_OQ);
                    s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid);
                    _mm256_store_ps(pr + 8 * cb, s);
                }
                mxv = _mm256_max_ps(mxv, s);
            }
            __m128 hx = _mm_max_ps(_mm256_castps256_ps128(mxv), _mm256_extractf128_ps(mxv, 1));
            hx = _mm_max_ps(hx, _mm_movehl_ps(hx, hx));
            hx = _mm_max_ss(hx, _mm_movehdup_ps(hx));
            const float mx = _mm_cvtss_f32(hx);
#endif
            const float mn = w->m[r] > mx ? w->m[r] : mx;
            w->alpha[r] = exp2f(w->m[r] - mn);  /* 0 on the row's first block (m = -inf) */
            w->m[r] = mn;
#if defined(__AVX512F__)
            __m512 sumz = _mm512_setzero_ps();
            for (int cb = 0; cb < PK / 16; cb++) {
                __m512 e = exp2_ps_z(_mm512_sub_ps(_mm512_load_ps(pr + 16 * cb), _mm512_set1_ps(mn)));
                if (!full)
                    e = _mm512_maskz_mov_ps(
                        _mm512_cmp_ps_mask(_mm512_add_ps(lanez, _mm512_set1_ps(16.0f * cb)), limz, _CMP_LT_OQ), e);
                _mm512_store_ps(pr + 16 * cb, e);
                sumz = _mm512_add_ps(sumz, e);
            }
            w->l[r] = w->l[r] * w->alpha[r] + _mm512_reduce_add_ps(sumz);
#else
            __m256 sum = zero;
            for (int cb = 0; cb < PK / 8; cb++) {
                __m256 e = exp2_ps(_mm256_sub_ps(_mm256_load_ps(pr + 8 * cb), _mm256_set1_ps(mn)));
                if (!full)
                    e = _mm256_and_ps(
                        e, _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.0f * cb)), limv, _CMP_LT_OQ));
                _mm256_store_ps(pr + 8 * cb, e);
                sum = _mm256_add_ps(sum, e);
            }
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            w->l[r] = w->l[r] * w->alpha[r] + _mm_cvtss_f32(h);
#endif
        }
        const float *vb = vh + s0 * sv_t;
        long dz = 0;  /* channels done in zmm */
#if defined(__AVX512F__)
        for (; dz + 16 <= D; dz += 64) {
            const long d0 = dz, nv = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
            for (long r = 0; r < R;) {
                const long rb = R - r < ORBZ ? R - r : ORBZ;
                float *os_r = w->os + r * D;
                const float *p_r = w->p + r * PK, *al_r = w->alpha + r;
                switch (rb) {
                    case 1: PVZ_CASES(1) break;
                    case 2: PVZ_CASES(2) break;
                    case 3: PVZ_CASES(3) break;
                    case 4: PVZ_CASES(4) break;
                    case 5: PVZ_CASES(5) break;
                    default: PVZ_CASES(ORBZ) break;
                }
                r += rb;
            }
            if (nv < 4) { dz = d0 + 16 * nv; break; }
        }
        if (dz > D) dz = D;
#endif
        for (long d0 = dz; d0 < D; d0 += 32) {
            const long nv = (D - d0) / 8 < 4 ? (D - d0) / 8 : 4;
            for (long r = 0; r < R;) {
                const long rb = R - r < ORB ? R - r : ORB;
                float *os_r = w->os + r * D;
                const float *p_r = w->p + r * PK, *al_r = w->alpha + r;
                switch (rb) {
                    case 1: PV_CASES(1) break;
#if ORB > 2
                    case 2: PV_CASES(2) break;
                    case 3: PV_CASES(3) break;
                    case 4: PV_CASES(4) break;
                    case 5: PV_CASES(5) break;
#endif
                    default: PV_CASES(ORB) break;
                }
                r += rb;
            }
        }
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

/* Returns 0, 1 for a shape the kernel does not take (nothing written), -1 without memory. */
int hw_prefill_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse, long B, long H,
                             long Hkv, long T, long S, long D, long sq_b, long sq_h, long sq_t, long sk_b, long sk_h,
                             long sk_t, long sv_b, long sv_h, long sv_t, long so_b, long so_h, long so_t, float scale,
                             int causal) {
    if (Hkv < 1 || H % Hkv || H / Hkv > MAX_PG || D < 8 || D > MAX_PD || D % 8 || T < 1 || S < 0 ||
        (causal && S < T))
        return 1;
    const long PQ = query_block(B, Hkv, T), nqb = (T + PQ - 1) / PQ, items = B * Hkv * nqb;
    int failed = 0;
    #pragma omp parallel
    {
        struct scratch ws, *w = &ws;
        const int ok = scratch_alloc(w, (H / Hkv) * PQ, D) == 0;
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            if (!ok) continue;
            const long qb = nqb - 1 - it % nqb, rest = it / nqb;  /* the longest (last) query blocks first */
            const long hk = rest % Hkv, b = rest / Hkv, t0 = qb * PQ;
            block(w, q, k, v, out, lse, b, hk, t0, T - t0 < PQ ? T - t0 : PQ, H, Hkv, T, S, D, sq_b, sq_h, sq_t,
                  sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, scale, causal);
        }
        if (ok) free(w->mem);
    }
    return failed ? -1 : 0;
}
