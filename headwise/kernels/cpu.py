"""What headwise's kernels read of the CPU they run on: /proc/cpuinfo's flags (which ISA variant
kernels/__init__.py loads) and, by vendor and family, the settings measured per core (how far
ahead the kernels prefetch the weights they stream), applied when the variant is loaded."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "PREFETCH_AHEAD_BY_CPU",
    "PREFETCH_AHEAD_DEFAULT",
    "QUANT_PREFETCH_AHEAD_BY_CPU",
    "QUANT_PREFETCH_AHEAD_DEFAULT",
    "QUANT_PREFETCH_NTA_BY_CPU",
    "ZMM_MIN_ROWS_BY_CPU",
    "ZMM_MIN_ROWS_DEFAULT",
    "cpu_flags",
    "prefetch_ahead_for",
    "quant_prefetch_ahead_for",
    "quant_prefetch_nta_for",
    "zmm_min_rows_for",
]


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo, or "" where it is not there."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not there)."""
    return set(_cpuinfo("flags").split())


# How far ahead the kernels prefetch the weights they stream, by core: the hardware prefetcher alone
# left memory idle while the FMAs ran, but too far ahead evicts lines before they are read.
# benchmarks/prefetch.py measures the candidates (SmolLM2's 30 layers and its lm_head, 2 threads,
# paired against the first tuning):
# - small_linear.c's 5+-row tiles, in inputs: 128 as tuned on AMD EPYC Zen 4 (2026-11), kept for
#   every CPU not measured (Intel Xeon included); 64 on AMD EPYC Zen 5 (family 26), 1.03-1.07x the
#   speed of 128 at 8-32 rows (48 within 1%, 32 and 96 worse): results/zen5/prefetch.txt;
# - quant_linear.c's packed groups, in bytes: 2048 as tuned on AMD EPYC Zen 3 / 4 (1280-2560 alike
#   there), kept for every CPU not measured;
#   8192 on Zen 5: results/zen5/prefetch_quant.txt, the Q4_1 layers 1.11x at 1 row and 1.14-1.20x
#   at 4-16 rows, the Q8_0 lm_head 1.36x at 1 row, 1.27-1.51x at 4-16 (an earlier run: 1.05x and
#   1.08-1.29x, 1.09x and 1.17-1.37x; 12288 the same within noise, 16384 less at 1 row); generate()
#   B=1 decodes 1.10x faster with it, 16 requests through the engine 1.05x (in-process, paired);
#   16384 on Intel (family 6, measured on a Xeon model 167 with AVX-512 + AMX, 2026-12-04): on
#   SmolLM2 (in that CPU's L3) results/intel-f6-m167-avx512-amx/prefetch_quant.txt, geometric mean
#   1.146x of 2048 at 8192 (the Q4_1 layers 1.04x at 1 row, 1.10-1.11x at 4-16; the Q8_0 lm_head
#   1.07x, 1.20-1.34x), 16384 and 8192 alike in a second run (1.179x, 1.188x) and in generate() B=1
#   (325 vs 326 tok/s, 2048: 277); on benchmarks/synthetic_gguf.py's 7B-shaped Q4_K_M (3.7 GB from
#   DRAM per token) generate() B=1 at 2048 / 4096 / 8192 / 12288 / 16384 / 24576 / 32768 / 65536:
#   4.58 / 4.04 / 3.96 / 4.05 / 4.79-4.83 / 4.72 / 4.67 / 4.65 tok/s: 8192 loses 14% there, 16384
#   wins both. There the fp32 kernel's 64 was 1.03x of 128 (results/.../prefetch.txt), within what
#   the 128 tuned on another Intel Xeon (model 143) gave it, so Intel keeps 128.
PREFETCH_AHEAD_DEFAULT = 128
PREFETCH_AHEAD_BY_CPU = {("AuthenticAMD", "26"): 64}  # (vendor_id, cpu family) -> inputs ahead
QUANT_PREFETCH_AHEAD_DEFAULT = 2048
QUANT_PREFETCH_AHEAD_BY_CPU = {("AuthenticAMD", "26"): 8192, ("GenuineIntel", "6"): 16384}  # -> bytes ahead


def _by_cpu(
    table: dict, default: int, env: str, limit: int, vendor: str | None, family: str | None, least: int = 0
) -> int:
    value = os.environ.get(env, "").strip()
    if value:
        if not value.isdigit() or not least <= int(value) <= limit:
            raise ValueError(f"{env}={value!r}: give a whole number from {least} to {limit}")
        return int(value)
    vendor = _cpuinfo("vendor_id") if vendor is None else vendor
    family = _cpuinfo("cpu family") if family is None else family
    return table.get((vendor, family), default)


