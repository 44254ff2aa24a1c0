/* One decode step of a pre-norm SwiGLU decoder layer (Llama, Mistral, Qwen2) in one call, for
 * M rows that each add one token to a contiguous KV cache:
 *
 *     qkv = linear(rmsnorm(x))  + RoPE on q, k      (small_linear.c or quant_linear.c)
 *     K[b, :, pos_b] = k; V[b, :, pos_b] = v         (the cache, written in place)
 *     o   = softmax(q K[:pos_b + 1]^T * scale) V     (decode_attention.c, every key up to pos_b)
 *     h   = linear(o) + x
 *     y   = linear(swiglu(linear(rmsnorm(h)))) + h
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

/* lin: 4 x (fmt, weight, bias) for qkv (C -> (H + 2 Hkv) D; or q with split), out (H D -> C), gate_up (C -> 2F),
 * down (F -> C). x, y (M, C); cos, sin (M, D / 2); kc, vc: this layer's K and V, row m's keys at
 * kc + base[m] + h s_h + t s_t (elements; each key's D contiguous): a contiguous cache's
 * sequence m, or the run of consecutive blocks a paged sequence holds. With table (M, tw) given
 * (base then unused), row m's key t is at kc + h s_h + (table[m][t / bs] * bs + t % bs) s_t: a
 * paged pool's blocks wherever they lie. pos (M,): the key row m writes, so it then attends over
 * keys 0 .. pos[m]. ks, vs NULL: K and V are fp32. Else they are int8 planes (cache/quantized.py:
 * int8 values, one fp32 scale per key row at the row's element offset / D in ks, vs): the new keys
 * are quantized as its quantize_int8 does, bit for bit, and attention reads the int8 rows (1/4 of
 * fp32's bytes, which set a long context's decode speed). Returns 0, -1 (no memory) or a kernel's code. */
/* Row m's attention over its own keys (hw_decoder_step's K/V layout: base[m] elements in, or its table). */
static int attend_row(const float *q, const float *kc, const float *vc, const float *ks, const float *vs, float *o,
                      const int64_t *base, const int64_t *table, long tw, long bs, const long *lengths, long Hkv,
                      long H, long D, long s_h, long s_t, float scale, long m) {
    const long HD = H * D, at = table ? 0 : base[m], es = ks ? 1 : 4; /* bytes per element */
    return hw_decode_attention_seq(q + m * HD, (const char *)kc + at * es, (const char *)vc + at * es,
                                   ks ? ks + at / D : NULL, ks ? vs + at / D : NULL, o + m * HD, Hkv, H / Hkv, D, s_h,
                                   s_t, lengths[m], scale, table ? table + m * tw : NULL, bs);
}

/* The q | k | v rows (M, QKV) of split projections: q = lin (H D rows), k, v = split's two (fmt,
 * weight, bias) triples (Hkv D rows each), each its own call (the RMSNorm prologue recomputed, RoPE
 * on q's and k's heads), then interleaved as the fused matrix's rows would give them. */
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

/* split: NULL, or the k and v projections' (fmt, weight, bias) when the layer holds q, k and v
 * apart (lin's first triple is then q's): split_qkv. */
