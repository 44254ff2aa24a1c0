"""`headwise serve [MODEL ...] [--config FILE] [--host HOST] [--port PORT] [--kv-memory SIZE] [--tensor-parallel N]
[--weights W] [--kv-dtype D] [--max-model-len N] [--max-num-seqs N] [--served-model-name NAME[,NAME...]]`.

MODEL: builtin names (`headwise models`), .gguf files or checkpoint directories, each
served under its own name; a chat model (decoder) answers /v1/chat/completions and
/v1/completions, an encoder /v1/embeddings. With neither MODEL nor --config:
smollm2-135m-instruct (chat, completions) and all-minilm-l6-v2 (embeddings) on
127.0.0.1:8000. --config FILE: a gateway TOML (examples/gateway.toml) for routes,
upstream providers and per-model limits. API keys: set HEADWISE_API_KEYS (comma-separated)
or [server] api_key_env / api_keys in the config; with none, the API is open.
SIGTERM: stop accepting, let in-flight requests finish (up to [server] drain_timeout),
stop the engines, exit 0. --tensor-parallel N: one MODEL's heads split over N processes on
this machine (this one serves, as rank 0, and starts the other N - 1; N must divide the
model's KV heads); in a config, `tensor_parallel = N` in the model's table.
--kv-memory SIZE: each chat model's KV pool in bytes (512MiB, 1GiB, 1GB = 10^9; default: 32k tokens,
at most a quarter of the free memory); its pages become resident as the pool fills. Once the models
have loaded, one line per chat model says what its pool holds ("KV pool: 32k tokens ...").
Per-model flags (cli/serve_flags.py; vLLM's names) apply to the MODEL arguments; with --config the
[models.NAME] keys say the same.
"""

from __future__ import annotations

import argparse
import os
import sys

from .serve_flags import add_model_flags, apply_model_flags


def add_cli(sub) -> None:
    import uvicorn  # noqa: F401  (fail here, so `headwise serve` says to install the extra)
    import argparse

    from .argtypes import model_for, positive_int

    p = sub.add_parser(
        "serve",
        help="serve models behind the OpenAI API (gateway over local engines and upstream providers)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        type=model_for(None),
        help="builtin name, .gguf file or checkpoint directory (default: the two builtin models)",
    )
    p.add_argument("--config", help="gateway TOML (see examples/gateway.toml), instead of MODEL arguments")
    p.add_argument("--host", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=_port, help="port (default 8000)")
    p.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the MODEL's heads over N processes on this machine: this one serves (rank 0) and starts "
        "N - 1 followers; each rank runs cores / N torch threads, fewer while other processes keep cores busy "
        "(HEADWISE_THREADS=N pins them); "
        "N must divide the model's KV heads. One MODEL; in a --config: tensor_parallel = N in its table",
    )
    p.add_argument(
        "--kv-memory",
        type=_kv_memory,
        metavar="SIZE",
        help="each chat model's KV pool, e.g. 512MiB, 1GiB or 1GB (10^9 bytes): EngineConfig.memory_budget_bytes; "
        "default: 32k tokens, at most a quarter of the free memory. A model's num_blocks in --config still wins",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch threads each model's steps run with, pinned (as HEADWISE_THREADS=N; with --tensor-parallel, "
        "per rank); default: the cores other processes leave free, looked at again every 0.25 s",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--self-check",
        action="store_true",
        help="once the models are ready, send one chat request (streamed) and one embeddings request "
        "through the server's own API and print the answers (what `make run` shows)",
    )
    add_model_flags(p)
    p.set_defaults(func=run)


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {text}")
    return int(text)


def _kv_memory(text: str) -> int:
    from ..serve.config import ConfigError, kv_memory_bytes

    try:
        return kv_memory_bytes(text, "")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(" = ")) from None


def kv_pool_line(engine, max_model_len: int | None = None) -> str:
    """What an engine's KV pool holds, from its resolved config and its pool: "KV pool: 32k tokens
    (up to 64 sequences, each up to 8,192 tokens), 0.75 GB bfloat16, allocated as it fills";
    max_model_len: a served model's cap ([models.NAME] max_model_len, --max-model-len), if lower."""
    c, info = engine.config, engine.core.pool_info()
    tokens = info["tokens"]
    count = f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"
    dtype = info.get("kv_dtype") or str(engine.cache.kv_dtype or engine.cache.dtype).removeprefix("torch.")
    return (
        f"KV pool: {count} tokens (up to {c.max_num_seqs} sequences, each up to {min(engine.max_model_len, max_model_len or 1 << 62):,} tokens), "
        f"{info['bytes'] / 1e9:.2f} GB {dtype}, allocated as it fills"
    )


def _print_pools(runtimes) -> None:
    """One line per chat model that loaded: its KV pool (`kv_pool_line`)."""
    for rt in runtimes:
        if rt.state == "ready" and rt.engine is not None:
            print(f"headwise serve: {rt.name}: {kv_pool_line(rt.engine, rt.max_model_len)}", flush=True)


