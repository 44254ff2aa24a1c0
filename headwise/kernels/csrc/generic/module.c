/* The CPython module of headwise's CPU kernels: one per ISA variant, built by `pip install`
 * (setup.py: headwise.kernels._cpu_avx2, _cpu_avx512: this file and the rest of generic/ with
 * each ISA's files, kernels.h) and picked at run time by kernels/__init__.py from the CPU's flags. HW_MODULE names the
 * variant (a -D flag). Each function takes data_ptr() ints / None, ints and floats, in the
 * order of the C kernel it calls (small_linear.c, decode_attention.c); the Python callers in
 * kernels/ check shapes, dtypes and contiguity first. */
#include "pyargs.h" /* Python.h before any system header, as CPython asks */
#include <stdint.h>

#include "kernels.h"
#include "quant_formats.h"

/* decoder_stack(layers, fl, x, y, M, C) -> (rc, failed layer) (decoder_step.c): layers a list of
 * n * hw_stack_fields() ints, fl a list of n * hw_stack_floats() floats (decoder_step.c's enums). Lists,
 * not tensors: parsing ~900 ints here takes a few microseconds, where torch.tensor(list) took ~50. */
static PyObject *py_decoder_stack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *x;
    float *y;
    long M, C, failed = -1;
    if (!(hw_nargs("decoder_stack", nargs, 6) && HW_P(2, x) && HW_P(3, y) && HW_L(4, M) && HW_L(5, C))) return NULL;
    PyObject *ls = PySequence_Fast(args[0], "decoder_stack: layers must be a list of ints");
    PyObject *fs = ls ? PySequence_Fast(args[1], "decoder_stack: fl must be a list of floats") : NULL;
    int64_t *layers = NULL;
    float *fl = NULL;
    PyObject *result = NULL;
    if (!fs) goto done;
    const Py_ssize_t nl = PySequence_Fast_GET_SIZE(ls), nf = PySequence_Fast_GET_SIZE(fs);
    const long n = (long)(nf / hw_stack_floats());
    if (nl != n * hw_stack_fields() || nf != n * hw_stack_floats() || n < 1) {
        PyErr_Format(PyExc_ValueError, "decoder_stack: %zd ints and %zd floats do not describe whole layers (%ld ints "
                     "and %ld floats each)", nl, nf, hw_stack_fields(), hw_stack_floats());
        goto done;
    }
    layers = malloc(sizeof(int64_t) * (size_t)nl), fl = malloc(sizeof(float) * (size_t)nf);
    if (!layers || !fl) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **li = PySequence_Fast_ITEMS(ls), **fi = PySequence_Fast_ITEMS(fs);
    for (Py_ssize_t i = 0; i < nl; i++) {
        layers[i] = PyLong_AsLongLong(li[i]);
        if (layers[i] == -1 && PyErr_Occurred()) goto done;
    }
    for (Py_ssize_t i = 0; i < nf; i++) {
        const double v = PyFloat_AsDouble(fi[i]);
        if (v == -1.0 && PyErr_Occurred()) goto done;
        fl[i] = (float)v;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_decoder_stack(n, layers, fl, x, y, M, C, &failed);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(il)", rc, failed);
done:
    free(layers), free(fl);
    Py_XDECREF(ls), Py_XDECREF(fs);
    return result;
}

