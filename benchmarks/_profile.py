"""decode.py's and engine.py's profiles: one decode step under torch.profiler (CPU), by op category."""

from __future__ import annotations

import statistics
import time

from _common import table
import torch
from _contenders import PROMPT_LEN, _cache_kwarg, _past, make_prompts
from headwise.cache import ContiguousKVCache


# ------------------------------------------------------------------ profiles
MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_mkl_linear",
    "mkldnn::_linear",
    "aten::mkldnn_linear",
    "aten::_addmm_activation",
    "aten::dot",
    "aten::mv",
    "mkldnn::_linear_pointwise",
    "mkl::_mkl_linear",
}
ATTN_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::_softmax",
    "aten::_safe_softmax",
}


def profile_step(name: str, setup, step, n: int = 8, timed: int = 30) -> dict:
    """Profile `n` decode steps (after `setup()`); also time `timed` steps without the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        state = setup()
        for _ in range(3):
            step(state)
        walls = []
        for _ in range(timed):
            t0 = time.perf_counter()
            step(state)
            walls.append(time.perf_counter() - t0)
        state = setup()  # back to 32 tokens of context
        step(state)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step(state)
    events = [e for e in prof.events() if e.device_type.name == "CPU" and not e.name.startswith("ProfilerStep")]
    ops = [e for e in events if "::" in e.name]
    top_level = [e for e in ops if e.cpu_parent is None or "::" not in e.cpu_parent.name]
    by_name: dict[str, list[float]] = {}
    for e in ops:
        by_name.setdefault(e.name, []).append(e.self_cpu_time_total)
    rows = sorted(((k, len(v) / n, sum(v) / n / 1e3) for k, v in by_name.items()), key=lambda r: -r[2])
    total_self = sum(r[2] for r in rows)
    cat = {
        "matmul": sum(r[2] for r in rows if r[0] in MATMUL_OPS),
        "attention": sum(r[2] for r in rows if r[0] in ATTN_OPS),
    }
    cat["other ops"] = total_self - cat["matmul"] - cat["attention"]
    wall = statistics.median(walls) * 1e3
    cat["outside ops (Python, dispatch)"] = max(0.0, wall - total_self)
    return {
        "name": name,
        "step_ms_unprofiled_median": wall,
        "step_ms_unprofiled_min": min(walls) * 1e3,
        "ops_per_step": len(ops) / n,
        "top_level_ops_per_step": len(top_level) / n,
        "self_ms_per_step": total_self,
        "categories_ms": cat,
        "top": [{"op": k, "calls": c, "self_ms": t} for k, t, c in ((r[0], r[2], r[1]) for r in rows[:15])],
        "note": "ms per step; self ms are measured under the profiler (inflated by its per-op cost); "
        "'outside ops' = unprofiled wall - profiled self time, so it underestimates Python time",
    }


def run_profiles(M: dict, log) -> list[dict]:
    cfg = M["hw"].config
    ids = make_prompts(1, cfg.vocab_size)
    kw = _cache_kwarg()
    out = []
    for name in ("hw",):
        model = M.get(name)
        if model is None:
            continue

        def hw_setup(model=model):
            cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, PROMPT_LEN + 64, cfg.head_dim)
            nxt = model(ids, cache=cache)[:, -1].argmax(-1)
            return {"cache": cache, "nxt": nxt}

        def hw_step(st, model=model):
            st["nxt"] = model(st["nxt"][:, None], cache=st["cache"])[:, -1].argmax(-1)

        out.append(profile_step("headwise", hw_setup, hw_step))
    for impl, m in M["hf"].items():

        def hf_setup(m=m):
            o = m(input_ids=ids, use_cache=True)
            return {"past": _past(o), "nxt": o.logits[:, -1].argmax(-1)}

        def hf_step(st, m=m):
            o = m(input_ids=st["nxt"][:, None], use_cache=True, **{kw: st["past"]})
            st["past"], st["nxt"] = _past(o), o.logits[:, -1].argmax(-1)

        out.append(profile_step(f"hf_{impl}", hf_setup, hf_step))
    log("  done profiles")
    return out


def profile_text(p) -> str:
    c = p["categories_ms"]
    head = (
        f"{p['name']}: step {p['step_ms_unprofiled_median']:.2f} ms unprofiled (min "
        f"{p['step_ms_unprofiled_min']:.2f}); {p['ops_per_step']:.0f} aten ops per step "
        f"({p['top_level_ops_per_step']:.0f} called from Python); profiled self time "
        f"{p['self_ms_per_step']:.2f} ms = matmul {c['matmul']:.2f} + attention {c['attention']:.2f} + "
        f"other ops {c['other ops']:.2f}; outside ops ~{c['outside ops (Python, dispatch)']:.2f} ms"
    )
    rows = [
        [t["op"], f"{t['calls']:.0f}", f"{t['self_ms']:.3f}", f"{100 * t['self_ms'] / p['self_ms_per_step']:.1f}%"]
        for t in p["top"]
    ]
    return head + "\n" + table(["op", "calls/step", "self ms/step", "of op time"], rows)