def run(args) -> int:
    from .startup import PortError, before_exit, bind, exit_now, guard, server_class, stop_now

    guard()  # until uvicorn's handlers: a signal is one line and exit 0 / 130 (startup.py)
    if args.config and args.models:  # before the server's modules (and torch) import
        print(
            f"headwise serve: error: give MODEL arguments ({' '.join(args.models)}) or --config {args.config}, "
            "not both; list the models in the config's [models] tables instead",
            file=sys.stderr,
        )
        return 2
    import logging

    import uvicorn

    from ..serve.app import create_app
    from ..serve.config import ConfigError, default_config, load_config, models_config, with_kv_memory

    if args.threads is not None:  # pinned: the governor (core/governor.py) stays out, here and in followers
        from ..core.governor import ENV
        from ..runtime.threads import pin_threads

        os.environ[ENV] = str(args.threads)  # tensor-parallel followers are new processes: they read it
        pin_threads(args.threads)
    why = _tensor_parallel_usage(args)
    if why:
        print(f"headwise serve: error: {why}", file=sys.stderr)
        return 2
    try:
        if args.config:
            config = load_config(args.config, args.host, args.port)
        elif args.models:
            config = models_config(args.models, args.host, args.port, tensor_parallel=args.tensor_parallel)
        else:
            config = default_config(args.host, args.port)
        config = apply_model_flags(with_kv_memory(config, args.kv_memory), args)
    except ConfigError as e:
        print(f"headwise serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    try:
        app = create_app(config)
    except ConfigError as e:
        print(f"headwise serve: {e}", file=sys.stderr)
        return 2
    s, state = config.server, app.state.serve
    from ..serve.connections import ConnectionCaps
    from ..serve.timeouts import timed_h11

    try:
        caps = ConnectionCaps.of(s)  # [server] max_connections, max_connections_per_client
    except ConfigError as e:
        print(f"headwise serve: {e}", file=sys.stderr)
        return 2
    state.metrics.registry.register(caps)

    uv = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=s.drain_timeout,
        http=timed_h11(s.header_timeout, s.body_timeout, s.direct_streams, caps=caps),
        ws="none",  # headwise serves no WebSockets (an Upgrade is answered as plain HTTP)
    )
    try:  # before the banner and before any model loads: a busy port is this one line
        sock = bind(s.host, s.port, uv.backlog)
    except PortError as e:
        print(f"headwise serve: {e}", file=sys.stderr)
        return 2
    server = server_class()(uv, state)
    state.stop_server = lambda: _stop_when_started(server)  # every model failed
    state.on_loaded.append(_print_pools)
    before_exit(state.kill_followers)  # an exit without shutdown must not leave tensor-parallel ranks behind
    base = f"http://{'[' + s.host + ']' if ':' in s.host else s.host}:{s.port}"
    auth = " (API keys required: Authorization: Bearer <key>)" if s.keys() else ""
    print(
        f"headwise serve: {base}/v1 -> models {', '.join(config.model_names())}{auth}; "
        f"{base}/health turns 200 once they have loaded",
        flush=True,
    )
    if args.self_check:
        import threading

        logging.getLogger("httpx").addFilter(lambda record: record.threadName != "self-check")  # its own requests
        threading.Thread(
            target=_self_check, args=(base, config, s.keys(), state), daemon=True, name="self-check"
        ).start()
    server.run(sockets=[sock])
    guard("stopping")
    if server.stopped_loading is not None:  # requests in flight have drained; the loader may still run
        stop_now(server.stopped_loading, "loading")
    code = 0
    if state.fatal:
        print(f"headwise serve: {state.fatal}", file=sys.stderr, flush=True)
        code = 1
    elif not server.started:
        print("headwise serve: the server did not start (the log above says why)", file=sys.stderr, flush=True)
        code = 1
    if not state.load_done.is_set() or state.native_threads():
        exit_now(code)  # a thread that may be inside torch must not meet the interpreter's exit (startup.py)
    return code


