"""`headwise generate | chat | embed`: the models from the command line."""
from __future__ import annotations

import argparse
import sys
import time

SAMPLING_HELP = "sampling: --temperature 0 is greedy (the default here, reproducible)"


def _load(args):
    from ..models.loading import load
    t0 = time.perf_counter()
    model = load(args.model, dtype=None, backend=args.backend)
    print(f"[loaded {args.model} in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    return model


def _sampling(args):
    from .sampling import SamplingParams
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=tuple(args.stop or ()), seed=args.seed)


def _stream_reply(model, prompt, params) -> str:
    from .generate import generate
    t0 = time.perf_counter()
    pieces = []
    first = None
    for piece in generate(model, prompt, params, stream=True):
        first = first or time.perf_counter()
        pieces.append(piece)
        print(piece, end="", flush=True)
    text = "".join(pieces)
    n = len(model.tokenizer.encode(text, add_special_tokens=False)) if text else 0
    dt = time.perf_counter() - (first or t0)
    print(f"\n[{n} tokens, {n / dt if dt > 0 else float('nan'):.1f} tokens/s, "
          f"first token after {(first or t0) - t0:.2f} s]", file=sys.stderr)
    return text


def run_generate(args) -> int:
    model = _load(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat_template else args.prompt
    _stream_reply(model, prompt, _sampling(args))
    return 0


def run_chat(args) -> int:
    model = _load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with", args.model, "- empty line or Ctrl-D to quit, /reset to clear history", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        history.append({"role": "assistant", "content": _stream_reply(model, history, _sampling(args))})
    return 0


def run_embed(args) -> int:
    from ..embeddings import embed
    model = _load(args)
    t0 = time.perf_counter()
    vecs = embed(model, args.text)
    dt = time.perf_counter() - t0
    for text, v in zip(args.text, vecs):
        print(f"{text[:60]!r}: [{', '.join(f'{x:.4f}' for x in v[:6].tolist())}, ...] ({v.numel()} dims)")
    if len(args.text) > 1:
        sims = vecs @ vecs.T
        print("cosine similarity:")
        for i, t in enumerate(args.text):
            print(f"  {i}: " + "  ".join(f"{s:.3f}" for s in sims[i].tolist()) + f"   {t[:40]!r}")
    print(f"[{len(args.text)} texts in {dt * 1e3:.0f} ms]", file=sys.stderr)
    return 0


def _common(p, default_model):
    p.add_argument("model", nargs="?", default=default_model,
                   help=f"builtin name, checkpoint directory or .gguf file (default: {default_model})")
    p.add_argument("--backend", default="auto", help="attention backend (see `headwise backends`)")


def _sampling_args(p):
    g = p.add_argument_group(SAMPLING_HELP)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a decoder model, then print tokens/s",
                       description="Generate text with a decoder model; streams as it goes.")
    _common(p, "smollm2-135m-instruct")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as one user message")
    _sampling_args(p)
    p.set_defaults(func=run_generate)

    p = sub.add_parser("chat", help="interactive streaming chat that keeps history",
                       description="Chat in the terminal through the model's chat template.")
    _common(p, "smollm2-135m-instruct")
    p.add_argument("--system", default=None, help="system prompt")
    _sampling_args(p)
    p.set_defaults(func=run_chat)

    p = sub.add_parser("embed", help="sentence embeddings and their cosine similarities",
                       description="Embed texts with an encoder (mean pooling + L2 normalize).")
    _common(p, "all-minilm-l6-v2")
    p.add_argument("--text", action="append", required=True, help="a text to embed (repeatable)")
    p.set_defaults(func=run_embed)
