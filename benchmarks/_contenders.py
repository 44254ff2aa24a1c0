"""What benchmarks/decode.py times: the models (headwise and its transformers twins on the same
fp32 tensors), each contender as a function returning its times and token ids, the matmul floors
and the copy bandwidth that bound them, and the greedy-agreement check run before timing.
See decode.py's docstring for what each contender is and how its decode span is measured.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout of headwise

import _common  # noqa: E402,F401  (headwise before torch: its OpenMP wait policy)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import headwise  # noqa: E402
import headwise.models.blocks as blocks  # noqa: E402
import headwise.models.llama as llama_mod  # noqa: E402
from headwise import kernels  # noqa: E402
from headwise.cache import ContiguousKVCache  # noqa: E402
from headwise.models.packing import PACK_HINT  # noqa: E402  (the library's oneDNN batch-size hint)

MODEL = "smollm2-135m-instruct"
PROMPT_LEN = 32
HF_IMPLS = ("sdpa", "eager")
TIE_TOL = 1e-3  # |logit difference| under which a greedy divergence is a near-tie (fp32 noise ~1e-4)
BW_MIB = 512
MIB = 2**20
SEED = 1234


# ------------------------------------------------------------------ models
def load_models():
    import transformers
    from transformers import LlamaForCausalLM
    from headwise.models.builtin import resolve
    from headwise.models.gguf import read_gguf

    transformers.logging.set_verbosity_error()
    model = headwise.load(MODEL, weights="fp32")  # the GGUF dequantized: fp32 against fp32 (quantized.py: as stored)
    if next(model.parameters()).dtype != torch.float32:
        model = model.float()
    hf_config, tensors, _ = read_gguf(resolve(MODEL))
    base = transformers.LlamaConfig(**{k: v for k, v in hf_config.items() if k not in ("gguf", "_name_or_path")})
    hf = {}
    for impl in HF_IMPLS:
        config = copy.deepcopy(base)
        config._attn_implementation = impl
        m = LlamaForCausalLM(config).eval()
        res = m.load_state_dict(tensors, strict=False)
        if res.unexpected_keys or set(res.missing_keys) - {"lm_head.weight"}:
            sys.exit(f"HF {impl}: state dict mismatch: {res}")
        m.tie_weights()
        if m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr():
            sys.exit(f"HF {impl}: lm_head is not tied to embed_tokens after tie_weights()")
        if m.config._attn_implementation != impl:
            sys.exit(f"HF model asked for attention {impl!r} runs {m.config._attn_implementation!r}")
        hf[impl] = m
    del tensors
    gc.collect()
    return model, hf, transformers.__version__


def model_bytes(model) -> dict:
    cfg = model.config
    params = {p.data_ptr(): p for p in model.parameters()}  # tied weights once
    weight = sum(p.numel() * p.element_size() for p in params.values())
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    return {
        "params": sum(p.numel() for p in params.values()),
        "weight_bytes": weight,
        "output_layer_bytes": cfg.vocab_size * cfg.d_model * 4,
        "kv_bytes_per_token": kv_per_token,
    }


# ------------------------------------------------------------------ plain linears (diagnostic)
def unpacked_model():
    """The same model with plain nn.Linear (headwise.load(..., pack=False)): what packing buys."""
    model = headwise.load(MODEL, weights="fp32", pack=False)
    return model if next(model.parameters()).dtype == torch.float32 else model.float()


def make_prompts(B: int, V: int, T: int = PROMPT_LEN, seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + B)
    return torch.randint(17, V, (B, T), generator=g)  # ids < 17 are special tokens


# ------------------------------------------------------------------ contenders
@contextlib.contextmanager
def switched_off(part: str | None):
    """part: "few_rows" (the decoder block's few-rows route) or "kernel" (headwise.kernels), off for the block.

    The few-rows route is off with blocks.ROUTE_ROWS = 0; a checkout from before issue 13 has no
    ROUTE_ROWS but a second forward, models/fast_decode.py, gated by llama.fast_decode_applies."""
    saved_kernel = kernels.kernels_unavailable
    if hasattr(blocks, "ROUTE_ROWS"):
        owner, name, off = blocks, "ROUTE_ROWS", 0
    else:
        owner, name, off = llama_mod, "fast_decode_applies", lambda *a: False
    saved_route = getattr(owner, name)
    if part == "few_rows":
        setattr(owner, name, off)
    elif part == "kernel":
        kernels.kernels_unavailable = lambda: "switched off by the benchmark"
    try:
        yield
    finally:
        setattr(owner, name, saved_route)
        kernels.kernels_unavailable = saved_kernel


def hw_generate(model, ids: torch.Tensor, new: int, compile: bool = False, off: str | None = None) -> dict:
    prompts = ids.tolist()
    t0 = time.perf_counter()
    with switched_off(off):
        res = headwise.generate(
            model,
            prompts[0] if len(prompts) == 1 else prompts,
            max_new_tokens=new,
            temperature=0,
            ignore_eos=True,
            compile=compile,
        )
    wall = time.perf_counter() - t0
    res = [res] if not isinstance(res, list) else res
    return {
        "prefill_s": res[0].prefill_seconds,
        "decode_s": res[0].decode_seconds,
        "wall_s": wall,
        "ids": [r.token_ids for r in res],
    }


def hw_loop(model, ids: torch.Tensor, new: int) -> dict:
    cfg = model.config
    B, T = ids.shape
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = ContiguousKVCache(cfg.num_layers, B, cfg.num_kv_heads, T + new, cfg.head_dim)
        nxt = model(ids, cache=cache)[:, -1].argmax(-1)  # (B,)
        t1 = time.perf_counter()
        toks = [nxt]
        for _ in range(new - 1):
            nxt = model(nxt[:, None], cache=cache)[:, -1].argmax(-1)
            toks.append(nxt)
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "wall_s": t2 - t0, "ids": torch.stack(toks, 1).tolist()}


def hf_generate(hf, ids: torch.Tensor, new: int) -> dict:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "ids": out[:, ids.shape[1] :].tolist()}


def _cache_kwarg() -> str:
    """transformers >= 5.24 calls forward's past_key_values `cache` (the old name warns)."""
    import inspect
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _past(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def hf_loop(hf, ids: torch.Tensor, new: int) -> dict:
    kw = _cache_kwarg()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)  # (B,)
        t1 = time.perf_counter()
        toks = [nxt]
        for _ in range(new - 1):
            out = hf(input_ids=nxt[:, None], use_cache=True, **{kw: _past(out)})
            nxt = out.logits[:, -1].argmax(-1)
            toks.append(nxt)
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "wall_s": t2 - t0, "ids": torch.stack(toks, 1).tolist()}


