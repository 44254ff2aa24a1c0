/* One decode step of a decoder layer (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3: the block as
 * the descriptor below says) in one call, for M rows that each add one token to a KV cache:
 *
 *     qkv = linear(rmsnorm(x))  + [QK-norm] + RoPE on q, k   (small_linear.c or quant_linear.c)
 *     K[b, :, pos_b] = k; V[b, :, pos_b] = v                 (the cache, written in place)
 *     o   = softmax(q K[w_b : pos_b + 1]^T * scale) V        (decode_attention.c: every key up to
 *                                                             pos_b, or the layer's window of them)
 *     h   = linear(o) + x              or x + rmsnorm(linear(o)) with a post-norm (Gemma)
 *     y   = linear(glu(linear(rmsnorm(h)))) + h    (or its post-norm); glu SwiGLU or GeGLU
 *
 * The same kernels the decoder block's few-rows route calls one by one from Python; chained
 * here, a layer costs one call instead of ~40 Python-level operations (~350 us a layer on this
 * 2-core machine: at batch 1 more than the layer's matmuls). Each linear is described by three
 * int64s (fmt, weight, bias): fmt -1 is an fp32 weight in kernels.block_weight's layout, else a
 * GGML type id (| 0x100 packed) of quant_linear.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static int linear(const int64_t *lin, const float *x, const float *r, float *y, long M, long O, long I, int kind,
                  const float *norm_w, float eps, const float *cos, const float *sin, long rot_cols, long head_dim) {
    const float *b = (const float *)(intptr_t)lin[2];
    if (lin[0] < 0)
        return hw_small_linear_f32((const float *)(intptr_t)lin[1], x, b, r, y, M, O, I, kind, norm_w, eps, cos, sin,
                                   rot_cols, head_dim);
    return hw_quant_linear((int)lin[0], (const uint8_t *)(intptr_t)lin[1], x, b, r, y, M, O, I, kind, norm_w, eps,
                           cos, sin, rot_cols, head_dim);
}

/* Row m's attention over its n keys, the first at key row `first` (hw_decoder_step's K/V layout:
 * base[m] elements in, or its block table): keys first .. first + n - 1, consecutive rows of a
 * contiguous cache or of a ring, or positions of a paged sequence through its table. A table
 * whose window starts inside a block (first % bs) is read through a table of each key's row.
 * cap > 0: soft-capped scores (Gemma 2), each KV head through hw_decode_pair_capped. */
static int attend_row(const float *q, const void *kc, const void *vc, const float *ks, const float *vs, float *o,
                      const int64_t *base, const int64_t *table, long tw, long bs, long first, long n, long Hkv,
                      long H, long D, long s_h, long s_t, float scale, float cap, long m, int et) {
    const long HD = H * D, G = H / Hkv, es = hw_kv_bytes(et); /* bytes per element */
    const int64_t *tab = table ? table + m * tw + first / bs : NULL;
    int64_t *rows = NULL;
    long at = 0;
    if (!table)
        at = base[m] + first * s_t;
    else if (first % bs) {
        rows = malloc(sizeof(int64_t) * (size_t)n);
        if (!rows) return -1;
        for (long t = 0; t < n; t++) rows[t] = table[m * tw + (first + t) / bs] * bs + (first + t) % bs;
        tab = rows, bs = 1;
    }
    int rc = 0;
    if (cap > 0.0f)
        for (long h = 0; h < Hkv; h++) {
            const long a = at + h * s_h;
            hw_decode_pair_capped((const char *)kc + a * es, (const char *)vc + a * es, ks ? ks + a / D : NULL,
                                  ks ? vs + a / D : NULL, q + m * HD + h * G * D, o + m * HD + h * G * D, NULL, n, G,
                                  D, s_t, s_t, scale, tab, bs, cap, et);
        }
    else
        rc = hw_decode_attention_seq(q + m * HD, (const char *)kc + at * es, (const char *)vc + at * es,
                                     ks ? ks + at / D : NULL, ks ? vs + at / D : NULL, o + m * HD, Hkv, G, D, s_h, s_t,
                                     n, scale, tab, bs, et);
    free(rows);
    return rc;
}

/* The q | k | v rows (M, QKV) of split projections: q = lin (H D rows), k, v = split's two (fmt,
 * weight, bias) triples (Hkv D rows each), each its own call (the RMSNorm prologue recomputed, RoPE
 * on q's and k's heads where cos is given), then interleaved as the fused matrix's rows would give them. */
