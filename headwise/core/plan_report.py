"""`headwise plan`: the tables it prints and its command line, over headwise.plan's counts.

No torch here either: `headwise plan` answers without loading it.
"""

from __future__ import annotations

import argparse
import sys

from .config import PRESETS, ModelConfig, get_preset, parse_overrides
from .formats import MIXES, QUANT_FORMATS
from .plan import Plan, dtype_bytes, fmt_bytes, fmt_count, fmt_flops, kv_layer_groups, plan


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(row: list[str]) -> str:
        cells = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  ".join(cells).rstrip()

    return "\n".join(line(r) for r in rows)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def format_plan(p: Plan) -> str:
    cfg, attn, pc, fl = p.config, p.config.attention, p.params, p.flops
    head = (
        f"{cfg.name}: {cfg.arch}, {attn.kind} {attn.num_heads}q/{attn.num_kv_heads}kv heads x D={attn.head_dim}, "
        f"L={cfg.num_layers}, C={cfg.d_model}, F={cfg.d_ff}, V={cfg.vocab_size}"
    )
    rows = [["parameters", fmt_count(pc["total"]), f"{pc['total']:,}"]]
    for part in ("attention", "mlp", "embeddings", "lm_head", "norms", "other"):
        rows.append([f"  {part}", fmt_count(pc[part]), _pct(pc[part], pc["total"])])
    rows.append([f"weights ({'+'.join(p.weight_formats) or p.dtype})", fmt_bytes(p.weight_bytes), ""])
    if len(p.weight_formats) > 1:
        for fmt, n in p.weight_formats.items():
            rows.append([f"  in {fmt}", fmt_bytes(n), _pct(n, p.weight_bytes)])
    kv_how = f"2 x L {cfg.num_layers} x Hkv {attn.num_kv_heads} x D {attn.head_dim} x {dtype_bytes(p.dtype)} B"
    rows.append(["KV cache per token", fmt_bytes(p.kv_bytes_per_token), kv_how])
    if any(w is not None for w, _, _ in p.kv_layer_types):  # per layer type: a window keeps only its W
        for w, n, per in p.kv_layer_types:
            kind = "global layers" if w is None else f"sliding layers (window {w:,})"
            rows.append([f"  {n} {kind}", fmt_bytes(per), "every token" if w is None else f"the last {w:,} only"])
    kv_total = fmt_bytes(p.kv_bytes) if cfg.causal else "none (encoder)"
    rows.append([f"KV cache, {p.context:,} tokens x batch {p.batch}", kv_total, ""])
    rows.append([f"forward FLOPs/token at {p.context:,}", fmt_flops(fl["total"]), "2 x multiply-adds"])
    for part in ("projections", "attention", "mlp", "lm_head"):
        rows.append([f"  {part}", fmt_flops(fl[part]), _pct(fl[part], fl["total"])])
    if p.memory is not None:
        verdict = "fits" if p.fits else "does NOT fit"
        rows.append([f"memory (reserve {fmt_bytes(p.reserve)})", fmt_bytes(p.memory), verdict])
        if p.max_context is not None:
            rows.append([f"max context at batch {p.batch}", f"{p.max_context:,}", "tokens"])
            rows.append([f"max batch at context {p.context:,}", f"{p.max_batch:,}", "sequences"])
        if p.kv_pool_blocks is not None:
            g = kv_layer_groups(cfg)[0]
            of = "" if g == cfg.num_layers else f" x {g} layers (a block table per group of {g})"
            rows.append(["engine KV pool", f"{p.kv_pool_blocks:,}", f"blocks of {p.block_size} tokens{of}"])
    out = head + "\n\n" + _table(rows, right={1})
    return out + "".join(f"\nnote: {n}" for n in p.notes)


def format_all(plans: list[Plan]) -> str:
    with_memory = plans[0].memory is not None
    header = "model attn L C H/Hkv D params weights KV/token context KV_cache FLOP/token attn_FLOP".split()
    header = [h.replace("_", " ") for h in header]
    if with_memory:
        header += ["max ctx", "max batch"]
    rows = [header]
    for p in plans:
        c, a = p.config, p.config.attention
        row = [
            c.name, a.kind, str(c.num_layers), str(c.d_model), f"{a.num_heads}/{a.num_kv_heads}", str(a.head_dim),
            fmt_count(p.params["total"]), fmt_bytes(p.weight_bytes), fmt_bytes(p.kv_bytes_per_token),
            f"{p.context:,}", fmt_bytes(p.kv_bytes) if c.causal else "none",
            fmt_flops(p.flops["total"]), _pct(p.flops["attention"], p.flops["total"]),
        ]  # fmt: skip
        if with_memory:
            row += ["-" if n is None else f"{n:,}" for n in (p.max_context, p.max_batch)]
        rows.append(row)
    p0 = plans[0]
    title = f"dtype {p0.dtype}, batch {p0.batch}" + (f", memory {fmt_bytes(p0.memory)}" if with_memory else "")
    foot = [
        "context: each model's max_positions unless --context; KV/token: 2 x L x Hkv x D x bytes; "
        "KV cache: a sliding-window layer holds only its window"
    ]
    foot += [f"{p.config.name}: {note}" for p in plans for note in p.notes]
    return title + "\n\n" + _table(rows, right=set(range(2, len(header)))) + "\n\n" + "\n".join(foot)