def floor_weights(model, packed: bool = False, kernel: bool = False):
    """[(linear fn, out features) x 4 per layer], output layer: the model's matmuls, bare."""

    def fn(lin):
        if kernel:
            blocked, out = kernels.block_weight(lin.weight), lin.out_features
            return lambda x: kernels.small_linear(x, blocked, out)
        if packed:
            p = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), PACK_HINT)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
        w = lin.weight
        return lambda x: F.linear(x, w)

    layers = [(fn(l.attn.qkv_proj), fn(l.attn.out_proj), fn(l.mlp.gate_up), fn(l.mlp.down)) for l in model.layers]
    cfg = model.config
    return layers, fn(model.lm_head), (cfg.num_heads * cfg.head_dim, cfg.d_ff)


def floor_forward(weights, x):
    """x (B, T, C): qkv -> (the Q part) o -> gate_up -> (the gate part) down, per layer; then the output layer."""
    layers, head, (Q, F_) = weights
    h = x
    for qkv, o, gate_up, down in layers:
        h = o(qkv(h)[..., :Q].contiguous())
        h = down(gate_up(h)[..., :F_].contiguous())
    return head(h)


def floor_steps(weights, B: int, C: int, steps: int) -> dict:
    """Only the weight matmuls of `steps` one-token forwards (shapes as in the model)."""
    x = torch.randn(B, 1, C)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(steps):
            floor_forward(weights, x)
        t1 = time.perf_counter()
    return {"decode_s": t1 - t0, "wall_s": t1 - t0}


