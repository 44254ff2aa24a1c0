/* Prefill attention's tiles in the avx512 variant (generic/prefill_attention.c has the method): blocks
 * of 64 keys, scores 6 rows x 64 keys and P V 6 rows x 64 channels in zmm, the channels past the
 * last 16 (D % 16) in 6-row ymm tiles, the softmax 16 lanes at a time. */
#include <immintrin.h>
#include <math.h>

#include "../../generic/kernels.h"
#include "vec.h" /* exp2_ps_z */

enum { PK = 64 }; /* keys per block: four zmm of scores a row */
#define PA_PV_ROWS 6
#include "../avx2/prefill_pv.h"

const long hw_pa_keys = PK;
int hw_pa_queries = PK;  /* query tokens a block, PK unless set (generic/prefill_attention.c: why) */

/* Scores of 6 rows x 64 keys (four zmm a row), P V of 6 rows x 64 channels. */
#define SRBZ 6
#define ORBZ 6
/* NC of the four zmm columns: a block of fewer keys (a short prefill, the last block) computes only those. */
static inline __attribute__((always_inline)) void tile_scores_f32_6x64_zmm(const float *qs, const float *kt, float *p,
                                                                           long D, int RB, int NC) {
    __m512 a[SRBZ][4];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC; c++) a[r][c] = _mm512_setzero_ps();
    for (long d = 0; d < D; d++) {
        const float *kd = kt + d * PK;
        __m512 kc[4];
        for (int c = 0; c < NC; c++) kc[c] = _mm512_load_ps(kd + 16 * c);
        for (int r = 0; r < RB; r++) {
            const __m512 b = _mm512_set1_ps(qs[r * D + d]);
            for (int c = 0; c < NC; c++) a[r][c] = _mm512_fmadd_ps(b, kc[c], a[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC; c++) _mm512_store_ps(p + r * PK + 16 * c, a[r][c]);
}

static inline __attribute__((always_inline)) void tile_pv_f32_6x64_zmm(float *os, const float *p, const float *alpha,
                                                                       const float *v, long sv_t, long nk, long D,
                                                                       long d0, int RB, int NV) {
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
#define SCORE_NC_Z(n)                                                                              \
    switch (nc) {                                                                                  \
        case 1: tile_scores_f32_6x64_zmm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 1); break;     \
        case 2: tile_scores_f32_6x64_zmm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 2); break;     \
        case 3: tile_scores_f32_6x64_zmm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 3); break;     \
        default: tile_scores_f32_6x64_zmm(w->qs + r * D, w->kt, w->p + r * PK, D, n, 4); break;    \
    }
#define SCORE_CASE_Z(n) \
    case n: SCORE_NC_Z(n) break;
#define PVZ_CASES(n)                                                                      \
    switch (nv) {                                                                         \
        case 1: tile_pv_f32_6x64_zmm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 1); break;             \
        case 2: tile_pv_f32_6x64_zmm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 2); break;             \
        case 3: tile_pv_f32_6x64_zmm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 3); break;             \
        default: tile_pv_f32_6x64_zmm(os_r, p_r, al_r, vb, sv_t, nk, D, d0, n, 4); break;            \
    }

void hw_pa_scores(struct pa_scratch *w, long R, long D, long nk) {
    const long nc = (nk + 15) / 16;
    for (long r = 0; r < R;) {
        const long rb = R - r < SRBZ ? R - r : SRBZ;
        switch (rb) {
            SCORE_CASE_Z(1) SCORE_CASE_Z(2) SCORE_CASE_Z(3) SCORE_CASE_Z(4) SCORE_CASE_Z(5)
            default: SCORE_NC_Z(SRBZ) break;
        }
        r += rb;
    }
}

void hw_pa_softmax(struct pa_scratch *w, long R, long nt, long nk, int diagonal, long t0, long off, long s0) {
    const __m512 lanez = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
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
        const float mn = w->m[r] > mx ? w->m[r] : mx;
        w->alpha[r] = exp2f(w->m[r] - mn);  /* 0 on the row's first block (m = -inf) */
        w->m[r] = mn;
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
    }
}

void hw_pa_pv(struct pa_scratch *w, const float *vb, long sv_t, long nk, long R, long D) {
    long dz = 0;  /* channels done in zmm */
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
    for (long d0 = dz; d0 < D; d0 += 32) {
        const long nv = (D - d0) / 8 < 4 ? (D - d0) / 8 : 4;
        for (long r = 0; r < R;) {
            const long rb = R - r < PA_PV_ROWS ? R - r : PA_PV_ROWS;
            float *os_r = w->os + r * D;
            const float *p_r = w->p + r * PK, *al_r = w->alpha + r;
            switch (rb) {
                case 1: PV_CASES(1) break;
                case 2: PV_CASES(2) break;
                case 3: PV_CASES(3) break;
                case 4: PV_CASES(4) break;
                case 5: PV_CASES(5) break;
                default: PV_CASES(PA_PV_ROWS) break;
            }
            r += rb;
        }
    }
}
