"""Predicted Outputs (issue 41): an edit request with `prediction` against the same request without.
Goals: >= 2x the tok/s with the document as the prediction, >= 0.97x with an unrelated prediction.

The edit task: a ~300-token document in which one sentence has changed, and a prediction of the
document as it was before (what an editor sends: the file before the edit). SmolLM2-135M cannot
be trusted to apply an edit instruction (it drops or repeats paragraphs), so the prompt hands it the
edited document and asks for it back word for word: output and prediction then differ where an
edit's would, in one sentence (plus whatever the small model drops). Greedy, SmolLM2-135M-Instruct
fp32 (the builtin GGUF, dequantized), batch 1, Engine.generate (the runtime `headwise serve` steps).
Contenders, output tokens per second, wall clock with prefill (the same prompt for all):
  hw_plain        headwise, no prediction
  hw_predicted    headwise, prediction = the original document
  hw_unrelated    headwise, prediction = an unrelated text of the same length
  hf_plain        transformers generate(), same weights (sdpa), greedy
  hf_lookup       transformers generate(prompt_lookup_num_tokens=10): its n-gram drafting from the
                  prompt, which holds the document (the closest thing a transformers user has)
The headwise contenders' token ids are compared: the draft rows run as a batch of decode rows, which
rounds as a batch does, so where they differ the script says where and how close the model's call was.
Rounds run every contender once, in an order rotated each round; min / median / max per contender,
ratio of medians to hw_plain (hf_lookup also to hf_plain).

    .venv/bin/python benchmarks/predicted.py              # saves results/<cpu>/issue41/predicted.{txt,json}
    .venv/bin/python benchmarks/predicted.py --quick      # 1 round, no transformers, no save
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

from _common import Log, cpu_isa, environment, loadavg, results_folder, rotated, summarize, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)

from headwise.engine import Engine  # noqa: E402
from headwise.runtime.sampling import SamplingParams  # noqa: E402

DOCUMENT = """Release notes for the garden irrigation controller, version 2.4.

The controller now reads soil moisture from up to eight sensors and waters each zone only when its \
sensor reports dry soil. Zones without a sensor keep their fixed schedule. The default schedule \
waters every zone for ten minutes at six in the morning.

Rain delay has been improved. When the weather service reports more than five millimetres of rain \
in the last day, watering is skipped for the next twenty-four hours. You can turn this off in the \
settings page under Weather.

The mobile app shows a history of the last thirty days for every zone, with the minutes watered \
and the litres used. Exporting this history as a CSV file is now possible from the same page.

Firmware updates are installed at night, between two and four in the morning, so that they never \
interrupt a watering cycle. The controller restarts once after an update, which takes about a \
minute.

Known issues: sensors with a battery below ten percent may report wrong values. Replace the \
battery when the app shows the low battery warning. Zones seven and eight cannot be renamed from \
the app yet; use the web page instead.

Support: write to the address printed on the box, or open the help page of the app and describe \
the problem. Please add the serial number of the controller, the firmware version shown in the \
settings page and, if you can, a photo of the wiring. We answer within two working days.

