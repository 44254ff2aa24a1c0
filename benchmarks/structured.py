"""Structured outputs (issue 41): the cost of the grammar mask (headwise/runtime/grammar.py,
llguidance) in end-to-end decode throughput. Goal: constrained >= 0.9x unconstrained tok/s.

Model: SmolLM2-135M-Instruct fp32 (the builtin GGUF, dequantized), greedy, CPU.
Every request makes exactly --new-tokens tokens: the schemas are arrays of --items items (longer
than --new-tokens tokens), so constrained answers are cut by max_tokens as the unconstrained ones
(EOS ignored) are, and both contenders time the same number of steps.
Contenders, output tokens per second, wall clock, prefill included (the same prompts for all):
  b1_free        headwise.generate(one chat prompt), no response_format
  b1_schema      the same under one JSON schema
  b16_free       Engine.generate(16 chat prompts), all scheduled together
  b16_schemas    the same, each under its own schema (16 grammars: 16 processor calls per step)
  b16_same       the same, all under one schema (one processor call per step: llguidance's
                 executor fills the 16 masks in parallel)
Rounds run every contender once, in an order rotated each round (benchmarks/_common.py);
min / median / max per contender, ratio of medians to the unconstrained one of the same batch.
Schema compile time: each fixture schema (tests/fixtures/schemas) compiled afresh, median / max.

    .venv/bin/python benchmarks/structured.py             # saves results/zen4/issue41/structured.{txt,json}
    .venv/bin/python benchmarks/structured.py --quick     # 8 tokens, 1 round, no save
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmark this checkout of headwise

from _common import Log, environment, loadavg, rotated, summarize, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)

import headwise  # noqa: E402
from headwise.engine import Engine  # noqa: E402
from headwise.runtime import grammar  # noqa: E402
from headwise.runtime.sampling import SamplingParams  # noqa: E402

ITEM_TYPES = [  # 16 item schemas -> 16 different array schemas
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "string", "maxLength": 4},
    {"type": "string", "pattern": "^[a-z]{2}$"},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    {"const": "ok"},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    {"type": "string", "format": "date"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2},
    {"enum": [1, 2, 3]},
    {"type": "string", "minLength": 1, "maxLength": 3},
]


def array_schema(item: dict, n: int) -> dict:
    return {"type": "array", "items": item, "minItems": n, "maxItems": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="zen4", help="results/<out>/issue41 (this CPU's folder)")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.rounds = 8, 1
    torch.set_num_threads(args.threads)
    log = Log()
    env = environment()
    log(f"# structured outputs: {env['cpu_model']}, {env['threads']} threads, torch {env['torch']}, {env['date']}")

    fixtures = json.loads((ROOT / "tests" / "fixtures" / "schemas" / "schemas.json").read_text())
    model = headwise.load("smollm2-135m-instruct", weights="fp32")
    tok, V = model.tokenizer, model.config.vocab_size
    grammar.llg_tokenizer(tok, V)  # once per model (~0.2-0.4 s), not per schema
    compile_ms = []
    for item in fixtures:
        t0 = time.perf_counter()
        grammar.GrammarProcessor(tok, grammar.compile_grammar("json_schema", item["schema"]), vocab_size=V)
        compile_ms.append(1e3 * (time.perf_counter() - t0))
    log(f"schema compile ({len(fixtures)} fixture schemas): median {statistics.median(compile_ms):.2f} ms, "
        f"max {max(compile_ms):.2f} ms")  # fmt: skip

    def params(schema: dict | None) -> SamplingParams:
        procs = ()
        if schema is not None:
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            procs = (grammar.grammar_processor(tok, fmt, vocab_size=V),)
        return SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=schema is None,
                              logits_processors=procs)  # fmt: skip

    prompts = [[{"role": "user", "content": f"List {args.items} values as a JSON array (set {i})."}] for i in range(16)]
    schemas = [array_schema(t, args.items) for t in ITEM_TYPES]
    engine = Engine(model, max_num_seqs=16, num_blocks=512, block_size=16)
    made: dict[str, list[int]] = {}

    def b1(schema):
        def run():
            r = headwise.generate(model, prompts[0], params(schema))
            return [len(r.token_ids)]

        return run

    def b16(per_prompt):
        def run():
            engine.cache.pool.clear_prefix_cache()  # every round computes every prompt
            outs = engine.generate(prompts, [params(s) for s in per_prompt])
            return [len(o.outputs[0].token_ids) for o in outs]

        return run

    fns = {
        "b1_free": b1(None),
        "b1_schema": b1(schemas[0]),
        "b16_free": b16([None] * 16),
        "b16_schemas": b16(schemas),
        "b16_same": b16([schemas[0]] * 16),
    }
    for name, fn in fns.items():  # warm-up, and every request must make exactly new_tokens
        made[name] = fn()
        assert set(made[name]) == {args.new_tokens}, (name, made[name])
    # Time inside the mask too (grammar.banned_many: every grammar's masks of a step, whether the
    # sampler hands it all grammars at once or a processor asks for its own): its share of a run's
    # wall time does not swing with other jobs on the machine the way two separately timed runs do.
    inside, mask_s = grammar.banned_many, [0.0]

    def timed_call(groups, V):
        t0 = time.perf_counter()
        try:
            return inside(groups, V)
        finally:
            mask_s[0] += time.perf_counter() - t0

    grammar.banned_many = timed_call
    times: dict[str, list[float]] = {n: [] for n in fns}
    masked: dict[str, list[float]] = {n: [] for n in fns}
    load = [loadavg()]
    for r in range(args.rounds):
        for name in rotated(list(fns), r):
            mask_s[0] = 0.0
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
            masked[name].append(mask_s[0])
        load.append(loadavg())
    rows, res = [], {}
    for name, t in times.items():
        tokens = sum(made[name])
        s = summarize([tokens / x for x in t])  # tok/s per round (min time = max rate)
        base = name.split("_")[0] + "_free"
        ratio = s["median"] / statistics.median(sum(made[base]) / x for x in times[base])
        share = statistics.median(m / x for m, x in zip(masked[name], t))  # of the run's wall time
        per_step = 1e3 * statistics.median(masked[name]) / args.new_tokens  # one engine step: all its rows
        res[name] = {"tok_s": s, "tokens_per_run": tokens, "vs_free": ratio, "mask_share": share,
                     "mask_ms_per_step": per_step}  # fmt: skip
        rows.append([name, tokens, f"{s['min']:.1f}", f"{s['median']:.1f}", f"{s['max']:.1f}", f"{ratio:.3f}x",
                     f"{100 * share:.1f}%", f"{per_step:.2f}"])  # fmt: skip
    headers = [
        "contender",
        "tokens/run",
        "tok/s min",
        "median",
        "max",
        "vs free (medians)",
        "mask share",
        "mask ms/step",
    ]
    log(table(headers, rows))
    log("mask share: median over rounds of (time in the grammar processor) / (the run's wall time);")
    log("1 - share bounds constrained / free from below where the mask is the only difference")
    log(f"load average per round (1/5/15 min): {load}")
    if args.quick:
        return
    out = ROOT / "benchmarks" / "results" / args.out / "issue41"
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.txt").write_text(log.text())
    data = {"env": env, "args": vars(args), "load": load, "compile_ms": summarize(compile_ms), "results": res}
    (out / "structured.json").write_text(json.dumps(data, indent=1))
    log(f"saved {out}/structured.{{txt,json}}")


if __name__ == "__main__":
    main()
