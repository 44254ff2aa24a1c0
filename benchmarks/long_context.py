"""One claim: every head of SmolLM2 can be scored at 16384 tokens in the memory of a plain forward,
where its (T, T) patterns would take 270 GiB (issue 16, item 1).

For each context: `headwise.analysis.long_context.study` (what `headwise analyze --context N`
runs) over the pydoc corpus, its wall time and peak memory (VmHWM reset through
/proc/self/clear_refs before the pass), and with `--plain` the same forward without statistics
as the memory baseline. Weights as `headwise analyze` loads them (the GGUF's own Q4_1 blocks).
Writes results/long_context.json, and long_context.png for the longest context under
results/analysis/smollm2-135m-instruct/.

    .venv/bin/python benchmarks/long_context.py --contexts 4096 16384 --plain
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import environment, loadavg  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise.analysis import long_context as lc  # noqa: E402
from headwise.analysis.corpus import load_corpus  # noqa: E402
from headwise.analysis.long_context_report import fig_long_context  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def plain(model, paragraphs, T: int) -> dict:
    batch, _ = lc.context_batch(model, paragraphs, T)
    lc.reset_peak()
    before = lc._status_bytes("VmRSS:")
    t0 = time.perf_counter()
    with torch.inference_mode():
        lc._light_forward(model, batch)
    peak = lc._status_bytes("VmHWM:")
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_mib": round(peak / 2**20, 1),
        "extra_mib": round((peak - before) / 2**20, 1),
        "loadavg": loadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--plain", action="store_true", help="also the forward without statistics (memory baseline)")
    args = ap.parse_args()
    model = headwise.load(args.model, dtype="fp32").eval()
    corpus = load_corpus()
    paragraphs = corpus.fit_paragraphs + corpus.heldout_paragraphs
    out = {"environment": environment(), "model": args.model, "runs": {}}
    for T in args.contexts:
        res = lc.study(model, paragraphs, T, source=corpus.source)
        res["loadavg"] = loadavg()
        if args.plain:
            res["plain_forward"] = plain(model, paragraphs, T)
        out["runs"][str(T)] = res
        print("\n".join(lc.summary_lines(res)), f"(load {res['loadavg']})", flush=True)
    (RESULTS / "long_context.json").write_text(json.dumps(out, indent=1))
    longest = out["runs"][str(max(args.contexts))]
    fig_dir = RESULTS / "analysis" / args.model
    fig_dir.mkdir(parents=True, exist_ok=True)
    fig_long_context({"model": {"name": args.model}, "long_context": longest}, fig_dir / "long_context.png")


if __name__ == "__main__":
    main()