Thank you for using the controller, and happy gardening."""
OLD = "The default schedule waters every zone for ten minutes at six in the morning."
NEW = "The default schedule waters every zone for fifteen minutes at five in the morning."
UNRELATED = """Bake the bread at two hundred degrees for forty minutes, then let it cool on a rack. \
The dough should rise twice: once for an hour after kneading, and once for half an hour after \
shaping. Use strong flour with at least twelve percent protein, warm water, salt and a little \
yeast. A baking stone helps the crust; a tray of water in the oven gives steam for the first ten \
minutes. Slice only when the loaf is cold, or the crumb will be gummy. Keep it in a paper bag for \
two days, or freeze slices for later. Rye bread needs a sourdough starter instead of yeast, a \
longer rise and a lower temperature. Seeds on top stick better when the loaf is brushed with \
water first. Sandwich loaves bake in a tin at a lower heat for a softer crust. If the bottom is \
pale, bake it ten minutes longer on the lowest shelf. If the top browns too fast, cover it with \
foil. Flat breads cook in minutes in a very hot pan. A dense loaf usually means too little rising \
time or old yeast; a loaf that collapses rose too long. Write down what you changed each time, \
and the next loaf will be better."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=450)
    ap.add_argument("--weights", choices=["fp32", "stored"], default="fp32",
                    help="headwise's weights: fp32 (as transformers') or stored (the GGUF's Q4_1, as served)")  # fmt: skip
    ap.add_argument(
        "--no-transformers", action="store_true", help="headwise's contenders only (more rounds per minute)"
    )
    ap.add_argument("--quick", action="store_true", help="1 round, headwise only, nothing saved")
    ap.add_argument("--out", default=None, help="results/<out>/issue41 (default: this CPU's tag)")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    torch.set_num_threads(args.threads)
    log = Log()
    env = environment()
    log(f"# predicted outputs: {env['cpu_model']} ({cpu_isa()}), {env['threads']} threads, torch {env['torch']}, "
        f"{env['date']}")  # fmt: skip

    from _contenders import explain_divergence, first_divergence, load_models

    model, hf, hf_version = load_models()
    hf = hf["sdpa"]
    if args.weights == "stored":  # the GGUF's Q4_1 as `headwise serve` runs it (transformers keeps fp32)
        import headwise

        model = headwise.load("smollm2-135m-instruct")
    log(f"headwise weights: {args.weights}; transformers: fp32 (the GGUF dequantized)")
    tok = model.tokenizer
    assert OLD in DOCUMENT
    doc_ids = tok.encode(DOCUMENT, add_special_tokens=False)
    unrelated = tok.encode(UNRELATED, add_special_tokens=False)[: len(doc_ids)]
    edited = DOCUMENT.replace(OLD, NEW)
    messages = [{"role": "user", "content": f"Repeat the following document exactly, word for word:\n\n{edited}"}]
    engine = Engine(model, max_num_seqs=1, num_blocks=256, block_size=16)
    prompt = engine.output.prompts(messages)[0][0]
    log(f"document {len(doc_ids)} tokens, prompt {len(prompt)} tokens, unrelated prediction {len(unrelated)} "
        f"tokens, max_tokens {args.max_tokens}, greedy")  # fmt: skip

    def hw(prediction):
        params = SamplingParams(temperature=0, max_new_tokens=args.max_tokens, prediction=prediction)

        def run():
            engine.cache.pool.clear_prefix_cache()  # every round computes its prompt
            out = engine.generate([prompt], params)[0].outputs[0]
            return out.token_ids, (out.accepted_prediction_tokens, out.rejected_prediction_tokens)

        return run

    ids = torch.tensor([prompt])

    def hf_run(lookup: int | None):
        kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}

        def run():
            with torch.inference_mode():
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_tokens,
                    pad_token_id=0, eos_token_id=list(engine.output.stop_ids(SamplingParams())), **kw,
                )  # fmt: skip
            return out[0, ids.shape[1] :].tolist(), None

        return run

    fns = {"hw_plain": hw(None), "hw_predicted": hw(tuple(doc_ids)), "hw_unrelated": hw(tuple(unrelated))}
    if not (args.quick or args.no_transformers):
        fns.update(hf_plain=hf_run(None), hf_lookup=hf_run(10))
    made, counts = {}, {}
    for name, fn in fns.items():  # warm-up; and the prediction must not change the output
        made[name], counts[name] = fn()
    for name in ("hw_predicted", "hw_unrelated"):  # the same tokens, up to float rounding at a near-tie
        i = first_divergence(made[name], made["hw_plain"])
        if i is None:
            log(f"{name}: the same {len(made[name])} token ids as hw_plain")
        else:  # rows computed as a batch round as a batch does: say where, and how close the call was
            why = explain_divergence(model, prompt, made["hw_plain"], made[name], i, set())
            log(f"{name}: first differs from hw_plain at output token {i}: {why}")
    text = tok.decode(made["hw_plain"])
    log(f"output: {len(made['hw_plain'])} tokens; the new sentence is in it: {NEW in text}; "
        f"the old one: {OLD in text}")  # fmt: skip
    log(f"output text: {text!r}")
    for name in ("hw_predicted", "hw_unrelated"):
        log(f"{name}: accepted_prediction_tokens {counts[name][0]}, rejected_prediction_tokens {counts[name][1]}")
    for name in ("hf_plain", "hf_lookup"):
        if name in made:
            agree = made[name] == made["hw_plain"]
            log(f"{name}: {len(made[name])} tokens, same ids as headwise: {agree}")
    times: dict[str, list[float]] = {n: [] for n in fns}
    load = [loadavg()]
    for r in range(args.rounds):
        for name in rotated(list(fns), r):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
        load.append(loadavg())

    def median_rate(name):
        return statistics.median(len(made[name]) / x for x in times[name])

    rows, res = [], {}
    for name, t in times.items():
        s = summarize([len(made[name]) / x for x in t])
        ratio = s["median"] / median_rate("hw_plain")
        # the same round's hw_plain against this one: a 2-core machine's drift cancels in each pair
        paired = statistics.median(
            (len(made[name]) / x) / (len(made["hw_plain"]) / y) for x, y in zip(t, times["hw_plain"])
        )
        vs_hf = s["median"] / median_rate("hf_plain") if "hf_plain" in times and name.startswith("hf") else None
        res[name] = {
            "tok_s": s, "tokens": len(made[name]), "vs_hw_plain": ratio, "paired_vs_hw_plain": paired,
            "vs_hf_plain": vs_hf, "seconds": t,
        }  # fmt: skip
        rows.append([name, len(made[name]), f"{s['min']:.1f}", f"{s['median']:.1f}", f"{s['max']:.1f}",
                     f"{ratio:.2f}x", f"{paired:.2f}x", f"{vs_hf:.2f}x" if vs_hf else ""])  # fmt: skip
    headers = ["contender", "tokens", "tok/s min", "median", "max", "vs hw_plain", "paired", "vs hf_plain"]
    log(table(headers, rows))
    log("vs hw_plain: ratio of medians; paired: median over rounds of the ratio to the same round's hw_plain")
    log(f"transformers {hf_version}; load average per round (1/5/15 min): {load}")
    if args.quick:
        return
    out = ROOT / "benchmarks" / "results" / (args.out or results_folder()) / "issue41"
    out.mkdir(parents=True, exist_ok=True)
    name = "predicted" if args.weights == "fp32" else f"predicted_{args.weights}"
    name += "_headwise_only" if args.no_transformers else ""
    (out / f"{name}.txt").write_text(log.text())
    data = {"env": env, "args": vars(args), "load": load, "counts": counts, "results": res}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    log(f"saved {out}/{name}.{{txt,json}}")


if __name__ == "__main__":
    main()
