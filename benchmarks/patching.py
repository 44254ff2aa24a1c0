"""One claim: activation patching of every head and direct logit attribution, on the default
prompt pairs, take well under a minute per built-in model on 2 CPU cores, and say which heads
cause the answers.

For each model: headwise.analysis.patching.study with the defaults (SmolLM2: IOI, capital of
France, the seed's bank sentence; MiniLM: the bank sentence and one more, cosine metric),
`--rounds` times; wall time and process CPU time of each round, the load average, and the
figures and numbers `headwise analyze` puts in its report (patching.png, dla.png,
patching.json) under benchmarks/results/analysis/<model>/. SmolLM2 is also run with its
weights dequantized to fp32 (`--fp32`): its int8-activation linears make recovered fractions
wander by ~0.01-0.03 between two routes that are the same function (patching.py's note).

    .venv/bin/python benchmarks/patching.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import Log, environment, loadavg  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise.analysis import patching  # noqa: E402
from headwise.analysis.patching_report import FIGURES  # noqa: E402
from headwise.analysis.report import _finite  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "analysis"


def run(name: str, weights: str, rounds: int, log: Log, save: bool) -> dict:
    model = headwise.load(name, dtype="fp32", weights=weights)
    times = []
    for r in range(rounds):
        before, cpu0, t0 = loadavg(), time.process_time(), time.perf_counter()
        res = patching.study(model)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        times.append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "loadavg_before": before})
        log(f"{name} weights={weights} round {r}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {before}")
    for p in res["pairs"]:
        pa = p["patching"]
        top = ", ".join(f"L{t['layer']}H{t['head']} {t['value']:.2f}" for t in pa["top"][:3])
        line = (
            f"  {p['clean']!r}: clean {pa['clean']:.3f}, corrupted {pa['corrupted']:.3f}, "
            f"all heads {pa['all_heads_recovered']:.3f}, shared prefix {pa['shared_prefix']}; top {top}"
        )
        if "dla" in p:
            d = p["dla"]["diff"]
            line += f"; DLA sum {d['total']:.4f} vs logit {d['logit']:.4f}"
        log(line)
    log(f"  mean over pairs, top: {res['top'][:5]}")
    if "dla_top" in res:
        log(f"  DLA (mean), top: {res['dla_top'][:5]}")
    if save:
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        result = {"model": {"name": name}, "patching": res}
        for fig, (draw, wanted) in FIGURES.items():
            if wanted(result):
                draw(result, out / fig)
        (out / "patching.json").write_text(json.dumps(_finite(res | {"timings": times}), separators=(",", ":")))
    return {"model": name, "weights": weights, "rounds": times}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-fp32", action="store_true", help="skip SmolLM2 with dequantized weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = Log()
    log(json.dumps(environment()))
    runs = [
        run("smollm2-135m-instruct", "auto", args.rounds, log, save=True),
        run("all-minilm-l6-v2", "auto", args.rounds, log, save=True),
    ]
    if not args.no_fp32:
        runs.append(run("smollm2-135m-instruct", "fp32", args.rounds, log, save=False))
    results = ROOT / "benchmarks" / "results"
    (results / "patching.txt").write_text(log.text())
    (results / "patching.json").write_text(json.dumps({"env": environment(), "runs": runs}, indent=1))
    print(f"wrote {results / 'patching.txt'} ({os.getloadavg()[0]:.1f} load now)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
