"""`headwise` command line: plan | backends | demo."""
from __future__ import annotations

import argparse
import sys

from . import __version__, compare, plan

SEED_TABLE = ["bert-base", "gpt2", "gpt3-175b", "llama-2-7b", "llama-2-70b"]


def run_demo(args) -> int:
    """The main job for now: the seed's head-count table, planned, and the backends side by side."""
    from .config import get_preset
    print("== headwise plan: the seed's table (+ Llama-2 70B, GQA 64/8), bf16, batch 1 ==\n")
    print(plan.format_all([plan.plan(get_preset(n), dtype="bf16") for n in SEED_TABLE]))
    print()
    for causal in (True, False):
        rows = compare.compare_backends(B=1, H=12, T=args.tokens, D=64, causal=causal, rounds=args.rounds)
        print(compare.format_comparison(rows, f"== attention backends: B=1 H=12 T=S={args.tokens} D=64 "
                                              f"{'causal' if causal else 'bidirectional'} fp32 =="))
        print()
    print("More: `headwise plan --help`, `headwise backends --help`, `make bench` for the full benchmark.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headwise", description="Multi-head attention from the layer to the API.")
    parser.add_argument("--version", action="version", version=f"headwise {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plan.add_cli(sub)
    compare.add_cli(sub)
    from .generation import cli as generation_cli
    generation_cli.add_cli(sub)
    demo = sub.add_parser("demo", help="plan the seed's models and compare attention backends (what `make run` shows)")
    demo.add_argument("--tokens", type=int, default=1024, help="sequence length for the backend comparison")
    demo.add_argument("--rounds", type=int, default=5)
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
