"""The compiled part of headwise: its CPU kernels as a C extension, built by `pip install`.

Two variants, one per vector ISA, laid out as ggml-cpu's (headwise/kernels/csrc/generic/kernels.h):
csrc/generic/ (the module, drivers, scalar code) with csrc/x86/avx2/ for the avx2 variant, and
with csrc/x86/avx512/ for the avx512 one, plus each x86/avx2/ file that x86/avx512/ has no file of
the same name for. headwise/kernels/__init__.py imports the one the CPU runs, at run time (a wheel built on one machine serves AVX2-only and AVX-512 CPUs
alike). Each is optional: without a C compiler (or off x86-64) the package installs without it,
and `headwise.kernels.kernels_unavailable()` says why the PyTorch ops run instead.
The rest of the metadata is in pyproject.toml.
"""

import platform
from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("headwise/kernels/csrc")


def sources(isa: str) -> list[str]:
    """generic/*.c + x86/<isa>/*.c + the x86/avx2/*.c files x86/<isa>/ does not replace (same name)."""
    own = {p.name: p for p in sorted((CSRC / "x86" / isa).glob("*.c"))}
    base = [p for p in sorted((CSRC / "x86" / "avx2").glob("*.c")) if p.name not in own]
    return [str(p) for p in [*sorted((CSRC / "generic").glob("*.c")), *base, *own.values()]]


# -fopenmp: the kernels split rows over OpenMP threads; at import they bind to the libgomp
# PyTorch has loaded already (same soname), so both share one thread pool.
COMMON = ["-O3", "-fopenmp", "-Wno-unused-function"]  # GNU C: FMA contraction on, as the kernels were tuned
VARIANTS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
}

HEADERS = [str(p) for p in sorted(CSRC.rglob("*.h"))]  # a header's change rebuilds too (setuptools tracks .c only)
ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64"):
    ext_modules = [
        Extension(
            f"headwise.kernels._cpu_{isa}",
            sources(isa),
            depends=HEADERS,
            define_macros=[("HW_MODULE", f"_cpu_{isa}")],
            extra_compile_args=COMMON + flags,
            extra_link_args=["-fopenmp"],
            optional=True,
        )
        for isa, flags in VARIANTS.items()
    ]

setup(ext_modules=ext_modules)
