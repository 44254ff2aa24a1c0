"""Two builds of the compiled kernels, side by side in one process, on a GGUF file's own quantized matmuls.

A kernel change that moves a DRAM-bound decode by a few percent is lost between two processes here (each
one's memory placement and the other VMs' traffic move a 7B-shaped step by 20%: 95 to 125 ms). So both
builds are loaded at once (each .so its own copy: `dlopen` keys on the path, so its globals are its own),
the model is loaded once, and every round runs each of its quantized linears (`kernels.quant.run_quant`,
in model order, `--rows` rows of x: 1 is a batch-1 decode step) through each build in turn, the order
rotated round by round (benchmarks/_common.py's time_interleaved). The outputs are checked equal.

Build the other one from a checkout of the commit to compare, then point at its .so:

    git worktree add /tmp/hw-base <commit> && (cd /tmp/hw-base && python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/kernel_builds.py --base /tmp/hw-base/headwise/kernels/_cpu_avx512*.so \\
        --gguf ~/.cache/headwise/synthetic/llama-C4096-L32-H32-32-F11008-q4_k_m.gguf --rounds 16

The variant this CPU runs (kernels.isa()) is compared; --base must be the same variant's file.

--set LABEL:NAME=VALUE calls a tuning setter of one build after the defaults (e.g. `--set
this:quant_prefetch_ahead=3072`; --base may be this build's own .so, so two prefetch distances run side
by side): prefetch_ahead, quant_prefetch_ahead, zmm_min_rows, quant_prefetch_nta.

--attention KEYS times a batch-1 step's attention alone instead: every layer's heads over KEYS keys of
their own K/V (the model's head counts and head_dim, K/V in generate()'s dtype; all layers' K/V together
exceed L3 for a 7B shape, as in a long decode), each build's `hw_decode_attention_seq` called through
ctypes, as the decoder stack calls it; the outputs are checked equal.

--decode N times whole decode steps instead (the model's forward, `decoder_stack` and all: attention,
norms, the K/V stores): each round each build prefills 8 tokens into a fresh cache (K/V stored as
generate() stores them) and decodes N tokens greedily; the tokens are checked equal.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import decode_rate  # noqa: E402  (its decode: 8-token prompt, K/V as generate() keeps them)
from _common import busy_and_steal, cpu_ticks, environment, loadavg, summarize, table, time_interleaved  # noqa: E402
import torch  # noqa: E402  (after _common: headwise first)

import headwise  # noqa: E402
from headwise import kernels  # noqa: E402
from headwise.kernels import quant  # noqa: E402
from headwise.kernels.attention import KV_KINDS  # noqa: E402  (kernels.h's KV_* of each dtype)
from headwise.kernels.cpu import TUNABLE, tune  # noqa: E402  (the setters kernels._ext calls, and their values)
from headwise.models.linear import QuantizedLinear  # noqa: E402
from headwise.runtime.config import kv_dtype_for  # noqa: E402


def attention_inputs(model, keys: int, g) -> tuple[list[tuple], torch.Tensor]:
    """Per layer (K, V) of (Hkv, keys, D) in generate()'s K/V dtype, and q (H, D)."""
    cfg = model.config
    dtype = getattr(torch, kv_dtype_for(None, model) or "float32")
    shape = (cfg.num_kv_heads, keys, cfg.head_dim)
    kv = [tuple(torch.randn(shape, generator=g).to(dtype) for _ in "kv") for _ in range(cfg.num_layers)]
    return kv, torch.randn(cfg.num_heads, cfg.head_dim, generator=g)


def seq_attention(lib):
    """A build's hw_decode_attention_seq (decode_attention.c), typed for ctypes."""
    f = lib.hw_decode_attention_seq
    P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    f.argtypes, f.restype = [P, P, P, P, P, P, L, L, L, L, L, L, F, P, L, ctypes.c_int], ctypes.c_int
    return f


def attend(f, kv, q, outs) -> None:
    """One batch-1 step's attention: every layer's heads through f (seq_attention)."""
    for (k, v), out in zip(kv, outs):
        Hkv, n, D = k.shape
        G = out.shape[0] // Hkv
        rc = f(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, out.data_ptr(), Hkv, G, D, n * D, D, n,
               D**-0.5, None, 1, KV_KINDS[k.dtype])  # fmt: skip
        if rc:
            raise RuntimeError(f"hw_decode_attention_seq returned {rc}")