static int hw_decoder_step(const int64_t *lin, const int64_t *split, const float *attn_norm, const float *mlp_norm,
                           float eps, const float *x, float *y, long M, long C, long H, long Hkv, long D, long F,
                           const float *cos, const float *sin, float *kc, float *vc, float *ks, float *vs,
                           const int64_t *base, long s_h, long s_t, const int64_t *pos, float scale,
                           const int64_t *table, long tw, long bs) {
    if (table && bs < 1) return -3;
    const long QKV = (H + 2 * Hkv) * D, HD = H * D;
    float *buf = malloc(sizeof(float) * (size_t)(M * (QKV + 2 * HD + C + 2 * F) + (split ? M * QKV : 0)));
    long *lengths = malloc(sizeof(long) * (size_t)M);
    int rc = -1;
    if (!buf || !lengths) goto done;
    float *qkv = buf, *q = qkv + M * QKV, *o = q + M * HD, *h = o + M * HD, *gu = h + M * C;
    if (split)
        rc = split_qkv(lin, split, attn_norm, eps, x, qkv, gu + M * 2 * F, M, C, H, Hkv, D, cos, sin);
    else
        rc = linear(lin, x, NULL, qkv, M, QKV, C, PRO_RMSNORM, attn_norm, eps, cos, sin, (H + Hkv) * D, D);
    if (rc) goto done;
    for (long m = 0; m < M; m++) {
        const float *row = qkv + m * QKV;
        memcpy(q + m * HD, row, sizeof(float) * (size_t)HD);
        const long p = pos[m], key = table ? (table[m * tw + p / bs] * bs + p % bs) * s_t : base[m] + p * s_t;
        for (long j = 0; j < Hkv; j++) {
            const long at = key + j * s_h;
            if (ks) {
                hw_quantize_row_i8(row + HD + j * D, D, (int8_t *)kc + at, ks + at / D);
                hw_quantize_row_i8(row + HD + (Hkv + j) * D, D, (int8_t *)vc + at, vs + at / D);
            } else {
                memcpy(kc + at, row + HD + j * D, sizeof(float) * (size_t)D);
                memcpy(vc + at, row + HD + (Hkv + j) * D, sizeof(float) * (size_t)D);
            }
        }
        lengths[m] = pos[m] + 1;
    }
    /* each row over its own keys (one sequence each): rows in parallel, each call then on one
     * thread; one row on its own, outside any parallel region, so that its KV heads and, from 128
     * keys, chunks of its keys spread over the threads (hw_decode_attention_seq). (Inside even an
     * inactive `parallel if (0)` region the call's own parallel loop is a nested team, which
     * libgomp does not take from its pool: at 1,000 keys a batch-1 step went from 6 to 125 ms.) */
    int arc = 0;
    if (M == 1)
        arc = attend_row(q, kc, vc, ks, vs, o, base, table, tw, bs, lengths, Hkv, H, D, s_h, s_t, scale, 0);
    else {
        #pragma omp parallel for schedule(dynamic) reduction(| : arc)
        for (long m = 0; m < M; m++)
            arc |= attend_row(q, kc, vc, ks, vs, o, base, table, tw, bs, lengths, Hkv, H, D, s_h, s_t, scale, m);
    }
    rc = arc;
    if (rc) goto done;
    rc = linear(lin + 3, o, x, h, M, C, HD, PRO_NONE, NULL, 0.0f, NULL, NULL, 0, 0);
    if (rc) goto done;
    rc = linear(lin + 6, h, NULL, gu, M, 2 * F, C, PRO_RMSNORM, mlp_norm, eps, NULL, NULL, 0, 0);
    if (rc) goto done;
    rc = linear(lin + 9, gu, h, y, M, C, F, PRO_SWIGLU, NULL, 0.0f, NULL, NULL, 0, 0);
done:
    free(buf);
    free(lengths);
    return rc;
}

/* Consecutive layers of one decode step in one call: layer l reads the previous one's output.
 * layers: n descriptors of STACK_FIELDS int64 each (hw_decoder_step's arguments for that layer,
 * in the order of the enum below; pointers as integers, 0 for none); fl: n (eps, scale) pairs.
 * Each layer carries its own sizes, cache buffers and rows, so the call is the layers one by
 * one, only without returning to Python between them: a decode step's parallel regions then
 * follow each other by microseconds, within the time libgomp's workers spin before they sleep
 * (threads.py), where the ~40 us of Python between two layer calls let them fall asleep and
 * every layer paid a futex wake-up. Returns 0, or a layer's nonzero code (then *failed = l). */
enum { ST_LIN = 0, ST_ATTN_NORM = 12, ST_MLP_NORM, ST_K, ST_V, ST_KS, ST_VS, ST_BASE, ST_SH, ST_ST, ST_POS, ST_TABLE,
       ST_TW, ST_BS, ST_H, ST_HKV, ST_D, ST_F, ST_COS, ST_SIN, ST_SPLIT, STACK_FIELDS = ST_SPLIT + 6 };
/* ST_SPLIT: -2 for a fused q | k | v (ST_LIN's first triple), else the k and v projections' triples. */

long hw_stack_fields(void) { return STACK_FIELDS; }

#define PTR(T, v) ((T)(intptr_t)(v))
int hw_decoder_stack(long n, const int64_t *layers, const float *fl, const float *x, float *y, long M, long C,
                     long *failed) {
    float *tmp = n > 1 ? malloc(sizeof(float) * (size_t)(2 * M * C)) : NULL;
    if (n > 1 && !tmp) return -1;
    const float *in = x;
    int rc = 0;
    for (long l = 0; l < n && !rc; l++) {
        const int64_t *d = layers + l * STACK_FIELDS;
        float *out = l == n - 1 ? y : tmp + (l % 2) * M * C;
        rc = hw_decoder_step(d + ST_LIN, d[ST_SPLIT] == -2 ? NULL : d + ST_SPLIT, PTR(const float *, d[ST_ATTN_NORM]),
                             PTR(const float *, d[ST_MLP_NORM]),
                             fl[2 * l], in, out, M, C, d[ST_H], d[ST_HKV], d[ST_D], d[ST_F],
                             PTR(const float *, d[ST_COS]), PTR(const float *, d[ST_SIN]), PTR(float *, d[ST_K]),
                             PTR(float *, d[ST_V]), PTR(float *, d[ST_KS]), PTR(float *, d[ST_VS]),
                             PTR(const int64_t *, d[ST_BASE]), d[ST_SH], d[ST_ST],
                             PTR(const int64_t *, d[ST_POS]), fl[2 * l + 1], PTR(const int64_t *, d[ST_TABLE]),
                             d[ST_TW], d[ST_BS]);
        if (rc) *failed = l;
        in = out;
    }
    free(tmp);
    return rc;
}
