/* What the files of the kernels call across each other, ggml-cpu's way: generic/ has the
 * CPython module, the drivers (argument checks, buffers, the OpenMP splits) and the scalar
 * reference code; x86/avx2/ and x86/avx512/ the vector code of each ISA, one file per kernel
 * family. Their names say format, tile and register, as ggml-cpu's do: tile_<weights>_<R>x<N>[_q8]_<reg>
 * is a register tile of up to R rows of x (quantized to q8 blocks where _q8) against N outputs, e.g.
 * tile_q4q5_k_8x16_q8_zmm (Q4_K / Q5_K weights), tile_f32_4x8_ymm; out_<weights>_<R>x<N>..._<reg>
 * runs such tiles over all rows of x for a run of outputs (out_x8_8x16_q8_zmm: packed groups of 8
 * rows, fmt | X8); hw_* are the entry points and what the files call across each other.
 *
 * setup.py builds each variant from generic/ plus one ISA's files: the avx2 variant x86/avx2/,
 * the avx512 variant x86/avx512/ and the x86/avx2/ files it has no wider version of. Each
 * function below the "per ISA" line is defined once per variant, by that variant's file. */
#ifndef HW_KERNELS_H
#define HW_KERNELS_H
#include <stdint.h>

/* The op a linear kernel folds in before its matmul (rows.c): none, RMSNorm, or a gated MLP's
 * act(gate) * up of x = [gate | up] (M, 2I): SwiGLU (SiLU) or GeGLU (GELU, tanh form: Gemma). */
enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SWIGLU = 2, PRO_GEGLU = 3 };

/* ---- entry points (generic/module.c wraps them for Python) ---- */

int hw_small_linear_f32(const float *Wb, const float *x, const float *b, const float *r, float *y, long M, long O,
                        long I, int kind, const float *norm_w, float eps, const float *cos, const float *sin,
                        long rot_cols, long head_dim);
int hw_quant_linear(int fmt, const uint8_t *w, const float *x, const float *b, const float *r, float *y, long M, long O,
                    long I, int kind, const float *norm_w, float eps, const float *cos, const float *sin, long rot_cols,
                    long head_dim);
int hw_dequantize(int fmt, const uint8_t *w, float *out, long O, long I);
int hw_quantize(int fmt, const float *w, uint8_t *out, long O, long I);
int hw_repack8(int fmt, const uint8_t *src, uint8_t *dst, long O, long I, int pack);
int hw_decode_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse, long C, long Hkv,
                            long G, long D, long sk_c, long sk_h, long sk_t, long sv_c, long sv_h, long sv_t,
                            const long *lengths, float scale, long all_keys, const int64_t *tables, long tw, long bs,
                            float softcap, int et);
int hw_decode_attention_seq(const float *q, const void *k, const void *v, const float *ks, const float *vs, float *out,
                            long Hkv, long G, long D, long sk_h, long sk_t, long n, float scale, const int64_t *tab,
                            long bs, int et);
int hw_prefill_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse, long B, long H,
                             long Hkv, long T, long S, long D, long sq_b, long sq_h, long sq_t, long sk_b, long sk_h,
                             long sk_t, long sv_b, long sv_h, long sv_t, long so_b, long so_h, long so_t, float scale,
                             int causal, float softcap);
void hw_rows_prologue(int kind, const float *x, const float *norm_w, float eps, float *out, long M, long I);
void hw_rope_rows(float *y, long M, long O, const float *cos, const float *sin, long rot_cols, long head_dim);
void hw_qk_norm_rope_rows(float *y, long M, long O, long H, long Hkv, long D, long rd, const float *qn,
                          const float *kn, float eps, const float *cos, const float *sin);
long hw_argmax_rows(const float *x, long R, long n, long stride, int64_t *out);
int hw_decoder_stack(long n, const int64_t *layers, const float *fl, const float *x, float *y, long M, long C,
                     long *failed);
long hw_stack_fields(void);
long hw_stack_floats(void);

/* Tunables module.c's setters write (set once, at load, by kernels/__init__.py): how far ahead the
 * fp32 tiles prefetch (inputs) and the packed groups (bytes), from how many rows the avx512
 * variant's packed groups go two at a time in zmm, query tokens per prefill block. */
extern int hw_pf_ahead, hw_qpf_ahead, hw_zmm_min_rows, hw_pa_queries;
/* 1: the avx512 variant's K-quant ymm tiles (a batch-1 step of a Q4_K / Q5_K / Q6_K file) prefetch
 * their weights non-temporally (prefetchnta), 0: into every cache level (quant_linear.c). */
extern int hw_qpf_nta;

/* ---- row helpers (generic/rows.c) ---- */

/* The prologue for M rows into buf (M, I); returns the rows the matmul reads (x for PRO_NONE). */
const float *hw_prologue(int kind, const float *x, const float *norm_w, float eps, float *buf, long M, long I);
void hw_rope_epilogue(float *y, long M, long O, const float *cos, const float *sin, long rot_cols, long head_dim);

/* ---- per ISA (x86/avx2 for both variants where x86/avx512 has no file of its own) ---- */

