"""Evaluate xgrammar vs llguidance on this CPU with SmolLM2's tokenizer."""

import json, time, statistics, os
import torch
import numpy as np


def apply_mask(logits, bm):  # the same apply for both libraries (headwise/runtime/grammar.py's)
    a = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    logits.masked_fill_(~torch.from_numpy(a).bool(), float("-inf"))


import headwise

torch.set_num_threads(2)
tok = headwise.load("smollm2").tokenizer
V = 49152
EOS = tok.backend.token_to_id(tok.eos_token)
schemas = json.load(open("tests/fixtures/schemas/schemas.json"))
probes = {  # features beyond the fixture set
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "not": {"not": {"type": "string"}},
    "if_then": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "minProperties": {"type": "object", "minProperties": 2},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "format_hostname": {"type": "string", "format": "hostname"},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "remote_ref": {"$ref": "https://example.com/s.json"},
}


def med(xs):
    return statistics.median(xs)


res = {}
# ---------------- llguidance
import llguidance as llg, llguidance.torch as lt

t0 = time.perf_counter()
ltok = llg.LLTokenizer(tok.backend.to_str(), eos_token=EOS)
t_tok = time.perf_counter() - t0


def llg_compile(s):
    g = llg.LLMatcher.grammar_from_json_schema(s)
    m = llg.LLMatcher(ltok, g, log_level=0)
    if m.is_error():
        raise ValueError(m.get_error())
    return g, m


# ---------------- xgrammar
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

t0 = time.perf_counter()
ti = xgr.TokenizerInfo.from_huggingface(
    PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token), vocab_size=V, stop_token_ids=[EOS]
)
comp = xgr.GrammarCompiler(ti, max_threads=2, cache_enabled=False)
x_tok = time.perf_counter() - t0


def xgr_compile(s):
    cg = comp.compile_json_schema(json.dumps(s))
    return cg, xgr.GrammarMatcher(cg)


def coverage(fn):
    out = {}
    for n, s in probes.items():
        try:
            fn(s)
            out[n] = "accepted"
        except Exception as e:
            out[n] = "error: " + str(e).splitlines()[0][:100]
    return out


def compile_times(fn):
    ts = []
    fails = []
    for item in schemas:
        t0 = time.perf_counter()
        try:
            fn(item["schema"])
        except Exception as e:
            fails.append((item["name"], str(e)[:120]))
            continue
        ts.append(time.perf_counter() - t0)
    return ts, fails


def walk_llg(batch, steps=32):
    ms = [llg_compile(schemas[i % len(schemas)]["schema"])[1] for i in range(batch)]
    ex = llg.LLExecutor()
    bm = lt.allocate_token_bitmask(batch, V)
    g = torch.Generator().manual_seed(0)
    ts = []
    for _ in range(steps):
        live = [i for i, m in enumerate(ms) if not m.is_stopped() and not m.is_error()]
        if not live:
            break
        logits = torch.randn(batch, V, generator=g)
        t0 = time.perf_counter()
        if batch == 1:
            lt.fill_next_token_bitmask(ms[0], bm, 0)
        else:
            lt.fill_next_token_bitmask_par(ex, [(ms[i], i) for i in live], bm)
        ts.append((time.perf_counter() - t0) / len(live))  # the fill alone: the apply below is the same code for both
        apply_mask(logits, bm)
        toks = logits.argmax(-1).tolist()
        for i in live:
            ms[i].consume_token(toks[i])
    return ts


def walk_xgr(batch, steps=32):
    ms = [xgr_compile(schemas[i % len(schemas)]["schema"])[1] for i in range(batch)]
    bm = xgr.allocate_token_bitmask(batch, V)
    g = torch.Generator().manual_seed(0)
    bmm = xgr.BatchGrammarMatcher(max_threads=2)
    ts = []
    for _ in range(steps):
        live = [i for i, m in enumerate(ms) if not m.is_terminated()]
        if not live:
            break
        logits = torch.randn(batch, V, generator=g)
        t0 = time.perf_counter()
        if batch == 1:
            ms[0].fill_next_token_bitmask(bm, 0)
        else:
            bmm.batch_fill_next_token_bitmask([ms[i] for i in live], bm, indices=live)
        ts.append((time.perf_counter() - t0) / len(live))  # the fill alone: the apply below is the same code for both
        apply_mask(logits, bm)
        toks = logits.argmax(-1).tolist()
        for i in live:
            ms[i].accept_token(toks[i])
    return ts


for name, comp_fn, walk in (("llguidance", llg_compile, walk_llg), ("xgrammar", xgr_compile, walk_xgr)):
    walk(1, 8)
    walk(16, 8)  # warm (torch.compile in llguidance.torch, thread pools)
    ts, fails = compile_times(comp_fn)
    w1 = walk(1)
    w16 = walk(16)
    res[name] = dict(
        compile_ms_median=1e3 * med(ts),
        compile_ms_max=1e3 * max(ts),
        compiled=len(ts),
        failed=fails,
        mask_us_per_token_b1_median=1e6 * med(w1),
        mask_us_per_token_b1_max=1e6 * max(w1),
        mask_us_per_token_b16_median=1e6 * med(w16),
        mask_us_per_token_b16_max=1e6 * max(w16),
        probes=coverage(comp_fn),
    )
res["tokenizer_setup_s"] = {"llguidance": t_tok, "xgrammar": x_tok}
cpu = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
res["cpu"] = cpu
res["threads"] = torch.get_num_threads()
res["loadavg"] = os.getloadavg()
print(json.dumps(res, indent=1))
