"""What replaying a resumed completion's ids as decode rows costs (runtime/runner.py, issue 43).

A replica that takes `headwise.resume` computes prompt + the ids so far before its first new token.
Since issue 43 the ids run as decode rows (REPLAY_ROWS a pass), which round as the dead replica's
decode steps did; before, they joined the prompt's prefill chunk. This times one resumed request
to its first new token both ways, interleaved round by round (the "prefill" contender patches the
runner back to the old way), for a few resume lengths, and prints each ratio round by round.

    python benchmarks/resume_replay.py                       # SmolLM2 Q4_1 (what serve runs), 1 thread
    python benchmarks/resume_replay.py --weights fp32 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Log, cpu_isa, environment, loadavg, summarize, table, time_interleaved  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)

import headwise  # noqa: E402
from headwise.engine import Engine  # noqa: E402
from headwise.runtime import runner  # noqa: E402
from headwise.runtime.output import Resume  # noqa: E402
from headwise.runtime.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=None, help="headwise.load's weights= (default: the stored Q4_1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", default="64,256,1024", help="resumed ids, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = Log()
    env = environment()
    log(f"{env['cpu_model']} ({cpu_isa()}), {args.threads} thread(s), load {loadavg()}, {env['date']}")
    model = headwise.load("smollm2-135m-instruct", **({"weights": args.weights} if args.weights else {}))
    engine = Engine(model, max_num_seqs=2)
    prompt = engine.output.prompts("Tell me a long story about a lighthouse keeper.")[0][0]
    ids = [int(t) for t in torch.randint(100, 40000, (max(map(int, args.lengths.split(","))),))]
    rows, old = [], runner.generated_from

    def first_token(k: int, replay: bool):
        def run():
            runner.generated_from = old if replay else (lambda r: 1 << 30)
            try:  # a fresh request id and prefix each time: the K/V is computed, not found by prefix
                salt = [int(torch.randint(100, 40000, ()))]
                sp = SamplingParams(temperature=0, max_new_tokens=1)
                group = engine._add(prompt + salt, sp, None, None, limits=False, resume=Resume(tuple(ids[:k]), 0))
                while not group.done.is_set():
                    engine.step()
            finally:
                runner.generated_from = old

        return run

    for k in map(int, args.lengths.split(",")):
        times, n = time_interleaved(
            {"decode rows": first_token(k, True), "prefill": first_token(k, False)}, rounds=args.rounds, warmup=1
        )
        a, b = times["decode rows"], times["prefill"]
        paired = statistics.median(x / y for x, y in zip(a, b))
        sa, sb = summarize([x * 1e3 for x in a]), summarize([x * 1e3 for x in b])
        rows.append([k, f"{sa['min']:.0f} / {sa['median']:.0f} / {sa['max']:.0f}",
                     f"{sb['min']:.0f} / {sb['median']:.0f} / {sb['max']:.0f}", f"{paired:.2f}x", n])  # fmt: skip
    headers = ["resumed ids", "decode rows ms (min/med/max)", "prefill ms (min/med/max)", "rows / prefill", "rounds"]
    log(table(headers, rows))
    log(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