static int split_qkv(const int64_t *lin, const int64_t *split, const float *attn_norm, float eps, const float *x,
                     float *qkv, float *tmp, long M, long C, long H, long Hkv, long D, const float *cos,
                     const float *sin) {
    const long HD = H * D, KD = Hkv * D, QKV = HD + 2 * KD;
    float *qb = tmp, *kb = qb + M * HD, *vb = kb + M * KD;
    int rc = linear(lin, x, NULL, qb, M, HD, C, PRO_RMSNORM, attn_norm, eps, cos, sin, HD, D);
    if (!rc) rc = linear(split, x, NULL, kb, M, KD, C, PRO_RMSNORM, attn_norm, eps, cos, sin, KD, D);
    if (!rc) rc = linear(split + 3, x, NULL, vb, M, KD, C, PRO_RMSNORM, attn_norm, eps, NULL, NULL, 0, 0);
    if (rc) return rc;
    for (long m = 0; m < M; m++) {
        memcpy(qkv + m * QKV, qb + m * HD, sizeof(float) * (size_t)HD);
        memcpy(qkv + m * QKV + HD, kb + m * KD, sizeof(float) * (size_t)KD);
        memcpy(qkv + m * QKV + HD + KD, vb + m * KD, sizeof(float) * (size_t)KD);
    }
    return 0;
}

/* y = r + rmsnorm(t) w (Gemma's norm after the attention's or the MLP's output, before the residual). */
static void post_norm_add(float *t, const float *w, float eps, const float *r, float *y, long M, long C) {
    hw_prologue(PRO_RMSNORM, t, w, eps, t, M, C);
    for (long i = 0; i < M * C; i++) y[i] = r[i] + t[i];
}

/* Each layer's step is described by STACK_FIELDS int64s (the order below; pointers as integers, 0
 * for none) and FL_FIELDS floats:
 *   ST_LIN: 4 x (fmt, weight, bias) for qkv (C -> (H + 2 Hkv) D; or q with ST_SPLIT), out (H D -> C),
 *     gate_up (C -> 2F), down (F -> C). fmt -1 is an fp32 weight in kernels.block_weight's layout.
 *   ST_ATTN_NORM, ST_MLP_NORM: the RMSNorm weights (C,) before attention and before the MLP.
 *   ST_K, ST_V (and int8 scales ST_KS, ST_VS, else 0): this layer's K and V, stored as ST_KV (kernels.h's
 *     KV_F32, KV_I8, KV_BF16, KV_F16; the new keys rounded to it as torch's .to() does), row m's key row t
 *     at kc + base[m] + h s_h + t s_t (elements; each key's D contiguous): a contiguous cache's
 *     sequence m, or the run of consecutive blocks a paged sequence holds. With ST_TABLE (M, tw)
 *     given (base then unused), row t is at kc + h s_h + (table[m][t / bs] * bs + t % bs) s_t: a
 *     paged pool's blocks wherever they lie. ks, vs given: K and V are int8 planes
 *     (cache/quantized.py: one fp32 scale per key row at the row's element offset / D); the new
 *     keys are quantized as its quantize_int8 does, bit for bit, and attention reads the int8 rows.
 *   ST_POS (M,): the position of each row's new key; it then attends over the keys up to it.
 *   ST_COS, ST_SIN (M, D / 2): the RoPE rows of this layer's rotary.
 *   ST_SPLIT: -2 for a fused q | k | v, else the k and v projections' triples (split_qkv).
 *   ST_Q_NORM, ST_K_NORM: QK-norm weights (D,) or 0; ST_POST_ATTN, ST_POST_MLP: post-norm weights
 *     (C,) or 0 (Gemma: x + norm(out(o)), x + norm(mlp(x)); else the residual folds into the matmul).
 *   ST_GLU: the MLP's prologue, PRO_SWIGLU or PRO_GEGLU.
 *   ST_WINDOW: W keys ending at each row's own (a sliding-window layer), 0 for all of them.
 *   ST_ROT: the channels of each q and k head RoPE rotates, D or fewer (Phi-3's partial rotary), even;
 *     cos, sin are then (M, ST_ROT / 2).
 *   ST_RING: R > 0 when the cache is a ring of R rows (key p at row p % R, holding the last R keys;
 *     W must be 0 or >= R), 0 when key p is at row p.
 *   floats: FL_EPS (every RMSNorm's eps but the QK-norm's), FL_SCALE (the scores'), FL_QK_EPS,
 *     FL_SOFTCAP (0: none; else Gemma 2's c tanh(s / c) of the scores, hw_decode_pair_capped).
 * A layer without the Gemma / Qwen3 parts (no QK-norm, no post-norms, SwiGLU, no window or ring)
 * runs exactly the calls it ran before they came. */
