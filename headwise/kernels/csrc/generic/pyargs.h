/* Argument readers for the METH_FASTCALL wrappers of headwise's kernels (module.c and the
 * kernel files' own hwpy_* wrappers). A kernel call from Python passes tensors as data_ptr()
 * ints (or None for an absent one), sizes as ints and scalars as floats: parsing them here
 * costs well under a microsecond, where ctypes' conversion of the same 15 arguments cost ~3 us
 * of a small kernel's ~7 us. Each reader returns 0 and sets a Python error on bad input. */
#ifndef HW_PYARGS_H
#define HW_PYARGS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A pointer: an int (a tensor's data_ptr()) or None (NULL). */
static inline int hw_ptr(PyObject *o, void **out) {
    if (o == Py_None) {
        *out = NULL;
        return 1;
    }
    *out = PyLong_AsVoidPtr(o);
    return !(*out == NULL && PyErr_Occurred());
}

static inline int hw_long(PyObject *o, long *out) {
    *out = PyLong_AsLong(o);
    return !(*out == -1 && PyErr_Occurred());
}

static inline int hw_float(PyObject *o, float *out) {
    double d = PyFloat_AsDouble(o);
    *out = (float)d;
    return !(d == -1.0 && PyErr_Occurred());
}

static inline int hw_nargs(const char *name, Py_ssize_t got, Py_ssize_t want) {
    if (got == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, got);
    return 0;
}

/* Read args[i] into the typed variables in order: HW_ARGS(ok, P(w), L(M), F(eps)) style is
 * overkill for a handful of wrappers, so each wrapper spells its reads out with these. */
#define HW_P(i, var) hw_ptr(args[i], (void **)&(var))
#define HW_L(i, var) hw_long(args[i], &(var))
#define HW_F(i, var) hw_float(args[i], &(var))

#endif
