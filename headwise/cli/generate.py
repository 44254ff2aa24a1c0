"""`headwise generate | chat | embed`: the models from the command line.

Arguments are checked before a model loads (a bad one is one line on stderr, exit 2).
A chat model's prompt goes through its chat template unless --raw; each reply ends with
a line on stderr saying why it stopped. In `chat`, Ctrl-C stops the reply and keeps the
conversation; Ctrl-C or Ctrl-D at the prompt quits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ..core.governor import ENV, parse_count

from .argtypes import (
    Formatter,
    backend_name,
    fail,
    weights_name,
    model_for,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    probability,
    unit_interval,
)

SAMPLING_HELP = "sampling: --temperature 0 is greedy (the default here, reproducible)"
_WHY = {
    "stop": "the model ended its turn, or a --stop string",
    "length": "reached --max-new-tokens",
    "interrupted": "Ctrl-C",
}


def _load(args, task: str):
    """The model, or None after printing why it cannot serve this command."""
    from ..models.from_path import load

    prog = f"headwise {args.command}"
    if args.threads is None and os.environ.get(ENV):
        try:
            parse_count(os.environ[ENV], ENV)
        except ValueError as e:
            fail(prog, e)
            return None
    if args.threads is not None:  # pinned: the governor (core/governor.py) stays out
        import torch

        from ..runtime.threads import pin_threads

        pin_threads(args.threads)
        torch.set_num_threads(args.threads)  # loading and embed, which take no engine step
    t0 = time.perf_counter()
    try:
        model = load(args.model, weights=args.weights, backend=args.backend)
    except (OSError, ValueError, LookupError) as e:  # missing files, bad checkpoints, uninstalled builtins
        fail(prog, e)
        return None
    if getattr(model, "tokenizer", None) is None:
        fail(prog, f"{args.model} has no tokenizer (tokenizer.json or vocab.txt); the CLI needs one to read text")
        return None
    if bool(getattr(model.config, "causal", False)) != (task == "chat"):
        what = (
            "a decoder; use `headwise generate` or `headwise chat`"
            if task == "embed"
            else "an encoder (an embedding model); use `headwise embed`"
        )
        fail(prog, f"{args.model} is {what}")
        return None
    print(f"[loaded {args.model} in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    return model


def _sampling(args):
    from ..runtime.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop or ()),
        seed=args.seed,
    )


def _prompt_ids(model, prompt) -> list[int]:
    """Token ids as generate() makes them: chat messages through the template, text as is."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        return tok.encode(prompt)
    return tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special_tokens=False)


def _stream_reply(model, prompt, params, kv_dtype: str | None = None) -> tuple[str, str]:
    """Stream one reply to stdout -> (its text, finish reason). Ctrl-C ends it early ("interrupted")."""
    from ..generation.generate import generate

    ids = _prompt_ids(model, prompt)
    t0 = time.perf_counter()
    pieces, first, reason = [], None, "interrupted"
    run = generate(model, ids, params, stream=True, kv_dtype=kv_dtype)
    try:
        while True:
            try:
                piece = next(run)
            except StopIteration as done:
                reason = done.value or "length"
                break
            first = first or time.perf_counter()
            pieces.append(piece)
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        run.close()
    text = "".join(pieces)
    n = len(model.tokenizer.encode(text, add_special_tokens=False)) if text else 0
    dt = time.perf_counter() - (first or t0)
    rate = f"{n / dt:.1f}" if n and dt > 0 else "-"
    print(flush=True)
    print(
        f"[finish_reason: {reason} ({_WHY[reason]}); prompt {len(ids)} tokens, {n} generated, {rate} tokens/s, "
        f"first token after {(first or t0) - t0:.2f} s]",
        file=sys.stderr,
        flush=True,
    )
    return text, reason


def run_generate(args) -> int:
    from ..models.chat_template import ChatTemplateError

    model = _load(args, "chat")
    if model is None:
        return 2
    chat = not args.raw and model.tokenizer.chat_template is not None
    prompt = [{"role": "user", "content": args.prompt}] if chat else args.prompt
    try:
        _stream_reply(model, prompt, _sampling(args), _kv_dtype(args))
    except ChatTemplateError as e:  # the model file's template failed: one line naming it
        return fail("headwise generate", e)
    return 0