def prefetch_ahead_for(vendor: str | None = None, family: str | None = None) -> int:
    """small_linear's prefetch distance (inputs) for this CPU, or for the given /proc/cpuinfo
    vendor_id and cpu family; HEADWISE_PREFETCH_AHEAD=<inputs> overrides it."""
    return _by_cpu(PREFETCH_AHEAD_BY_CPU, PREFETCH_AHEAD_DEFAULT, "HEADWISE_PREFETCH_AHEAD", 4096, vendor, family)


def quant_prefetch_ahead_for(vendor: str | None = None, family: str | None = None) -> int:
    """quant_linear's prefetch distance (bytes), as prefetch_ahead_for;
    HEADWISE_QUANT_PREFETCH_AHEAD=<bytes> overrides it."""
    return _by_cpu(
        QUANT_PREFETCH_AHEAD_BY_CPU,
        QUANT_PREFETCH_AHEAD_DEFAULT,
        "HEADWISE_QUANT_PREFETCH_AHEAD",
        65536,
        vendor,
        family,
    )


# Whether the avx512 build's K-quant ymm tiles (a batch-1 step of a Q4_K / Q5_K / Q6_K file) prefetch the
# weights non-temporally (NTA: not kept in L2 / L3, which hold the activations and KV): 1 on AMD EPYC Zen 4
# (family 25; Zen 3, also 25, runs the avx2 build, which has no such switch), where a Llama-7B-shaped Q4_K
# layer streamed from DRAM at 1 row of x ran 1.03-1.07x faster paired at 2 threads in four runs and 0.95x in
# a fifth, 1.01-1.05x at 1 thread (benchmarks/dram_stream.py, 15-25 interleaved rounds on a host at load 5-12,
# 2026-12-05: a small gain within a noisy host's spread; results/zen4/issue42/dram_stream*.txt); not measured
# elsewhere (Intel's 1-row steps take the zmm tiles, which keep T0), so 0 there.
QUANT_PREFETCH_NTA_BY_CPU = {("AuthenticAMD", "25"): 1}


def quant_prefetch_nta_for(vendor: str | None = None, family: str | None = None) -> int:
    """1 where the K-quant tiles prefetch with NTA on this CPU, as prefetch_ahead_for;
    HEADWISE_QUANT_PREFETCH_NTA=0 / 1 overrides it."""
    return _by_cpu(QUANT_PREFETCH_NTA_BY_CPU, 0, "HEADWISE_QUANT_PREFETCH_NTA", 1, vendor, family)


# From how many rows of x the avx512 build's quantized kernel reads two packed groups at once in zmm
# tiles (csrc/x86/avx512/quant_group.c's hw_zmm_min_rows; the same bits either way): 4 as tuned on AMD EPYC
# Zen 4 / 5; 1 on Intel (family 6, measured on a Xeon model 167 with AVX-512 + AMX, 2026-12-04, the
# prefetch at 16 KiB, each a fresh process, 3 interleaved rounds): the 7B-shaped Q4_K_M file of
# benchmarks/synthetic_gguf.py, generate() B=1 from DRAM, 4.40 / 4.40 / 4.45 -> 4.84 / 4.90 / 4.79
# tok/s; SmolLM2's Q4_1, 206 / 249 / 185 -> 258 / 263 / 241 (a noisy hour; a quiet one the day before,
# in L3: 344-353 -> 340-348, even).
ZMM_MIN_ROWS_DEFAULT = 4
ZMM_MIN_ROWS_BY_CPU = {("GenuineIntel", "6"): 1}


def zmm_min_rows_for(vendor: str | None = None, family: str | None = None) -> int:
    """quant_group.c's zmm tiles from this many rows of x, as prefetch_ahead_for;
    HEADWISE_ZMM_MIN_ROWS=<rows> (1 to 65; 65: never) overrides it."""
    return _by_cpu(ZMM_MIN_ROWS_BY_CPU, ZMM_MIN_ROWS_DEFAULT, "HEADWISE_ZMM_MIN_ROWS", 65, vendor, family, least=1)


# The compiled module's tuning setters, each with what sets it for this CPU (the tables above)
TUNABLE = {
    "prefetch_ahead": prefetch_ahead_for,
    "quant_prefetch_ahead": quant_prefetch_ahead_for,
    "zmm_min_rows": zmm_min_rows_for,
    "quant_prefetch_nta": quant_prefetch_nta_for,
}


def tune(mod) -> None:
    """Set a loaded kernel module's tuning for this CPU (kernels._ext, and benchmarks' second builds)."""
    for name, value_for in TUNABLE.items():
        getattr(mod, name)(value_for())