/* y = xs W^T + b + r for the blocked fp32 W of generic/small_linear.c, over the OpenMP threads (small_linear.c). */
void hw_gemm_f32(const float *Wb, const float *xs, const float *b, const float *r, float *y, long M, long O, long I);
/* silu(g) u for M rows of [g | u] (M, 2I) into out (M, I) (x86/avx2/rows.c). */
void hw_swiglu_rows(const float *x, float *out, long M, long I);
/* gelu_tanh(g) u for M rows of [g | u] (M, 2I) into out (M, I) (x86/avx2/rows.c). */
void hw_geglu_rows(const float *x, float *out, long M, long I);
/* x (D floats, D % 8 == 0) -> q (D int8), *scale: cache/quantized.py's quantize_int8 (x86/avx2/rows.c). */
void hw_quantize_row_i8(const float *x, long D, int8_t *q, float *scale);
/* Rows of x (M, I) -> q8 blocks of 32: qx int8, dx scales, sx = dx sum(qx) (x86/avx2/quantize.c). */
void hw_quantize_x_q8(const float *x, long M, long I, int8_t *qx, float *dx, float *sx);
/* y = qw . qx per block + bias + residual, O weight rows of format fmt, row-major (quant_rows.c). */
void hw_quant_rows(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, const float *b,
                   const float *r, float *y, long M, long O, long I, int par);
/* The same on rows packed in groups of 8 (fmt | X8; quant_group.c). */
void hw_quant_groups(int fmt, const uint8_t *w, const int8_t *qx, const float *dx, const float *sx, const int32_t *xs,
                     const float *b, const float *r, float *y, long M, long O, long I, int par);
/* One 32-block row of a format -> fp32 (x86/avx2/dequantize.c). */
void hw_dequantize_row(int fmt, const uint8_t *row, float *out, long I);
/* One block of Q8_0 / Q4_K / Q5_K / Q6_K from fp32 (x86/avx2/quantize.c, quantize_k.c). */
void hw_quantize_q8_0(const float *x, uint8_t *out);
void hw_quantize_q4_k(const float *x, uint8_t *out, int five);
void hw_quantize_q6_k(const float *x, uint8_t *out);
/* Decode attention (decode_attention.c): keys a tile (one 8-lane vector of scores), query rows a KV
 * head and channels a head at most. */
enum { TK = 8, MAX_G = 16, MAX_D = 256 };
/* What a K/V cache stores per element (cache/quantized.py kv_kind): fp32, int8 + fp32 scale per row,
 * bf16, fp16; the element's bytes. */
enum { KV_F32 = 0, KV_I8 = 1, KV_BF16 = 2, KV_F16 = 3 };
static inline long hw_kv_bytes(int et) { return et == KV_F32 ? 4 : et == KV_I8 ? 1 : 2; }
/* x (D floats) -> D bf16 / fp16 (et), rounded to nearest even as torch's .to() (x86/avx2/decode_pair.h). */
void hw_store_row_16(const float *x, long D, uint16_t *out, int et);
/* One (sequence, KV head) pair of decode attention (decode_attention.c): G rows of q over n keys,
 * K/V stored as et. */
void hw_decode_pair(const void *k, const void *v, const float *ks, const float *vs, const float *q, float *out,
                    float *lse, long n, long G, long D, long sk_t, long sv_t, float scale, const int64_t *tab, long bs,
                    int et);
/* The same with fp32 K/V (ks = vs = NULL), and without LSE (lse = NULL, sv_t = sk_t). */
void hw_decode_pair_f32(const float *k, const float *v, const float *q, float *out, float *lse, long n, long G, long D,
                        long sk_t, long sv_t, float scale, const int64_t *tab, long bs);
void hw_decode_pair_nolse(const void *k, const void *v, const float *ks, const float *vs, const float *q, float *out,
                          long n, long G, long D, long sk_t, float scale, const int64_t *tab, long bs, int et);
/* hw_decode_pair with soft-capped scores, cap tanh(s / cap) before the mask (Gemma 2), cap > 0: any K/V
 * kind, lse or NULL. */
void hw_decode_pair_capped(const void *k, const void *v, const float *ks, const float *vs, const float *q, float *out,
                           float *lse, long n, long G, long D, long sk_t, long sv_t, float scale, const int64_t *tab,
                           long bs, float cap, int et);

/* Prefill attention's three steps per key block (prefill_attention.c), on a work item's rows. */
struct pa_scratch {
    float *qs;  /* (R, D) the rows' queries, pre-scaled */
    float *os;  /* (R, D) their outputs so far (unnormalized) */
    float *kt;  /* (D, hw_pa_keys) a key block transposed */
    float *p;   /* (R, hw_pa_keys) scores, then probabilities */
    float *m, *l, *alpha;  /* (R) */
    void *mem;
};
extern const long hw_pa_keys; /* keys per block: the tile's width */
/* p = qs kt for rows [0, R), keys [0, nk) rounded up to a vector (the columns past them are left as they were) */
void hw_pa_scores(struct pa_scratch *w, long R, long D, long nk);
/* online softmax of rows [0, R) over the block's nk keys; with causal masking on the diagonal, row r
 * (token t0 + r % nt) sees keys up to t0 + r % nt + off - s0 of the block */
void hw_pa_softmax(struct pa_scratch *w, long R, long nt, long nk, int diagonal, long t0, long off, long s0);
/* os = os alpha + p v over the block's nk keys */
void hw_pa_pv(struct pa_scratch *w, const float *v, long sv_t, long nk, long R, long D);

#endif