def run_chat(args) -> int:
    from ..models.chat_template import ChatTemplateError

    model = _load(args, "chat")
    if model is None:
        return 2
    if model.tokenizer.chat_template is None:
        return fail(
            "headwise chat", f"{args.model} has no chat template; use `headwise generate --raw` for plain continuation"
        )
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    # Ctrl-C must reach us even when the parent started us with SIGINT ignored (nohup, some test
    # runners, `cmd &` in a non-interactive shell): Python then never installs its handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(
        f"chat with {args.model}: Ctrl-C stops a reply (the conversation stays), /reset clears it; "
        "an empty line, Ctrl-C or Ctrl-D at the prompt quits",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        if line == "/reset":
            history = list(system)
            continue
        history.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        try:
            text, _ = _stream_reply(model, history, _sampling(args), _kv_dtype(args))
        except ChatTemplateError as e:
            return fail("headwise chat", e)
        history.append({"role": "assistant", "content": text})  # an interrupted reply stays, as it was shown


def run_embed(args) -> int:
    from ..models.embeddings import embed

    model = _load(args, "embed")
    if model is None:
        return 2
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


def _common(p, default_model: str, task: str):
    p.add_argument(
        "model",
        nargs="?",
        default=default_model,
        type=model_for(task),
        help="builtin name (see `headwise models`), checkpoint directory or .gguf file",
    )
    p.add_argument("--backend", default="auto", type=backend_name, help="attention backend (see `headwise backends`)")
    p.add_argument(
        "--weights",
        default="auto",
        type=weights_name,
        help="auto (default): a GGUF computed from its quantized blocks as stored; fp32 / bf16: dequantized; "
        "int8 / int4 (q8_0 / q4_1), q4_0, q5_0, q5_1, q4_k, q5_k, q6_k: quantized at load (a K-quant's rows "
        "that are not whole 256-value blocks take q5_0 / q5_1 / q8_0, as llama-quantize does); q4_k_m, q4_k_s, "
        "q5_k_m, q5_k_s: llama-quantize's mixes of those names (the head in Q6_K, V and down projections in more "
        "bits in some layers), the same blocks llama-quantize writes",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads, pinned (as HEADWISE_THREADS=N); default: the cores other processes leave free, "
        "looked at again every 0.25 s while decoding",
    )


def _kv_dtype(args) -> str | None:
    return None if args.kv_dtype == "auto" else args.kv_dtype


def _cache_args(p):
    p.add_argument(
        "--kv-dtype",
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
        default="auto",
        help="K/V cache: auto (16-bit for quantized weights -- bfloat16 with the AVX-512 kernels, float16 with "
        "AVX2 --, the model's fp32 otherwise), float32, bfloat16 / float16 (half the bytes, read as stored by "
        "the decode kernel), or int8 (+ an fp32 scale per token and head: 0.27x the bytes). Perplexity of "
        "each: docs/kv-cache.md",
    )


def _sampling_args(p):
    g = p.add_argument_group(SAMPLING_HELP)
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="most tokens in a reply")
    g.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="keep the k most likely tokens; 0 = off")
    g.add_argument("--top-p", type=probability, default=1.0, help="nucleus: smallest set with this probability")
    g.add_argument("--min-p", type=unit_interval, default=0.0, help="drop tokens below min_p * p_max")
    g.add_argument("--repetition-penalty", type=positive_float, default=1.0, help="1 = off")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")


def add_cli(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="stream a completion from a decoder model, then print tokens/s",
        description="Generate text with a decoder model; streams as it goes. A chat model's "
        "prompt goes through its chat template (one user message) unless --raw.",
        formatter_class=Formatter,
    )
    _common(p, "smollm2-135m-instruct", "chat")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--raw", action="store_true", help="plain continuation of the prompt, no chat template")
    p.add_argument("--chat-template", action="store_true", help="(the default now; kept for old scripts)")
    _cache_args(p)
    _sampling_args(p)
    p.set_defaults(func=run_generate)

    p = sub.add_parser(
        "chat",
        help="interactive streaming chat that keeps history",
        description="Chat in the terminal through the model's chat template. Ctrl-C stops a "
        "reply and keeps the conversation; Ctrl-C or Ctrl-D at the prompt quits.",
        formatter_class=Formatter,
    )
    _common(p, "smollm2-135m-instruct", "chat")
    p.add_argument("--system", default=None, help="system prompt")
    _cache_args(p)
    _sampling_args(p)
    p.set_defaults(func=run_chat)

    p = sub.add_parser(
        "embed",
        help="sentence embeddings and their cosine similarities",
        description="Embed texts with an encoder (mean pooling + L2 normalize).",
        formatter_class=Formatter,
    )
    _common(p, "all-minilm-l6-v2", "embed")
    p.add_argument("--text", action="append", required=True, help="a text to embed (repeatable)")
    p.set_defaults(func=run_embed)