enum { ST_LIN = 0, ST_ATTN_NORM = 12, ST_MLP_NORM, ST_K, ST_V, ST_KS, ST_VS, ST_BASE, ST_SH, ST_ST, ST_POS, ST_TABLE,
       ST_TW, ST_BS, ST_H, ST_HKV, ST_D, ST_F, ST_COS, ST_SIN, ST_SPLIT, ST_Q_NORM = ST_SPLIT + 6, ST_K_NORM,
       ST_POST_ATTN, ST_POST_MLP, ST_GLU, ST_WINDOW, ST_ROT, ST_RING, ST_KV, STACK_FIELDS };
enum { FL_EPS, FL_SCALE, FL_QK_EPS, FL_SOFTCAP, FL_FIELDS };

long hw_stack_fields(void) { return STACK_FIELDS; }
long hw_stack_floats(void) { return FL_FIELDS; }

#define PTR(T, v) ((T)(intptr_t)(v))

/* One layer's step of M rows: x, y (M, C). Returns 0, -1 (no memory), -3 (a bad descriptor) or a
 * kernel's code. */
static int hw_decoder_step(const int64_t *d, const float *fl, const float *x, float *y, long M, long C) {
    const int64_t *lin = d + ST_LIN, *split = d[ST_SPLIT] == -2 ? NULL : d + ST_SPLIT;
    const int64_t *base = PTR(const int64_t *, d[ST_BASE]), *pos = PTR(const int64_t *, d[ST_POS]);
    const int64_t *table = PTR(const int64_t *, d[ST_TABLE]);
    const long H = d[ST_H], Hkv = d[ST_HKV], D = d[ST_D], F = d[ST_F], s_h = d[ST_SH], s_t = d[ST_ST];
    const long tw = d[ST_TW], bs = d[ST_BS], W = d[ST_WINDOW], R = d[ST_RING], rd = d[ST_ROT];
    const float *attn_norm = PTR(const float *, d[ST_ATTN_NORM]), *mlp_norm = PTR(const float *, d[ST_MLP_NORM]);
    const float *cos = PTR(const float *, d[ST_COS]), *sin = PTR(const float *, d[ST_SIN]);
    const float *qn = PTR(const float *, d[ST_Q_NORM]), *kn = PTR(const float *, d[ST_K_NORM]);
    const float *post_attn = PTR(const float *, d[ST_POST_ATTN]), *post_mlp = PTR(const float *, d[ST_POST_MLP]);
    char *kc = PTR(char *, d[ST_K]), *vc = PTR(char *, d[ST_V]);
    float *ks = PTR(float *, d[ST_KS]), *vs = PTR(float *, d[ST_VS]);
    const int et = (int)d[ST_KV];
    const long es = hw_kv_bytes(et);
    const float eps = fl[FL_EPS], scale = fl[FL_SCALE], softcap = fl[FL_SOFTCAP];
    const int glu = (int)d[ST_GLU], qk = qn || kn || rd != D, post = post_attn || post_mlp;
    const int bad_ring = R < 0 || (R && (table || (W && W < R)));
    if ((table && bs < 1) || W < 0 || bad_ring || (glu != PRO_SWIGLU && glu != PRO_GEGLU) || rd < 2 || rd > D || rd % 2)
        return -3;
    if (softcap < 0.0f || et < KV_F32 || et > KV_F16 || (et == KV_I8) != (ks != NULL)) return -3;
    const long QKV = (H + 2 * Hkv) * D, HD = H * D;
    float *buf = malloc(sizeof(float) * (size_t)(M * (QKV + 2 * HD + C + 2 * F) + (split ? M * QKV : 0) +
                                                 (post ? M * C : 0)));
    long *first = malloc(sizeof(long) * (size_t)(2 * M)), *lengths = first + M;
    int rc = -1;
    if (!buf || !first) goto done;
    float *qkv = buf, *q = qkv + M * QKV, *o = q + M * HD, *h = o + M * HD, *gu = h + M * C;
    float *t = gu + M * 2 * F + (split ? M * QKV : 0); /* a post-normed output before its norm */
    const float *rc_cos = qk ? NULL : cos, *rc_sin = qk ? NULL : sin; /* QK-norm, partial: RoPE after */
    if (split)
        rc = split_qkv(lin, split, attn_norm, eps, x, qkv, gu + M * 2 * F, M, C, H, Hkv, D, rc_cos, rc_sin);
    else
        rc = linear(lin, x, NULL, qkv, M, QKV, C, PRO_RMSNORM, attn_norm, eps, rc_cos, rc_sin, (H + Hkv) * D, D);
    if (rc) goto done;
    if (qk) hw_qk_norm_rope_rows(qkv, M, QKV, H, Hkv, D, rd, qn, kn, fl[FL_QK_EPS], cos, sin);
    for (long m = 0; m < M; m++) {
        const float *row = qkv + m * QKV;
        memcpy(q + m * HD, row, sizeof(float) * (size_t)HD);
        const long p = pos[m], slot = R ? p % R : p;
        const long key = table ? (table[m * tw + slot / bs] * bs + slot % bs) * s_t : base[m] + slot * s_t;
        for (long j = 0; j < Hkv; j++) {
            const long at = key + j * s_h;
            if (et == KV_I8) {
                hw_quantize_row_i8(row + HD + j * D, D, (int8_t *)kc + at, ks + at / D);
                hw_quantize_row_i8(row + HD + (Hkv + j) * D, D, (int8_t *)vc + at, vs + at / D);
            } else if (et != KV_F32) {
                hw_store_row_16(row + HD + j * D, D, (uint16_t *)(kc + at * es), et);
                hw_store_row_16(row + HD + (Hkv + j) * D, D, (uint16_t *)(vc + at * es), et);
            } else {
                memcpy(kc + at * es, row + HD + j * D, sizeof(float) * (size_t)D);
                memcpy(vc + at * es, row + HD + (Hkv + j) * D, sizeof(float) * (size_t)D);
            }
        }
        /* a ring's keys are its first min(p + 1, R) rows in any order (softmax does not care
         * where a key sits); a window's the last W positions */
        const long n = p + 1, keep = R ? R : W;
        first[m] = R || !W || n <= W ? 0 : n - W;
        lengths[m] = keep && n > keep ? keep : n;
    }
    /* each row over its own keys (one sequence each): rows in parallel, each call then on one
     * thread; one row on its own, outside any parallel region, so that its KV heads and, from 128
     * keys, chunks of its keys spread over the threads (hw_decode_attention_seq). (Inside even an
     * inactive `parallel if (0)` region the call's own parallel loop is a nested team, which
     * libgomp does not take from its pool: at 1,000 keys a batch-1 step went from 6 to 125 ms.) */
    int arc = 0;
    if (M == 1)
        arc = attend_row(q, kc, vc, ks, vs, o, base, table, tw, bs, first[0], lengths[0], Hkv, H, D, s_h, s_t, scale,
                         softcap, 0, et);
    else {
        #pragma omp parallel for schedule(dynamic) reduction(| : arc)
        for (long m = 0; m < M; m++)
            arc |= attend_row(q, kc, vc, ks, vs, o, base, table, tw, bs, first[m], lengths[m], Hkv, H, D, s_h, s_t,
                              scale, softcap, m, et);
    }
    rc = arc;
    if (rc) goto done;
    if (post_attn) {
        rc = linear(lin + 3, o, NULL, t, M, C, HD, PRO_NONE, NULL, 0.0f, NULL, NULL, 0, 0);
        if (!rc) post_norm_add(t, post_attn, eps, x, h, M, C);
    } else
        rc = linear(lin + 3, o, x, h, M, C, HD, PRO_NONE, NULL, 0.0f, NULL, NULL, 0, 0);
    if (rc) goto done;
    rc = linear(lin + 6, h, NULL, gu, M, 2 * F, C, PRO_RMSNORM, mlp_norm, eps, NULL, NULL, 0, 0);
    if (rc) goto done;
    if (post_mlp) {
        rc = linear(lin + 9, gu, NULL, t, M, C, F, glu, NULL, 0.0f, NULL, NULL, 0, 0);
        if (!rc) post_norm_add(t, post_mlp, eps, h, y, M, C);
    } else
        rc = linear(lin + 9, gu, h, y, M, C, F, glu, NULL, 0.0f, NULL, NULL, 0, 0);
done:
    free(buf);
    free(first);
    return rc;
}

