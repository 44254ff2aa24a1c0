"""The compiled part of headwise: its CPU kernels as a C extension, built by `pip install`.

Two variants of the same sources, one per vector ISA; headwise/kernels/__init__.py imports the
one the CPU runs, at run time (a wheel built on one machine serves AVX2-only and AVX-512 CPUs
alike). Each is optional: without a C compiler (or off x86-64) the package installs without it,
and `headwise.kernels.kernels_unavailable()` says why the PyTorch ops run instead.
The rest of the metadata is in pyproject.toml.
"""

import platform

from setuptools import Extension, setup

SOURCES = [
    "_module.c",
    "small_linear.c",
    "decode_attention.c",
    "prefill_attention.c",
    "quant_linear.c",
    "quant_group.c",
    "quant_convert.c",
    "decoder_step.c",
    "argmax.c",
    "rows.c",
]
# -fopenmp: the kernels split rows over OpenMP threads; at import they bind to the libgomp
# PyTorch has loaded already (same soname), so both share one thread pool.
COMMON = ["-O3", "-fopenmp", "-Wno-unused-function"]  # GNU C: FMA contraction on, as the kernels were tuned
VARIANTS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
}

ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64"):
    ext_modules = [
        Extension(
            f"headwise.kernels._cpu_{isa}",
            [f"headwise/kernels/{s}" for s in SOURCES],
            define_macros=[("HW_MODULE", f"_cpu_{isa}")],
            extra_compile_args=COMMON + flags,
            extra_link_args=["-fopenmp"],
            optional=True,
        )
        for isa, flags in VARIANTS.items()
    ]

setup(ext_modules=ext_modules)