/* small_linear(Wb, x, b, r, y, M, O, I, prologue, norm_w, eps, cos, sin, rot_cols, head_dim) -> int rc */
static PyObject *py_small_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *Wb, *x, *b, *r, *norm_w, *cos, *sin;
    float *y;
    long M, O, I, kind, rot_cols, head_dim;
    float eps;
    if (!(hw_nargs("small_linear", nargs, 15) && HW_P(0, Wb) && HW_P(1, x) && HW_P(2, b) && HW_P(3, r) &&
          HW_P(4, y) && HW_L(5, M) && HW_L(6, O) && HW_L(7, I) && HW_L(8, kind) && HW_P(9, norm_w) &&
          HW_F(10, eps) && HW_P(11, cos) && HW_P(12, sin) && HW_L(13, rot_cols) && HW_L(14, head_dim)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_small_linear_f32(Wb, x, b, r, y, M, O, I, (int)kind, norm_w, eps, cos, sin, rot_cols, head_dim);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* decode_attention(q, k, v, out, lse, C, Hkv, G, D, sk_c, sk_h, sk_t, sv_c, sv_h, sv_t, lengths, scale,
 * all_keys, tables, tw, bs, softcap, et) -> int rc (et: kernels.h's KV_F32, KV_BF16, KV_F16) */
static PyObject *py_decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *q, *k, *v;
    float *out, *lse;
    const long *lengths;
    const int64_t *tables;
    long C, Hkv, G, D, sk_c, sk_h, sk_t, sv_c, sv_h, sv_t, all_keys, tw, bs, et;
    float scale, softcap;
    if (!(hw_nargs("decode_attention", nargs, 23) && HW_P(0, q) && HW_P(1, k) && HW_P(2, v) && HW_P(3, out) &&
          HW_P(4, lse) && HW_L(5, C) && HW_L(6, Hkv) && HW_L(7, G) && HW_L(8, D) && HW_L(9, sk_c) &&
          HW_L(10, sk_h) && HW_L(11, sk_t) && HW_L(12, sv_c) && HW_L(13, sv_h) && HW_L(14, sv_t) &&
          HW_P(15, lengths) && HW_F(16, scale) && HW_L(17, all_keys) && HW_P(18, tables) && HW_L(19, tw) &&
          HW_L(20, bs) && HW_F(21, softcap) && HW_L(22, et)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_decode_attention_f32(q, k, v, out, lse, C, Hkv, G, D, sk_c, sk_h, sk_t, sv_c, sv_h, sv_t, lengths, scale,
                                 all_keys, tables, tw, bs, softcap, (int)et);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* prefill_attention(q, k, v, out, lse, B, H, Hkv, T, S, D, 12 strides (q, k, v, out: b, h, t), scale,
 * causal, softcap) -> rc (prefill_attention.c) */
static PyObject *py_prefill_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *q, *k, *v;
    float *out, *lse, scale, softcap;
    long n[18], causal;
    if (!(hw_nargs("prefill_attention", nargs, 26) && HW_P(0, q) && HW_P(1, k) && HW_P(2, v) && HW_P(3, out) &&
          HW_P(4, lse) && HW_F(23, scale) && HW_L(24, causal) && HW_F(25, softcap)))
        return NULL;
    for (int i = 0; i < 18; i++)
        if (!HW_L(5 + i, n[i])) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_prefill_attention_f32(q, k, v, out, lse, n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7], n[8], n[9],
                                  n[10], n[11], n[12], n[13], n[14], n[15], n[16], n[17], scale, (int)causal, softcap);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* argmax_rows(x, R, n, stride, out) -> rows with a NaN (x86/avx2/rows.c) */
static PyObject *py_argmax_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *x;
    int64_t *out;
    long R, n, stride;
    if (!(hw_nargs("argmax_rows", nargs, 5) && HW_P(0, x) && HW_L(1, R) && HW_L(2, n) && HW_L(3, stride) &&
          HW_P(4, out)))
        return NULL;
    long nans;
    Py_BEGIN_ALLOW_THREADS
    nans = hw_argmax_rows(x, R, n, stride, out);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(nans);
}

/* rows_prologue(kind, x, norm_w, eps, out, M, I) -> None (rows.c) */
static PyObject *py_rows_prologue(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *x, *norm_w;
    float *out;
    long kind, M, I;
    float eps;
    if (!(hw_nargs("rows_prologue", nargs, 7) && HW_L(0, kind) && HW_P(1, x) && HW_P(2, norm_w) && HW_F(3, eps) &&
          HW_P(4, out) && HW_L(5, M) && HW_L(6, I)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    hw_rows_prologue((int)kind, x, norm_w, eps, out, M, I);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rope_rows(y, M, O, cos, sin, rot_cols, head_dim) -> None (rows.c) */
static PyObject *py_rope_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float *y;
    const float *cos, *sin;
    long M, O, rot_cols, head_dim;
    if (!(hw_nargs("rope_rows", nargs, 7) && HW_P(0, y) && HW_L(1, M) && HW_L(2, O) && HW_P(3, cos) &&
          HW_P(4, sin) && HW_L(5, rot_cols) && HW_L(6, head_dim)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    hw_rope_rows(y, M, O, cos, sin, rot_cols, head_dim);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* qk_norm_rope_rows(y, M, O, H, Hkv, D, rd, qn, kn, eps, cos, sin) -> None (rows.c) */
static PyObject *py_qk_norm_rope_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float *y, eps;
    const float *qn, *kn, *cos, *sin;
    long M, O, H, Hkv, D, rd;
    if (!(hw_nargs("qk_norm_rope_rows", nargs, 12) && HW_P(0, y) && HW_L(1, M) && HW_L(2, O) && HW_L(3, H) &&
          HW_L(4, Hkv) && HW_L(5, D) && HW_L(6, rd) && HW_P(7, qn) && HW_P(8, kn) && HW_F(9, eps) && HW_P(10, cos) &&
          HW_P(11, sin)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    hw_qk_norm_rope_rows(y, M, O, H, Hkv, D, rd, qn, kn, eps, cos, sin);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* prefetch_ahead(n), quant_prefetch_ahead(n) -> the distance before: how far ahead small_linear.c's
 * tiles (inputs, hw_pf_ahead) and quant_group.c's packed groups (bytes, hw_qpf_ahead) prefetch
 * weights; n < 0 only reads it. Not thread-safe against running kernels: set once, at load
 * (kernels/__init__.py) or between timed runs (benchmarks/prefetch.py). */
static PyObject *set_distance(const char *name, int *var, long most, const char *unit, PyObject *const *args,
                              Py_ssize_t nargs) {
    long n;
    if (!(hw_nargs(name, nargs, 1) && HW_L(0, n))) return NULL;
    if (n > most) {
        PyErr_Format(PyExc_ValueError, "%s: %ld %s is past any weight block (at most %ld)", name, n, unit, most);
        return NULL;
    }
    const long before = *var;
    if (n >= 0) *var = (int)n;
    return PyLong_FromLong(before);
}
static PyObject *py_prefetch_ahead(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return set_distance("prefetch_ahead", &hw_pf_ahead, 4096, "inputs", args, nargs);
}
static PyObject *py_quant_prefetch_ahead(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return set_distance("quant_prefetch_ahead", &hw_qpf_ahead, 65536, "bytes", args, nargs);
}
/* quant_prefetch_nta(n) -> the flag before: 1 makes the avx512 variant's K-quant ymm tiles prefetch
 * their weights with NTA, 0 into every cache level (hw_qpf_nta); n < 0 only reads it. Set as above. */
static PyObject *py_quant_prefetch_nta(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long n;
    if (!(hw_nargs("quant_prefetch_nta", nargs, 1) && HW_L(0, n))) return NULL;
    if (n > 1) return PyErr_Format(PyExc_ValueError, "quant_prefetch_nta: %ld; give 0 (T0) or 1 (NTA)", n);
    const long before = hw_qpf_nta;
    if (n >= 0) hw_qpf_nta = (int)n;
    return PyLong_FromLong(before);
}
/* Counts set as the distances above, from 1 to `most` (n < 0 only reads them):
 * zmm_min_rows(n): from how many rows of x quant_group.c's avx512 build reads two packed groups at
 * once in zmm tiles (fewer: one group in ymm; the same bits either way), 65 keeping every step on
 * the ymm tiles; no effect in the avx2 build.
 * prefill_query_block(n): query tokens per block of prefill_attention.c (its G x n rows meet each
 * key block once). */
static PyObject *set_count(const char *name, int *var, long most, const char *unit, PyObject *const *args,
                           Py_ssize_t nargs) {
    long n;
    if (!(hw_nargs(name, nargs, 1) && HW_L(0, n))) return NULL;
    if (n == 0 || n > most) {
        PyErr_Format(PyExc_ValueError, "%s: %ld %s; give 1 to %ld, or < 0 to read it", name, n, unit, most);
        return NULL;
    }
    const long before = *var;
    if (n > 0) *var = (int)n;
    return PyLong_FromLong(before);
}
static PyObject *py_zmm_min_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return set_count("zmm_min_rows", &hw_zmm_min_rows, 65, "rows", args, nargs);
}
static PyObject *py_prefill_query_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return set_count("prefill_query_block", &hw_pa_queries, 256, "query tokens", args, nargs);
}

/* quant_linear.c's and convert.c's entry points: None, or the error their code names */
static PyObject *hw_result(const char *name, int rc) {
    if (rc == 0) Py_RETURN_NONE;
    if (rc == ERR_ALLOC) return PyErr_Format(PyExc_MemoryError, "%s: could not allocate its buffers", name);
    if (rc == ERR_FORMAT)
        return PyErr_Format(PyExc_ValueError, "%s: unknown format (GGML ids: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, "
                                              "Q5_K=13, Q6_K=14; quantize: 2, 3, 6, 8, 12, 14)", name);
    return PyErr_Format(PyExc_ValueError, "%s: sizes must be positive, inputs a multiple of the block", name);
}

/* quant_linear(fmt, w, x, b, r, y, M, O, I, prologue, norm_w, eps, cos, sin, rot_cols, head_dim) -> None */
static PyObject *py_quant_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *w;
    const float *x, *b, *r, *norm_w, *cos, *sin;
    float *y, eps;
    long fmt, M, O, I, kind, rot_cols, head_dim;
    if (!(hw_nargs("quant_linear", nargs, 16) && HW_L(0, fmt) && HW_P(1, w) && HW_P(2, x) && HW_P(3, b) &&
          HW_P(4, r) && HW_P(5, y) && HW_L(6, M) && HW_L(7, O) && HW_L(8, I) && HW_L(9, kind) && HW_P(10, norm_w) &&
          HW_F(11, eps) && HW_P(12, cos) && HW_P(13, sin) && HW_L(14, rot_cols) && HW_L(15, head_dim)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_quant_linear((int)fmt, w, x, b, r, y, M, O, I, (int)kind, norm_w, eps, cos, sin, rot_cols, head_dim);
    Py_END_ALLOW_THREADS
    return hw_result("quant_linear", rc);
}

/* dequantize(fmt, w, out, O, I) -> None */
static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *w;
    float *out;
    long fmt, O, I;
    if (!(hw_nargs("dequantize", nargs, 5) && HW_L(0, fmt) && HW_P(1, w) && HW_P(2, out) && HW_L(3, O) &&
          HW_L(4, I)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_dequantize((int)fmt, w, out, O, I);
    Py_END_ALLOW_THREADS
    return hw_result("dequantize", rc);
}

/* repack8(fmt, src, dst, O, I, pack) -> None: Q4_0 / Q4_1 / Q8_0 rows to groups of 8 (pack = 1) or back */
static PyObject *py_repack8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *src;
    uint8_t *dst;
    long fmt, O, I, pack;
    if (!(hw_nargs("repack8", nargs, 6) && HW_L(0, fmt) && HW_P(1, src) && HW_P(2, dst) && HW_L(3, O) &&
          HW_L(4, I) && HW_L(5, pack)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_repack8((int)fmt, src, dst, O, I, (int)pack);
    Py_END_ALLOW_THREADS
    return hw_result("repack8", rc);
}

/* quantize(fmt, w, out, O, I) -> None */
static PyObject *py_quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *w;
    uint8_t *out;
    long fmt, O, I;
    if (!(hw_nargs("quantize", nargs, 5) && HW_L(0, fmt) && HW_P(1, w) && HW_P(2, out) && HW_L(3, O) &&
          HW_L(4, I)))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hw_quantize((int)fmt, w, out, O, I);
    Py_END_ALLOW_THREADS
    return hw_result("quantize", rc);
}

static PyMethodDef methods[] = {
    {"small_linear", (PyCFunction)(void (*)(void))py_small_linear, METH_FASTCALL, "small_linear.c"},
    {"decoder_stack", (PyCFunction)(void (*)(void))py_decoder_stack, METH_FASTCALL, "decoder_step.c"},
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_FASTCALL, "decode_attention.c"},
    {"prefill_attention", (PyCFunction)(void (*)(void))py_prefill_attention, METH_FASTCALL, "prefill_attention.c"},
    {"rows_prologue", (PyCFunction)(void (*)(void))py_rows_prologue, METH_FASTCALL, "rows.c"},
    {"rope_rows", (PyCFunction)(void (*)(void))py_rope_rows, METH_FASTCALL, "rows.c"},
    {"qk_norm_rope_rows", (PyCFunction)(void (*)(void))py_qk_norm_rope_rows, METH_FASTCALL, "rows.c"},
    {"prefetch_ahead", (PyCFunction)(void (*)(void))py_prefetch_ahead, METH_FASTCALL, "small_linear.c"},
    {"quant_prefetch_ahead", (PyCFunction)(void (*)(void))py_quant_prefetch_ahead, METH_FASTCALL, "quant_linear.c"},
    {"zmm_min_rows", (PyCFunction)(void (*)(void))py_zmm_min_rows, METH_FASTCALL, "x86/avx512/quant_group.c"},
    {"quant_prefetch_nta", (PyCFunction)(void (*)(void))py_quant_prefetch_nta, METH_FASTCALL,
     "x86/avx512/quant_tiles_ymm.h"},
    {"prefill_query_block", (PyCFunction)(void (*)(void))py_prefill_query_block, METH_FASTCALL,
     "prefill_attention.c"},
    {"argmax_rows", (PyCFunction)(void (*)(void))py_argmax_rows, METH_FASTCALL, "x86/avx2/rows.c"},
    {"quant_linear", (PyCFunction)(void (*)(void))py_quant_linear, METH_FASTCALL, "quant_linear.c"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL, "convert.c"},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL, "convert.c"},
    {"repack8", (PyCFunction)(void (*)(void))py_repack8, METH_FASTCALL, "convert.c"},
    {NULL, NULL, 0, NULL},
};

#define HW_STR2(x) #x
#define HW_STR(x) HW_STR2(x)
#define HW_CAT2(a, b) a##b
#define HW_CAT(a, b) HW_CAT2(a, b)

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, HW_STR(HW_MODULE), "headwise's CPU kernels", -1, methods};

PyMODINIT_FUNC HW_CAT(PyInit_, HW_MODULE)(void) { return PyModule_Create(&module); }