/* Consecutive layers of one decode step in one call: layer l reads the previous one's output.
 * layers: n descriptors of STACK_FIELDS int64 each, fl: n x FL_FIELDS floats (the enums above).
 * Each layer carries its own sizes, cache buffers and rows, so the call is the layers one by
 * one, only without returning to Python between them: a decode step's parallel regions then
 * follow each other by microseconds, within the time libgomp's workers spin before they sleep
 * (threads.py), where the ~40 us of Python between two layer calls let them fall asleep and
 * every layer paid a futex wake-up. Returns 0, or a layer's nonzero code (then *failed = l). */
int hw_decoder_stack(long n, const int64_t *layers, const float *fl, const float *x, float *y, long M, long C,
                     long *failed) {
    float *tmp = n > 1 ? malloc(sizeof(float) * (size_t)(2 * M * C)) : NULL;
    if (n > 1 && !tmp) return -1;
    const float *in = x;
    int rc = 0;
    for (long l = 0; l < n && !rc; l++) {
        float *out = l == n - 1 ? y : tmp + (l % 2) * M * C;
        rc = hw_decoder_step(layers + l * STACK_FIELDS, fl + l * FL_FIELDS, in, out, M, C);
        if (rc) *failed = l;
        in = out;
    }
    free(tmp);
    return rc;
}
