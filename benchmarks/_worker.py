"""A headwise.generate process driven over stdin/stdout, for compare_commits.py and serving.py.

    python benchmarks/_worker.py CHECKOUT THREADS      (THREADS 0: torch's default)

imports headwise from CHECKOUT (not from this repository), loads SmolLM2 once, then answers
one JSON line per JSON-line command until stdin closes:
  {"op": "info"}                          -> where headwise came from, torch, threads, wait policy
  {"op": "decode", "prompts": [[ids]], "new": N}
                                          -> generate(..., greedy, ignore_eos): decode tok/s
                                             (sum of GenerationResult.tokens_per_second) and the ids
  {"op": "prefill", "prompt": [ids]}      -> one model(ids, cache=fresh ContiguousKVCache) forward,
                                             timed: prompt tokens / s
  {"op": "gap", "prompt": [ids], "a": i, "b": j}
                                          -> last-position logit[a] - logit[b] (explains a divergence)
Every reply is {"ok": true, ...} or {"ok": false, "error": traceback}. The file lives in
this repository, not in the checkout, so old commits are driven by the same code; it uses
only APIs the commit before issue 13 already had (load, generate, ContiguousKVCache,
model(ids, cache=...)). `Worker` is the parent's handle on one such process.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

MODEL = "smollm2-135m-instruct"


class Worker:
    """The parent's side: start a worker on `checkout`; ask() sends a command and waits for its reply.
    A failed command or a dead worker ends the benchmark with the worker's message (its stderr: log)."""

    def __init__(self, name: str, checkout: str | Path, threads: int, log: Path, env: dict[str, str]):
        self.name = name
        self.stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(checkout), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
            env=env,
        )
        self.read()  # {"ready": true} once the model is loaded

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"the {self.name} worker exited (rc {self.proc.poll()}); see {self.stderr.name}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            sys.exit(f"the {self.name} worker failed:\n{reply['error']}")
        return reply

    def ask(self, op: str, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        return self.read()

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the worker's loop ends at EOF
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def main(checkout: str, threads: int) -> None:
    # The protocol owns the real stdout; anything else printed (by us, torch or C code) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    sys.path.insert(0, checkout)
    if threads > 0:  # a fixed count on both sides: checkouts with the thread governor (issue 42) read it at import
        os.environ["HEADWISE_THREADS"] = str(threads)
    import headwise  # before torch: the checkout's own wait-policy code runs first
    import torch
    from headwise.cache import ContiguousKVCache

    if threads > 0:
        torch.set_num_threads(threads)
    # fp32 by default: checkouts from before issue 14 dequantize the GGUF; later ones keep it
    # quantized unless asked, and compare_commits compares the forward, not the weight format.
    # HW_WORKER_WEIGHTS=auto: what `headwise serve` loads (serving.py's like-for-like generate()).
    if "weights" in inspect.signature(headwise.load).parameters:
        model = headwise.load(MODEL, weights=os.environ.get("HW_WORKER_WEIGHTS", "fp32"))
    else:
        model = headwise.load(MODEL)
    cfg = model.config

    def _kernels() -> str:
        """Which compiled kernels this checkout runs, or why none (an older commit may have none)."""
        try:
            from headwise import kernels
        except ImportError:
            return "none (no headwise.kernels in this checkout)"
        if not hasattr(kernels, "kernels_unavailable"):
            return "unknown (no kernels_unavailable() in this checkout)"
        why = kernels.kernels_unavailable()
        if why is not None:
            return f"none ({why})"
        return kernels.isa() if hasattr(kernels, "isa") else "yes (compiled at first use)"

    def info(_):
        return {
            "headwise": headwise.__file__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "wait_env": {k: os.environ.get(k) for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")},
            "vocab_size": cfg.vocab_size,
            "dtype": str(next(model.parameters()).dtype),
            "kernels": _kernels(),
            "weights": os.environ.get("HW_WORKER_WEIGHTS", "fp32"),
        }

    def decode(cmd):
        prompts = cmd["prompts"]
        res = headwise.generate(
            model,
            prompts[0] if len(prompts) == 1 else prompts,
            max_new_tokens=cmd["new"],
            temperature=0,
            ignore_eos=True,
        )
        res = res if isinstance(res, list) else [res]
        # batched: every row shares one decode time, so the rows' rates add up to the batch's
        return {
            "tok_s": sum(r.tokens_per_second for r in res),
            "ids": [r.token_ids for r in res],
            "decode_s": res[0].decode_seconds,
            "prefill_s": res[0].prefill_seconds,
        }

    def prefill(cmd):
        ids = torch.tensor([cmd["prompt"]])  # (1, T)
        T = ids.shape[1]
        with torch.inference_mode():
            cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, T, cfg.head_dim)
            t0 = time.perf_counter()
            model(ids, cache=cache)
            dt = time.perf_counter() - t0
        return {"tok_s": T / dt, "seconds": dt}

    def gap(cmd):
        with torch.inference_mode():
            logits = model(torch.tensor([cmd["prompt"]]))[0, -1]  # (V,)
        return {"gap": float(logits[cmd["a"]] - logits[cmd["b"]])}

    ops = {"info": info, "decode": decode, "prefill": prefill, "gap": gap}
    proto.write(json.dumps({"ok": True, "ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = {"ok": True, **ops[cmd["op"]](cmd)}
        except Exception:  # the parent reports it; the worker stays up
            reply = {"ok": False, "error": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: _worker.py CHECKOUT THREADS")
    main(sys.argv[1], int(sys.argv[2]))