def load_build(path: Path, name: str):
    """The extension at `path` as a module of its own, tuned as kernels._ext tunes the installed one."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    tune(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other build's _cpu_<isa>*.so")
    ap.add_argument("--gguf", default="smollm2", help="a GGUF file or builtin model (default smollm2)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (default 1: a batch-1 decode step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="LABEL:NAME=VALUE",
        help="a tuning setter for one build (base or this), e.g. this:quant_prefetch_ahead=3072",
    )
    ap.add_argument("--attention", type=int, default=0, metavar="KEYS", help="time the decode attention at KEYS keys")
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="time N-token greedy decodes, not the linears")
    ap.add_argument("--out", type=Path, default=None, help="save <out>.txt / .json")
    args = ap.parse_args(argv)
    isa = kernels.isa()
    if isa is None:
        ap.error(f"no compiled kernels run here: {kernels.kernels_unavailable()}")
    if not args.base.is_file():
        ap.error(f"--base {args.base}: no such file (build it: see --help)")
    here = Path(kernels._ext()[0].__file__)
    name = f"_cpu_{isa}"  # the module's init function is PyInit_<name>: both copies keep it
    if not args.base.name.startswith(name):
        ap.error(f"--base {args.base.name} is not the {isa} variant this CPU runs ({here.name})")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds, libs = {}, {}
        for label, src in (("base", args.base), ("this", here)):
            (Path(tmp) / label).mkdir()
            copy = Path(tmp) / label / here.name
            shutil.copyfile(src, copy)
            builds[label] = load_build(copy, name)
            libs[label] = seq_attention(ctypes.CDLL(str(copy)))  # the same loaded copy's C symbol
        for item in args.set:
            label, _, rest = item.partition(":")
            setter, _, value = rest.partition("=")
            if label not in builds or setter not in TUNABLE or not value.isdigit():
                ap.error(f"--set {item}: give base|this:<{'|'.join(TUNABLE)}>=<integer>")
            getattr(builds[label], setter)(int(value))
        current = [builds["this"]]
        for mod in [m for n, m in sys.modules.items() if n.startswith("headwise") and hasattr(m, "_ext")]:
            mod._ext = lambda: (current[0], None)  # every kernel call goes to the build of the moment
        model = headwise.load(args.gguf)
        plans = [m.kernel_plan() for m in model.modules() if isinstance(m, QuantizedLinear)]
        if not plans:
            ap.error(f"{args.gguf} has no quantized linears (an fp32 file?)")
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(args.rows, p.in_features, generator=g) for p in plans]
        outs, per_token = {}, {label: [] for label in builds}
        kv, q = attention_inputs(model, args.attention, g) if args.attention else ([], None)

        def run(label):
            def step():
                current[0] = builds[label]
                outs[label] = [quant.run_quant(p, x) for p, x in zip(plans, xs)]

            def decode():
                current[0] = builds[label]
                rate, tokens = decode_rate(model, args.decode, model.config.vocab_size)  # quantized.py's
                outs[label] = [torch.tensor(tokens)]
                per_token[label].append(1 / rate)

            def attention():
                attend(libs[label], kv, q, outs.setdefault(label, [torch.empty_like(q) for _ in kv]))

            return attention if args.attention else decode if args.decode else step

        env, load0, ticks0 = environment(), loadavg(), cpu_ticks()
        with torch.inference_mode():
            times, rounds = time_interleaved({label: run(label) for label in builds}, rounds=args.rounds)
        same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["this"]))
    MiB = sum(p.blocks.numel() for p in plans) / 2**20
    fmts = sorted({p.fmt for p in plans})
    what = f"{args.rows} row(s) of x"
    if args.attention:
        what = f"decode attention over {args.attention} keys, {len(kv)} layers' K/V ({kv[0][0].dtype}), a step's ms"
        MiB = sum(t.numel() * t.element_size() for pair in kv for t in pair) / 2**20  # what the GB/s count
    if args.decode:
        what = (
            f"{args.decode}-token greedy decodes after 8 (K/V {kv_dtype_for(None, model) or 'float32'}), a token's ms"
        )
        times = {label: t[-rounds:] for label, t in per_token.items()}  # the decode alone, not the prefill
    lines = [
        f"kernel builds on {Path(str(args.gguf)).name}'s {len(plans)} quantized linears ({', '.join(fmts)}, "
        f"{MiB:.0f} MiB), {what}, {args.threads} threads, {rounds} rounds; {env['date']}",
        f"{env['cpu_model']}, kernels {isa}; base {args.base}" + "".join(f"; {x}" for x in args.set),
        f"load {load0} -> {loadavg()}, {busy_and_steal(ticks0, cpu_ticks())}",
    ]
    rows, res = [], {}
    for label, t in times.items():
        s = summarize([x * 1e3 for x in t])
        paired = statistics.median(b / x for b, x in zip(times["base"], t))
        res[label] = {"ms": s, "paired_speedup_vs_base": paired, "GB_s_median": MiB * 2**20 / s["median"] / 1e6}
        rows.append([label, f"{s['min']:.1f}", f"{s['median']:.1f}", f"{s['max']:.1f}",
                     f"{res[label]['GB_s_median']:.1f}", f"{paired:.3f}x"])  # fmt: skip
    lines.append(table(["build", "min ms", "median", "max", "GB/s (median)", "speedup vs base (paired)"], rows))
    lines.append(f"outputs equal: {same}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "results": res}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
