"""One claim: the default `headwise analyze` finishes in <= 3 minutes per built-in model on an
idle 2-core machine (issue 16).

Runs `headwise analyze MODEL --out <tmp> --quiet` as a user would, in a fresh process per run,
for each model, `--rounds` times with the models interleaved; reports wall time, the child's CPU
time, each step's seconds from the run's own analysis.json ("timings_s"), the load average
and CPU steal around each run, and the CPU model with its vector ISA.

    .venv/bin/python benchmarks/analyze_time.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, rotated, table  # noqa: E402

MODELS = ("all-minilm-l6-v2", "smollm2-135m-instruct")
LIMIT_S = 180.0  # the bound per model


def _headwise() -> list[str]:
    exe = Path(sys.executable).with_name("headwise")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "headwise.cli"]


def run_once(model: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="analyze_time_"))
    try:
        before_load, ticks = loadavg(), cpu_ticks()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*_headwise(), "analyze", model, "--out", str(out), "--quiet"], capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"headwise analyze {model} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        steps = json.loads((out / "analysis.json").read_text())["timings_s"]
        return {
            "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime, 1),
            "steps_s": steps,
            "load": [before_load, loadavg()],
            **busy_and_steal(ticks, cpu_ticks()),
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="runs per model, interleaved (default 2)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated built-in model names")
    p.add_argument("--out", default="analyze_time", help="name of the result files under benchmarks/results/")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    log, env = Log(), environment()
    log(
        f"headwise analyze wall time  {env['date']}  torch {env['torch']}  cpu {env['cpu_model']} ({env['cpu_count']} cores)"
    )
    log(f"command: {env['command']}; each run: headwise analyze MODEL --out <tmp> --quiet (defaults), a fresh process")
    runs: dict[str, list[dict]] = {m: [] for m in models}
    for r in range(a.rounds):
        for m in rotated(models, r):
            res = run_once(m)
            runs[m].append(res)
            steps = ", ".join(f"{k} {v:.1f}" for k, v in res["steps_s"].items())
            log(
                f"  round {r + 1} {m}: wall {res['wall_s']} s, cpu {res['cpu_s']} s, load {res['load'][0]} -> "
                f"{res['load'][1]}, steal {res.get('steal_pct', '?')}%; steps: {steps}"
            )
    rows = []
    for m, rs in runs.items():
        walls = [x["wall_s"] for x in rs]
        rows.append(
            [
                m,
                len(rs),
                min(walls),
                statistics.median(walls),
                max(walls),
                "MET" if max(walls) <= LIMIT_S else "NOT MET",
            ]
        )
    log("")
    log(table(["model", "runs", "wall s min", "median", "max", f"<= {LIMIT_S:.0f} s"], rows))
    log(f"loadavg after {loadavg()}")
    res_dir = ROOT / "benchmarks" / "results"
    (res_dir / f"{a.out}.txt").write_text(log.text())
    (res_dir / f"{a.out}.json").write_text(json.dumps({"env": env, "runs": runs}, indent=1) + "\n")
    return 0 if all(r[-1] == "MET" for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
