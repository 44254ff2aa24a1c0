/* Prefill attention's tiles in AVX2 (generic/prefill_attention.c has the method): blocks of 32 keys,
 * scores 3 rows x 32 keys and P V 3 rows x 32 channels in ymm (16 registers). P V took 2 rows
 * (8 accumulators: just the 2 FMA pipes x 4 cycles of latency) until 3 rows (12) measured 1.10-1.18x
 * faster over the whole kernel (the seed layer's H 12, D 64, T 1024-2048, causal and not; 1 thread,
 * AMD EPYC Zen 4 running this build, interleaved; 6 rows x 16 channels: 1.13x). */
#include <immintrin.h>
#include <math.h>

#include "../../generic/kernels.h"
#include "vec.h" /* exp2_ps */

enum { PK = 32 }; /* keys per block */
#define SRB 3 /* 16 registers: 3 x 4 + 4 for the scores, 3 x 4 + 4 for P V (a column read as an operand) */
#define PA_PV_ROWS 3
#include "prefill_pv.h"

const long hw_pa_keys = PK;
int hw_pa_queries = PK;  /* query tokens a block, PK unless set (generic/prefill_attention.c: why) */

/* Scores of rows [r0, r0 + RB) against the PK keys of kt (D x PK): p[r][0..PK). */
/* NC of the four ymm columns: a block of fewer keys (a short prefill, the last block) computes only those. */
static inline __attribute__((always_inline)) void tile_scores_f32_3x32_ymm(const float *qs, const float *kt, float *p,
                                                                           long D, int RB, int NC) {
    __m256 a[SRB][4];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC; c++) a[r][c] = _mm256_setzero_ps();
    for (long d = 0; d < D; d++) {
        const float *kd = kt + d * PK;
        __m256 kc[4];
        for (int c = 0; c < NC; c++) kc[c] = _mm256_load_ps(kd + 8 * c);
        for (int r = 0; r < RB; r++) { /* RB and NC are constants at each call site: unrolled */
            const __m256 b = _mm256_broadcast_ss(qs + r * D + d);
            for (int c = 0; c < NC; c++) a[r][c] = _mm256_fmadd_ps(b, kc[c], a[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC; c++) _mm256_store_ps(p + r * PK + 8 * c, a[r][c]);
}

#define SCORE_NC(n)                                                                               \
    switch (nc) {                                                                                 \
        case 1: tile_scores_f32_3x32_ymm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 1); break;    \
        case 2: tile_scores_f32_3x32_ymm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 2); break;    \
        case 3: tile_scores_f32_3x32_ymm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 3); break;    \
        default: tile_scores_f32_3x32_ymm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 4); break;   \
    }
#define SCORE_CASE(n) \
    case n: SCORE_NC(n) break;

void hw_pa_scores(struct pa_scratch *w, long R, long D, long nk) {
    const long nc = (nk + 7) / 8;
    for (long r = 0; r < R;) {
        const long rb = R - r < SRB ? R - r : SRB;
        switch (rb) {
            SCORE_CASE(1) SCORE_CASE(2)
            default: SCORE_NC(SRB) break;
        }
        r += rb;
    }
}

void hw_pa_softmax(struct pa_scratch *w, long R, long nt, long nk, int diagonal, long t0, long off, long s0) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), zero = _mm256_setzero_ps();
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
        const float mn = w->m[r] > mx ? w->m[r] : mx;
        w->alpha[r] = exp2f(w->m[r] - mn);  /* 0 on the row's first block (m = -inf) */
        w->m[r] = mn;
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
    }
}

void hw_pa_pv(struct pa_scratch *w, const float *vb, long sv_t, long nk, long R, long D) {
    for (long d0 = 0; d0 < D; d0 += 32) {
        const long nv = (D - d0) / 8 < 4 ? (D - d0) / 8 : 4;
        for (long r = 0; r < R;) {
            const long rb = R - r < PA_PV_ROWS ? R - r : PA_PV_ROWS;
            float *os_r = w->os + r * D;
            const float *p_r = w->p + r * PK, *al_r = w->alpha + r;
            switch (rb) {
                case 1: PV_CASES(1) break;
                case 2: PV_CASES(2) break;
                default: PV_CASES(PA_PV_ROWS) break;
            }
            r += rb;
        }
    }
}