# --- CLI -----------------------------------------------------------------------

EXAMPLES = """\
examples:
  headwise plan llama-2-70b --context 4096 --batch 8 --dtype bf16 --memory 80GiB
  headwise plan all --memory 24GiB
  headwise plan llama-2-7b --set num_layers=16 --set num_kv_heads=8   # a custom model
  headwise plan model.Q4_K_M.gguf --memory 8GiB   # a file: its metadata, its weights priced as stored
  headwise plan path/to/hf-checkpoint            # a folder: its config.json
"""


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object; dispatch with args.func(args)."""
    p = subparsers.add_parser(
        "plan",
        help="parameters, FLOPs, KV-cache size and max context/batch for a model",
        description="Count parameters, forward FLOPs per token and KV-cache bytes for a model config,\n"
        "and find the largest context and batch that fit a memory budget after the weights.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    arg = p.add_argument
    arg("model", help=f"a preset ({', '.join(PRESETS)}; aliases such as gpt2-small, llama2-7b), "
        "a .gguf file or a checkpoint folder (config.json; read for its sizes only, no weights loaded), "
        "or 'all' for one table of every preset")  # fmt: skip
    arg("--context", type=int, metavar="N", help="tokens per sequence (default: the model's max_positions)")
    arg("--batch", type=int, default=1, metavar="B", help="sequences held at once (default: 1)")
    arg("--dtype", default="bf16", help="dtype of weights and KV cache: fp32, fp16, bf16, int8, fp8 (default: bf16)")
    arg("--weights", metavar="FORMAT", help="the weights' own format where it differs from --dtype: a GGML block "
        f"format computed as stored ({', '.join(QUANT_FORMATS)}) for the matrices, or one of llama-quantize's "
        f"mixes of them ({', '.join(MIXES)}), norms staying in --dtype")  # fmt: skip
    arg("--memory", metavar="SIZE", help="memory budget, e.g. 80GiB, 80GB (10^9 bytes), 24G (= 24GiB); "
        "adds the largest context and batch that fit after the weights")  # fmt: skip
    arg("--reserve", default="0", metavar="SIZE",
        help="memory held back from --memory for activations and runtime, e.g. 2GiB (default: 0)")  # fmt: skip
    arg("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="change a field of the preset's config (repeatable) to plan a custom model, "
        "e.g. --set num_layers=24 --set d_model=2048 --set num_heads=16 --set num_kv_heads=4")  # fmt: skip
    p.set_defaults(func=run_plan)
    return p


def preset_model(name: str) -> tuple[ModelConfig, str | None, str | None]:
    """A preset's config; no stored weight format, no note (run_plan's `resolve` for presets only)."""
    return get_preset(name), None, None


def run_plan(args: argparse.Namespace, resolve=preset_model) -> int:
    """Print the plan for args.model (or every preset); 0 on success, 2 on bad input.
    resolve(name) -> (ModelConfig, the weights' stored format or None, a note or None); the CLI's
    also reads .gguf files and checkpoint folders (headwise/cli/planning.py: models/ is above core)."""
    try:
        kwargs = dict(context=args.context, batch=args.batch, dtype=args.dtype, weights=getattr(args, "weights", None))
        kwargs.update(memory=args.memory, reserve=getattr(args, "reserve", 0))
        overrides = parse_overrides(getattr(args, "overrides", None) or [])
        if args.model.strip().lower() == "all":
            if overrides:
                raise ValueError("--set changes one preset; name it instead of 'all'")
            print(format_all([plan(cfg, **kwargs) for cfg in PRESETS.values()]))
            return 0
        cfg, stored, note = resolve(args.model)
        if kwargs["weights"] is None and stored is not None:  # a file's own format, unless --weights says
            kwargs["weights"] = stored
        if overrides:  # name the result so the header can't pass it off as the preset
            name = f"{cfg.name} with {', '.join(args.overrides)}"
            cfg = cfg.override(**{"name": name, **overrides})
        p = plan(cfg, **kwargs)
        if stored is not None and kwargs["weights"] == stored:
            p.notes.append(f"weights priced as the file stores them ({stored}); --weights prices another format")
        p.notes += [note] if note else []
        print(format_plan(p))
        return 0
    except ValueError as e:
        print(f"headwise plan: error: {e}", file=sys.stderr)
        return 2