def _tensor_parallel_usage(args) -> str | None:
    """What is wrong with --tensor-parallel N here, or None."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        return (
            f"WORLD_SIZE={world} is set (torchrun?): every rank would start a server of its own. Run one "
            "`headwise serve MODEL --tensor-parallel N`: it starts its N - 1 follower processes itself"
        )
    n = args.tensor_parallel
    if n == 1:
        return None
    if args.config:
        return (
            f"--tensor-parallel goes with a MODEL argument; in --config {args.config}, set "
            f"tensor_parallel = {n} in the model's [models.NAME] table"
        )
    if len(args.models) != 1:
        got = f"{len(args.models)} ({' '.join(args.models)})" if args.models else "none"
        return (
            f"--tensor-parallel {n} splits one MODEL, got {got}: e.g. `headwise serve smollm2-135m-instruct "
            "--tensor-parallel 3`; serve other models from another `headwise serve`"
        )
    return None


def _stop_when_started(server, wait_s: float = 30.0) -> None:
    """End uvicorn's loop (from the loader thread). A stop asked before startup has finished makes
    uvicorn return without its shutdown phase, and the cancelled lifespan logs a traceback: wait."""
    import time

    deadline = time.monotonic() + wait_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    server.should_exit = True


def _examples(base: str, chat_model: str | None, embed_model: str | None, key: bool) -> str:
    import importlib.util
    import shlex

    auth = ' -H "Authorization: Bearer $HEADWISE_API_KEY"' if key else ""
    lines = ["", "Try it (paste into another terminal):", ""]
    if chat_model:
        body = (
            '{"model": "%s", "messages": [{"role": "user", "content": "What is multi-head attention?"}], '
            '"max_tokens": 48, "temperature": 0}' % chat_model
        )
        lines += [f"curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\", f"  -d '{body}'", ""]
    api_key = "os.environ['HEADWISE_API_KEY']" if key else '"unused"'
    # this interpreter, not whatever `python` another terminal finds: it has headwise's environment
    if importlib.util.find_spec("openai") is None:
        lines += [f"{shlex.quote(sys.executable)} -m pip install openai    # the client the snippet below uses"]
    lines += [
        f"{shlex.quote(sys.executable)} - <<'EOF'",
        *(["import os"] if key else []),
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{base}/v1", api_key={api_key})',
    ]
    if chat_model:
        lines += [
            f'for chunk in client.chat.completions.create(model="{chat_model}", stream=True, max_tokens=48,',
            '        messages=[{"role": "user", "content": "Write a haiku about attention heads."}]):',
            '    print(chunk.choices[0].delta.content or "", end="", flush=True)',
            "print()",
        ]
    if embed_model:
        lines += [
            f'e = client.embeddings.create(model="{embed_model}", input=["a cat", "a kitten"]).data',
            "print(sum(a * b for a, b in zip(e[0].embedding, e[1].embedding)))   # cosine (normalized)",
        ]
    lines += ["EOF", ""]
    return "\n".join(lines)


def _wait_loaded(state) -> None:
    """Wait in-process until no local model is loading: polling /health would put one access-log
    line per poll between the banner and the answers."""
    import time

    while not state.fatal and not state.draining and any(rt.state == "loading" for rt in state.runtimes.values()):
        time.sleep(0.2)


def _task(config, name: str) -> str | None:
    """ "chat" or "embed" for a local model whose kind shows without loading it; None otherwise."""
    from ..models.sources import model_task

    model = config.models.get(name)
    return model_task(model.source) if model else None


def _self_check(base: str, config, keys, state=None) -> None:
    """Wait for /health (for `state`'s models in-process first), then use the API as a client would and
    print what came back."""
    import json
    import time

    import httpx

    if state is not None:
        _wait_loaded(state)
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    chat_model = embed_model = None
    with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                r = client.get("/health")
                if r.status_code == 200:
                    break
                if r.status_code == 503 and r.json().get("error", {}).get("code") in ("model_failed", "draining"):
                    print(f"headwise serve --self-check: {r.json()['error']['message']}", file=sys.stderr, flush=True)
                    return  # it will not get better: stop waiting
            except httpx.TransportError:
                pass
            except ValueError:  # not JSON: keep polling
                pass
            time.sleep(0.5)
        else:
            print("headwise serve --self-check: /health never turned 200", file=sys.stderr, flush=True)
            return
        models = [m["id"] for m in client.get("/v1/models").json()["data"] if m.get("status") != "failed"]
        kinds = {m: _task(config, m) or ("embed" if "minilm" in m.lower() else "chat") for m in models}
        chat_model = next((m for m in models if kinds[m] == "chat"), None)
        embed_model = next((m for m in models if kinds[m] == "embed"), None)
        if chat_model:
            question = "What is multi-head attention, in one sentence?"
            header = (
                f"\n[self-check] POST /v1/chat/completions (stream) model={chat_model}\nuser: {question}\n"
                "assistant: "
            )  # printed with the first piece: after the access-log line
            t0, first, last, n = time.perf_counter(), None, None, 0
            body = {
                "model": chat_model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 60,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        piece = choice["delta"].get("content") or ""
                        if piece:
                            last = time.perf_counter()
                            if first is None:
                                first = last
                                print(header, end="")
                            print(piece, end="", flush=True)
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            if first:
                # decode rate over the tokens after the first; none to speak of for a 1-token reply
                rate = f", then {(n - 1) / (last - first):.1f} tokens/s" if n >= 2 and last > first else ""
                print(f"\n[{n} tokens; first after {(first - t0) * 1e3:.0f} ms{rate}]", flush=True)
        if embed_model:
            texts = ["The bank approved the loan.", "The lender agreed to the credit.", "The river bank flooded."]
            data = client.post("/v1/embeddings", json={"model": embed_model, "input": texts}).json()["data"]
            vecs = [d["embedding"] for d in data]
            print(f"[self-check] POST /v1/embeddings model={embed_model}")
            for i in (1, 2):
                cos = sum(a * b for a, b in zip(vecs[0], vecs[i]))
                print(f"cosine({texts[0]!r}, {texts[i]!r}) = {cos:.3f}")
    print(_examples(base, chat_model, embed_model, bool(keys)), flush=True)
    print("Serving; Ctrl-C to stop.", flush=True)
