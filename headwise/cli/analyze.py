"""`headwise analyze MODEL`: patterns, roles, attribution, importance, ablation, pruning -> report."""

from __future__ import annotations

import argparse
import sys
import time

from .argtypes import check_model, positive_int
from ..core.examples import ANALYSIS_TEXT


def _fractions(text: str) -> list[float]:
    try:
        values = sorted(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers, got {text!r}") from None
    if not values or values[0] <= 0 or values[-1] >= 1:
        raise argparse.ArgumentTypeError(f"fractions must lie in (0, 1), got {text!r}")
    return values


def add_cli(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="head analysis report: patterns, roles, attribution, ablation, pruning",
        description="Analyse every attention head of a model and write PNG figures, one "
        "self-contained HTML page and analysis.json. Default sizes take a few "
        "minutes on 2 CPU cores; --fit/--heldout/--seeds do more.",
    )
    p.add_argument("model", help="builtin name (all-minilm-l6-v2, smollm2-135m-instruct), checkpoint dir or .gguf")
    p.add_argument("--text", default=ANALYSIS_TEXT, help="the text whose patterns are drawn (default: %(default)r)")
    p.add_argument(
        "--corpus",
        help="plain-text file, paragraphs separated by blank lines (default: English "
        "prose of Python's pydoc_data.topics)",
    )
    p.add_argument("--out", default=None, help="output directory (default: analysis-<model>)")
    p.add_argument(
        "--fit",
        type=positive_int,
        help="fit examples: sentences (encoders, default 128) or rows of --seq-len tokens (decoders, default 4)",
    )
    p.add_argument("--heldout", type=positive_int, help="held-out examples for the ablation curves (default 192 / 4)")
    p.add_argument(
        "--seq-len", type=positive_int, default=128, help="decoder row length in tokens (default %(default)s)"
    )
    p.add_argument("--seeds", type=positive_int, default=3, help="random removal orders (default %(default)s)")
    p.add_argument("--fractions", type=_fractions, help="fractions of heads removed on the curves, comma-separated")
    p.add_argument("--prune", type=float, default=0.3, help="fraction pruned for real, 0 to skip (default %(default)s)")
    p.add_argument("--no-mean-ablation", action="store_true", help="skip the mean-ablation curve")
    p.add_argument(
        "--pairs",
        help="JSONL of prompt pairs for activation patching, one object a line: clean, corrupted (same token "
        "length) and, for decoders, answer and wrong (single tokens); default: built-in pairs",
    )
    p.add_argument("--no-patching", action="store_true", help="skip activation patching and direct logit attribution")
    p.add_argument(
        "--context",
        type=positive_int,
        help="also score every head over this many tokens of the corpus (repeated if shorter), in O(T) memory "
        "from the fused kernel, with the peak memory; e.g. 16384 (off by default)",
    )
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    if not 0 <= args.prune < 1:
        print(f"headwise analyze: --prune must be in [0, 1), got {args.prune}", file=sys.stderr)
        return 2
    try:
        check_model(args.model)  # a typo is reported before torch, the corpus and the model load
    except ValueError as e:
        print(f"headwise analyze: {e}", file=sys.stderr)
        return 2
    import torch

    import headwise
    from ..analysis.analyze import Settings, analyze
    from ..analysis.corpus import load_corpus
    from ..analysis.pairs import load_pairs
    from ..analysis.report import write

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        corpus = load_corpus(args.corpus)
        pairs = load_pairs(args.pairs) if args.pairs else None
        # fp32 weights (a GGUF dequantized): the heads' own function, without the quantized kernel's
        # int8 rounding of activations, which moved patching's recovered fractions by up to 0.03
        # and left direct logit attribution's terms 0.09 short of the logit
        model = headwise.load(args.model, weights="fp32")
        if args.context:  # before the other steps run for minutes
            from ..analysis.long_context import check_context

            check_context(model, args.context)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"headwise analyze: {e}", file=sys.stderr)
        return 2
    settings = Settings(
        fit=args.fit,
        heldout=args.heldout,
        seq_len=args.seq_len,
        seeds=args.seeds,
        prune=args.prune,
        mean_ablation=not args.no_mean_ablation,
        patching=not args.no_patching,
        pairs=pairs,
        context=args.context,
    )
    if args.fractions:
        settings.fractions = args.fractions
    out = args.out or f"analysis-{str(args.model).rstrip('/').split('/')[-1]}"
    try:
        result = analyze(
            model,
            corpus,
            text=args.text,
            out=out,
            settings=settings,
            show_progress=not args.quiet,
            name=str(args.model),
        )
    except ValueError as e:
        print(f"headwise analyze: {e}", file=sys.stderr)
        return 2
    result["timings_s"]["total"] = round(time.perf_counter() - t0, 1)
    files = write(result, out)
    print(summary_text(result))
    print(
        f"\nwrote {files['html']}, {files['json']} and {len(files['figures'])} figures in {out}/ "
        f"({result['timings_s']['total']:.0f} s)"
    )
    return 0


def summary_text(result: dict) -> str:
    from ..analysis.layer_types import summary_line, windowed

    lines = [f"{result['model']['name']}: {result['model']['layers']} layers x {max(result['model']['heads'])} heads"]
    ab = result.get("ablation")
    if ab:
        base = ab["baseline"]
        lines.append("baseline: " + ", ".join(f"{k} {v:.4g}" for k, v in base.items() if isinstance(v, float)))
        for key, per in ab["removable"].items():
            for t, row in per.items():
                parts = [f"{k} {v:.0%}" for k, v in row.items()]
                lines.append(f"heads removable before {key} > {t}: " + ", ".join(parts))
    groups = result.get("layer_types")
    if groups and windowed(groups):  # local (sliding-window) layers beside global ones
        lines.append(summary_line(groups))
    p = result.get("pruning")
    if p:
        lat = p["latency"]
        lines.append(
            f"pruned {p['heads_removed']} heads ({p['fraction']:.0%}): params {p['params_before']:,} -> "
            f"{p['params_after']:,}, latency {lat['full']['median'] * 1e3:.1f} -> "
            f"{lat['pruned']['median'] * 1e3:.1f} ms (median of {lat['full']['rounds']}, load "
            f"{lat['loadavg'][0]}), quality drop {p['drop_after']:.2%}"
        )
    pt = result.get("patching")
    if pt and pt.get("top"):
        best = ", ".join(f"L{t['layer']}H{t['head']} {t['value']:.2f}" for t in pt["top"][:3])
        lines.append(f"patching ({pt['metric']}, {len(pt['pairs'])} pairs): heads that recover most: {best}")
    if result.get("long_context"):
        from ..analysis.long_context import summary_lines

        lines += summary_lines(result["long_context"])
    hints = result.get("hints")
    if hints:
        n = sum(sum(r) for r in hints["flagged"])
        lines.append(f"heads whose top-attended token is a hint, not an explanation: {n}")
    return "\n".join(lines)
