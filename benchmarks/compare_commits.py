"""One claim: the new code decodes and prefills no slower than the commit before issue 13's work.

Issue 13's "no regression": benchmarks/decode.py's B=1, B=8 and prefill-512 figures of the
new code vs the old commit, interleaved in one run. Each side is a checkout: --base REV (a
git worktree, made under /tmp and reused) and --new (default: this working tree, uncommitted
changes included; or a REV, also a worktree). Each side runs one long-lived worker process
(benchmarks/_worker.py, this repository's copy for both, this repository's .venv
python) that imports its checkout's headwise and loads SmolLM2-135M-Instruct fp32 once.
fp32 weights unless HW_WORKER_WEIGHTS says otherwise (auto: a GGUF's blocks as stored, for commits
that have them). Both workers get the same environment: GOMP_SPINCOUNT=2000 set explicitly (the old commit's
`import headwise` would otherwise choose OMP_WAIT_POLICY=PASSIVE) and --threads threads.

Metrics (greedy, EOS ignored, prompts of random ids >= 17, the same for both sides):
  decode_B1    generate(128-token prompt, 64 new tokens): GenerationResult.tokens_per_second
  decode_B8    the same for 8 prompts in one call: the rows' rates summed (they share the time)
  prefill_512  one model(ids, cache=fresh ContiguousKVCache) forward of a 512-token prompt: tok/s
Each (metric, side) pair is warmed up once, then runs once per round, the order rotated each
round (benchmarks/_common.py); one worker runs at a time, the other waits on its pipe.
Reported: min / median / max per side, new / base of the medians, and the median over rounds
of the same round's new / base ("paired": drift hits both). Greedy ids of base and new must
agree on the decode prompts; a divergence is reported with the logit gap there, not hidden.

    .venv/bin/python benchmarks/compare_commits.py            # 7 rounds; saves results/compare_commits.*
    .venv/bin/python benchmarks/compare_commits.py --quick    # 2 rounds, 16 new tokens, prefill 128; no save
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import Log, busy_and_steal, cpu_model, cpu_ticks, environment, loadavg, rotated, summarize, table  # noqa: E402,I001
from _worker import Worker  # noqa: E402

BASE_REV = "86b5466"  # the commit before issue 13's work
WORKTREES = Path("/tmp/headwise-compare")
SEED = 4321
WORKER_ENV = {"GOMP_SPINCOUNT": "2000"}  # headwise.core.threads.DEFAULT_ENV (what import headwise sets), both sides


# ------------------------------------------------------------------ checkouts
def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str | None) -> dict:
    """{label, path, commit, dirty}: this working tree for rev None, else a detached worktree of rev."""
    if rev is None:
        dirty = bool(git("status", "--porcelain", "--", "headwise"))
        return {"label": "working tree", "path": str(ROOT), "commit": git("rev-parse", "HEAD"), "dirty": dirty}
    try:
        sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        sys.exit(f"--base/--new {rev!r} is not a commit here; give a hash or a ref `git log` shows")
    path = WORKTREES / sha[:12]
    if not (path / ".git").exists():
        git("worktree", "prune")  # a worktree deleted by hand blocks re-adding it
        path.parent.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", str(path), sha)
    elif git("rev-parse", "HEAD", cwd=path) != sha:
        sys.exit(f"{path} exists but is not at {sha[:12]}; remove it (git worktree remove {path}) and rerun")
    build_kernels(path)
    return {"label": rev, "path": str(path), "commit": sha, "dirty": False}


def build_kernels(path: Path) -> None:
    """A worktree holds sources only: build its C extension in place (as `pip install -e .` does
    for this checkout), so that a commit with kernels is measured with them; an older commit
    without any has nothing to build. Each worker prints which kernels it runs."""
    setup = path / "setup.py"
    if not setup.exists() or "Extension(" not in setup.read_text():
        return
    if list((path / "headwise" / "kernels").glob("_cpu_*.so")):
        return
    print(f"building {path.name}'s C kernels (setup.py build_ext --inplace) ...", flush=True)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, check=True, capture_output=True
    )


# ------------------------------------------------------------------ the run
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", default=BASE_REV, help=f"the old commit (default {BASE_REV})")
    p.add_argument("--new", default=None, help="the new commit (default: this working tree, as it is now)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in both workers (default 2)")
    p.add_argument("--new-tokens", type=int, default=64, help="decode tokens per sequence (default 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="decode prompt length (default 128)")
    p.add_argument("--prefill-len", type=int, default=512, help="prefill prompt length (default 512)")
    p.add_argument("--quick", action="store_true", help="2 rounds, 16 new tokens, prefill 128; nothing saved")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.new_tokens, args.prefill_len = 2, 16, 128
    return args


def first_divergence(a: list[int], b: list[int]) -> int | None:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def agreement(workers: dict[str, Worker], prompts: list[list[int]], ids: dict[str, list[list[int]]]) -> dict:
    """Rows whose greedy ids agree; for each divergence, new's logit gap between the two tokens."""
    rows = []
    for b, (p, x, y) in enumerate(zip(prompts, ids["base"], ids["new"])):
        i = first_divergence(x, y)
        if i is not None and i < min(len(x), len(y)):
            g = workers["new"].ask("gap", prompt=p + x[:i], a=x[i], b=y[i])["gap"]
            rows.append({"row": b, "step": i, "base_token": x[i], "new_token": y[i], "new_logit_gap": g})
        elif i is not None:
            rows.append({"row": b, "step": i, "lengths": [len(x), len(y)]})
    return {"rows": len(prompts), "identical": len(prompts) - len(rows), "divergences": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    log = Log()
    env = environment()
    env["threads"] = args.threads  # the workers', not this process's
    env["loadavg_before"], ticks0 = loadavg(), cpu_ticks()
    sides = {"base": checkout(args.base), "new": checkout(args.new)}
    log(f"headwise compare_commits  {env['date']}")
    log(
        f"cpu {cpu_model()} ({env['cpu_count']} cores)  torch {env['torch']}  threads {args.threads}  "
        f"worker env {WORKER_ENV}"
    )
    log(
        f"loadavg before {env['loadavg_before']}"
        + ("  ** busy machine (> 1.5): treat numbers with care **" if env["loadavg_before"][0] > 1.5 else "")
    )
    for side, c in sides.items():
        log(
            f"{side}: {c['label']} = {c['commit'][:12]}{' + uncommitted changes in headwise/' if c['dirty'] else ''}"
            f"  ({c['path']})"
        )

    log_dir = WORKTREES
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_env = {**os.environ, **WORKER_ENV, "OMP_NUM_THREADS": str(args.threads)}
    worker_env.pop("OMP_WAIT_POLICY", None)  # both sides wait the same way: GOMP_SPINCOUNT alone
    workers = {
        side: Worker(side, c["path"], args.threads, log_dir / f"compare_{side}.log", worker_env)
        for side, c in sides.items()
    }
    try:
        info = {side: w.ask("info") for side, w in workers.items()}
        for side, i in info.items():
            log(
                f"  {side} worker: headwise from {i['headwise']}, torch {i['torch']}, {i['threads']} threads, "
                f"weights {i['weights']}, kernels {i['kernels']}, env {i['wait_env']}"
            )
            if not i["headwise"].startswith(sides[side]["path"] + os.sep):
                sys.exit(f"the {side} worker imported headwise from {i['headwise']}, not {sides[side]['path']}")
        vocab = info["new"]["vocab_size"]
        rng = random.Random(SEED)

        def prompt(T):
            return [rng.randrange(17, vocab) for _ in range(T)]  # ids < 17 are special tokens

        decode_prompts = {1: [prompt(args.prompt_len)], 8: [prompt(args.prompt_len) for _ in range(8)]}
        prefill_prompt = prompt(args.prefill_len)
        metrics = {
            "decode_B1": ("decode", {"prompts": decode_prompts[1], "new": args.new_tokens}),
            "decode_B8": ("decode", {"prompts": decode_prompts[8], "new": args.new_tokens}),
            f"prefill_{args.prefill_len}": ("prefill", {"prompt": prefill_prompt}),
        }
        contenders = [(m, side) for m in metrics for side in workers]
        ids: dict[str, dict[str, list]] = {}
        for m, side in contenders:  # warm-up: first forwards pack weights, allocate scratch
            op, fields = metrics[m]
            reply = workers[side].ask(op, **fields)
            if "ids" in reply:
                ids.setdefault(m, {})[side] = reply["ids"]
        agree = {m: agreement(workers, metrics[m][1]["prompts"], v) for m, v in ids.items()}
        for m, a in agree.items():
            log(
                f"  greedy ids {m}, base vs new: {a['identical']}/{a['rows']} rows identical"
                + "".join(
                    f"; row {d['row']} from step {d['step']}: "
                    + (
                        f"base {d['base_token']} new {d['new_token']}, new's logit gap {d['new_logit_gap']:.1e}"
                        if "new_logit_gap" in d
                        else f"lengths {d['lengths']}"
                    )
                    for d in a["divergences"]
                )
            )

        rates: dict[str, dict[str, list[float]]] = {m: {s: [] for s in workers} for m in metrics}
        load0, ticks1 = loadavg(), cpu_ticks()
        for r in range(args.rounds):
            for m, side in rotated(contenders, r):
                op, fields = metrics[m]
                rates[m][side].append(workers[side].ask(op, **fields)["tok_s"])
            log(
                f"  round {r + 1}/{args.rounds}: "
                + ", ".join(f"{m} {rates[m]['base'][-1]:.1f}/{rates[m]['new'][-1]:.1f}" for m in metrics)
                + f" tok/s base/new (load {loadavg()[0]:.2f})"
            )
        load1, cpu = loadavg(), busy_and_steal(ticks1, cpu_ticks())
    finally:
        for w in workers.values():
            w.close()

    summary = {}
    rows = []
    for m, by_side in rates.items():
        s = {side: summarize(v) for side, v in by_side.items()}
        s["ratio"] = s["new"]["median"] / s["base"]["median"]
        s["paired"] = statistics.median(n / b for b, n in zip(by_side["base"], by_side["new"]))
        summary[m] = s
        f = "{:.1f}".format
        rows.append(
            [
                m,
                *(f(s["base"][k]) for k in ("min", "median", "max")),
                *(f(s["new"][k]) for k in ("min", "median", "max")),
                f"{s['ratio']:.3f}x",
                f"{s['paired']:.3f}x",
            ]
        )
    env["loadavg_after"] = loadavg()
    env.update(busy_and_steal(ticks0, cpu_ticks()))
    log("")
    log(
        f"tok/s, {args.rounds} interleaved rounds after 1 warm-up, load {load0[0]:.2f} -> {load1[0]:.2f}"
        + (f", cpu busy {cpu['busy_pct']}% steal {cpu['steal_pct']}%" if cpu else "")
        + f"; decode: {args.prompt_len}-token prompts + {args.new_tokens} new tokens (rate over the last "
        f"{args.new_tokens - 1}); prefill: one {args.prefill_len}-token forward"
    )
    log(table(["metric", "base min", "median", "max", "new min", "median", "max", "new/base", "paired"], rows))
    log("new/base: of the medians; paired: median over rounds of the same round's new/base")
    steal = f"  cpu busy {env['busy_pct']}% steal {env['steal_pct']}%" if "steal_pct" in env else ""
    log(f"loadavg after {env['loadavg_after']}{steal}")
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare_commits.json").write_text(
            json.dumps(
                {
                    "benchmark": "compare_commits",
                    "env": env,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "sides": sides,
                    "workers": info,
                    "agreement": agree,
                    "rates_tok_s": rates,
                    "summary": summary,
                    "loadavg_rounds": [load0, load1],
                    **cpu,
                },
                indent=1,
            )
            + "\n"
        )
        (args.out / "compare_commits.txt").write_text(log.text())
        print(f"saved {args.out / 'compare_commits.json'} and compare_commits.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