# ------------------------------------------------------------------ agreement
def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain_divergence(model, prompt: list[int], ref: list[int], other: list[int], i: int, eos: set[int]) -> dict:
    """Why `other` left `ref` at step i: EOS (hf.generate forbids it before min_new_tokens),
    a near-tie of the two candidates' logits (headwise's logits), or a real disagreement."""
    a, b = ref[i], other[i]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:i]]))[0, -1]
    gap = (logits[a] - logits[b]).abs().item()
    kind = "eos" if (a in eos) != (b in eos) else "near-tie" if gap < TIE_TOL else "DISAGREE"
    return {"step": i, "ref_token": a, "other_token": b, "logit_gap": gap, "kind": kind}


def check_agreement(model, ids: torch.Tensor, outputs: dict[str, list[list[int]]], log) -> dict:
    """outputs: {contender: ids per sequence}; reference = hw_generate. Exits on an unexplained divergence."""
    eos = set(model.config.eos_token_ids)
    ref = outputs["hw_generate"]
    report = {}
    for name, got in outputs.items():
        if name == "hw_generate":
            continue
        rows = []
        for b, (r, o) in enumerate(zip(ref, got)):
            i = first_divergence(r, o)
            if i is not None:
                rows.append({"row": b, **explain_divergence(model, ids[b].tolist(), r, o, i, eos)})
        report[name] = {"identical_rows": len(ref) - len(rows), "rows": len(ref), "divergences": rows}
        bad = [d for d in rows if d["kind"] == "DISAGREE"]
        if bad and name != "hw_compiled":  # inductor reorders float sums: reported, never fatal
            sys.exit(f"{name} disagrees with headwise's greedy tokens beyond noise: {bad}; refusing to time")
    parts = [
        f"{n} {r['identical_rows']}/{r['rows']} identical"
        + "".join(
            f" (row {d['row']}: step {d['step']} {d['kind']}, gap {d['logit_gap']:.1e})" for d in r["divergences"]
        )
        for n, r in report.items()
    ]
    log(f"  greedy ids vs hw_generate, B={len(ref)}: " + "; ".join(parts))
    return report


# ------------------------------------------------------------------ bandwidth
def copy_bandwidth(mib: int = BW_MIB, reps: int = 5) -> list[float]:
    """GB/s of dst.copy_(src) for `mib` MiB, counting bytes read + written."""
    n = mib * MIB // 4
    src, dst = torch.ones(n), torch.zeros(n)
    dst.copy_(src)  # fault the pages in
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(2 * mib * MIB / (time.perf_counter() - t0) / 1e9)
    del src, dst
    gc.collect()
    return out


# ------------------------------------------------------------------ compile
def try_compile(model, B: int, new: int, log) -> dict:
    """First headwise.generate(compile=True) call at batch B (it compiles) and a second one.
    Returns info with both times, or why compiling failed here."""
    info = {"how": "headwise.generate(..., compile=True)", "B": B}
    ids = make_prompts(B, model.config.vocab_size)
    try:
        t0 = time.perf_counter()
        first = hw_generate(model, ids, new, compile=True)
        info["first_call_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        second = hw_generate(model, ids, new, compile=True)
        info["second_call_s"] = time.perf_counter() - t0
        info["ids_equal_first_second"] = first["ids"] == second["ids"]
        log(
            f"  compiled B={B}: first generate {info['first_call_s']:.1f} s (compiles), second "
            f"{info['second_call_s']:.1f} s"
        )
    except Exception as e:  # report, never fail the benchmark on it
        info["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"  compiled: skipped - {info['skipped']}")
    return info
