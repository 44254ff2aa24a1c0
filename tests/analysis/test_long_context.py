"""Per-head statistics at long context (issue 16, item 1): the tiled kernel against the math
backend's full weights, the analysis against roles.py on full patterns, and the peak memory
at T = 16384 in a fresh process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise.analysis.attribution import HintAccumulator, value_norms
from headwise.analysis.capture import from_ids
from headwise.analysis.hooks import attention_layers
from headwise.analysis.long_context import key_norms, long_context_stats
from headwise.analysis.roles import head_roles
from headwise.attention import attend
from headwise.attention.backends.head_stats import attention_stats
from headwise.cli import main
from headwise.core.config import ModelConfig
from headwise.models.llama import Llama

STATS = (
    "visible entropy max_weight sink_mass local_mass distance sink_distance visible_sinks spread "
    "offsets offsets_visible top_norm_share sink_norm_share"
).split()


def reference(q, k, norms, *, sinks, local, K, **masks):
    """Every statistic straight from the (B, H, T, S) weights of backend='math', in float64;
    visibility from the mask arguments with plain comparisons."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    w = attend(q, k, k, backend="math", need_weights=True, **masks).weights.double()
    pos = torch.arange(S - T, S)[:, None]  # bottom-right aligned query positions
    j = torch.arange(S)[None]
    rel, dist = pos - j, (pos - j).abs().double()
    vis = torch.ones(B, H, T, S, dtype=torch.bool)
    if masks.get("is_causal"):
        vis &= rel >= 0
    if masks.get("window") is not None:
        left, right = masks["window"]
        vis &= (rel <= left) & (rel >= -right)
    if masks.get("key_padding_mask") is not None:
        vis &= ~masks["key_padding_mask"][:, None, None, :]
    m = masks.get("attn_mask")
    if m is not None:
        vis &= m if m.dtype == torch.bool else torch.isfinite(m)
    contrib = w * norms.double()[:, :, None, :]
    budget = contrib.sum(-1).clamp_min(1e-30)
    at = [(j - pos) == o for o in range(-K, K + 1)]
    return {
        "visible": vis.sum(-1),
        "entropy": -torch.xlogy(w, w).sum(-1),
        "max_weight": w.amax(-1),
        "sink_mass": w[..., :sinks].sum(-1),
        "local_mass": (w * (dist <= local)).sum(-1),
        "distance": (w * dist).sum(-1),
        "sink_distance": (w[..., :sinks] * dist[:, :sinks]).sum(-1),
        "visible_sinks": vis[..., :sinks].sum(-1),
        "spread": (vis[..., sinks:] * dist[:, sinks:]).sum(-1),
        "offsets": torch.stack([(w * a).sum(-1) for a in at], -1),
        "offsets_visible": torch.stack([(vis & a).sum(-1) for a in at], -1),
        "top_norm_share": contrib.gather(-1, w.argmax(-1, keepdim=True))[..., 0] / budget,
        "sink_norm_share": contrib[..., :sinks].sum(-1) / budget,
    }


@st.composite
def cases(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    T = draw(st.integers(1, 120))
    S = draw(st.integers(max(1, T - 20), 160))  # S < T too: early causal rows see nothing
    kind = draw(st.sampled_from(["none", "causal", "padding", "window", "causal_window", "bool", "float", "alibi"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    masks = {}
    if kind in ("causal", "padding", "causal_window", "alibi"):
        masks["is_causal"] = True
    if kind == "padding":  # right padding of a different length per row, and a fully padded row's keys
        lengths = torch.randint(0, S + 1, (B,), generator=g)
        masks["key_padding_mask"] = torch.arange(S)[None] >= lengths[:, None]
    if kind in ("window", "causal_window"):
        masks["window"] = (draw(st.integers(0, 12)), 0 if kind == "causal_window" else draw(st.integers(0, 12)))
    if kind == "bool":
        masks["attn_mask"] = torch.rand(B, 1, T, S, generator=g) > 0.4
    if kind == "float":
        m = torch.randn(1, Hkv * G, T, S, generator=g)
        masks["attn_mask"] = m.masked_fill(torch.rand(m.shape, generator=g) > 0.7, float("-inf"))
    if kind == "alibi":
        masks["alibi_slopes"] = torch.rand(Hkv * G, generator=g)

    def block(n):  # tiles that do not divide the length
        b = draw(st.integers(5, 48))
        return b + 1 if n > b and n % b == 0 else b

    shape = dict(B=B, H=Hkv * G, Hkv=Hkv, T=T, S=S, D=draw(st.sampled_from([4, 8])))
    return shape, masks, block(T), block(S), draw(st.sampled_from([None, "chunked", "sdpa"])), g


@settings(max_examples=30, deadline=None)
@given(cases(), st.integers(0, 6), st.integers(0, 20))
def test_kernel_statistics_equal_those_of_the_math_backends_weights(case, sinks, local):
    shape, masks, block_q, block_k, lse_from, g = case
    B, H, Hkv, T, S, D = (shape[n] for n in "B H Hkv T S D".split())
    q = torch.randn(B, H, T, D, generator=g) * 1.5
    k = torch.randn(B, Hkv, S, D, generator=g) * 1.5
    norms = torch.rand(B, H, S, generator=g) + 0.1
    lse = None  # the kernel's own first pass, or the LSE of a fused forward
    if lse_from is not None:
        lse = attend(q, k, k, backend=lse_from, return_lse=True, **masks).lse
    got = attention_stats(
        q, k, lse=lse, key_norms=norms, sinks=sinks, local=local, offsets=4, block_q=block_q, block_k=block_k, **masks
    )
    ref = reference(q, k, norms, sinks=sinks, local=local, K=4, **masks)
    for name in STATS:
        torch.testing.assert_close(getattr(got, name).double(), ref[name].double(), atol=1e-5, rtol=1e-5, msg=name)


def test_fully_masked_rows_give_zeros_not_nan():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 7, 4)
    pad = torch.ones(1, 7, dtype=torch.bool)  # every key padded
    got = attention_stats(q, k, key_norms=torch.rand(1, 2, 7), key_padding_mask=pad)
    for name in STATS:
        t = getattr(got, name)
        assert torch.isfinite(t).all() and (t == 0).all(), name


def test_bad_arguments_name_the_problem():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 7, 4)
    with pytest.raises(ValueError, match=r"key_norms has shape \(1, 1, 7\) but must be \(B, H, S\) = \(1, 2, 7\)"):
        attention_stats(q, k, key_norms=torch.rand(1, 1, 7))
    with pytest.raises(ValueError, match=r"lse has shape \(1, 2, 4\)"):
        attention_stats(q, k, lse=torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        attention_stats(q, k, sinks=-1)


# ------------------------------------------------------------------ the analysis against roles.py
def tiny_llama(layers=2, heads=6, kv_heads=2, width=48, T=256, seed=0):
    """A random headwise Llama (GQA), weights large enough that heads attend unevenly."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        "tiny",
        "llama",
        vocab_size=64,
        d_model=width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        d_ff=width,
        max_positions=T,
        mlp="swiglu",
        norm="rmsnorm",
        positions="rope",
    )
    model = Llama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model


def test_role_scores_equal_roles_py_on_full_patterns():
    """With sinks = the first token (what roles.py uses when there are no special tokens), every
    score, the mean distance and the hint numbers equal roles.py's and attribution.py's, which
    read the (B, H, T, T) patterns; padded rows and tiles that do not divide T included."""
    model = tiny_llama()
    batch = from_ids([torch.randint(0, 64, (n,)).tolist() for n in (40, 29, 33)])
    hints = HintAccumulator([m.num_heads for m in attention_layers(model)])
    ref = head_roles(model, [batch], induction=False, hints=hints)
    got = long_context_stats(model, batch, sinks=1, block_q=7, block_k=11)
    h = hints.result()
    assert set(got.roles.scores) == set(ref.scores)
    for l in range(2):
        for name in ref.scores:
            torch.testing.assert_close(got.roles.scores[name][l], ref.scores[name][l], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(got.roles.offset_k[l], ref.offset_k[l])
        torch.testing.assert_close(got.roles.mean_distance[l], ref.mean_distance[l], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.means["max_weight"][l], h.top_weight[l], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.means["top_norm_share"][l], h.top_norm_share[l], atol=1e-5, rtol=1e-5)
    assert [m.hook for m in attention_layers(model)] == [None, None]  # hooks gone after the run


def test_key_norms_equal_attribution_value_norms():
    layer = attention_layers(tiny_llama())[1]
    v = torch.randn(2, 2, 30, 8)
    torch.testing.assert_close(key_norms(layer, v), value_norms(layer, v).detach(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ memory at T = 16384
CHILD = r"""
import json, sys
import torch
from tests.analysis.test_long_context import tiny_llama
from headwise.analysis.capture import from_ids
from headwise.analysis.long_context import _light_forward, _status_bytes, long_context_stats, reset_peak

T = int(sys.argv[1])
torch.set_num_threads(1)  # two threads on a busy host wait on each other at every op
model = tiny_llama(layers=1, heads=1, kv_heads=1, width=32, T=T)
batch = from_ids([torch.randint(0, 64, (T,)).tolist()])
with torch.inference_mode():
    long_context_stats(model, from_ids([batch.ids[0, :300].tolist()]))  # kernels, thread pools
    _light_forward(model, batch)

    def extra(fn):
        reset_peak()  # peak RSS := current RSS
        before = _status_bytes("VmRSS:")
        fn()
        return _status_bytes("VmHWM:") - before

    plain = extra(lambda: _light_forward(model, batch))
    stats = extra(lambda: long_context_stats(model, batch))  # default 256 x 256 tiles
print(json.dumps({"plain": plain, "stats": stats}))
"""


def test_statistics_at_16384_tokens_take_a_hundredth_of_the_pattern_memory():
    """A fresh process (VmHWM is per process); the same forward without statistics is the baseline."""
    T = 16384
    patterns = T * T * 4  # one head's fp32 (T, T) weights: 1 GiB
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(T)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    over = got["stats"] - got["plain"]
    assert over < patterns / 100, f"statistics pass: {got['stats'] / 2**20:.1f} MiB vs {got['plain'] / 2**20:.1f}"


# ------------------------------------------------------------------ the CLI and the report
def test_cli_context_writes_the_long_context_section(tiny_llama_tok_dir, tmp_path, capsys):
    out = tmp_path / "report"
    args = ["analyze", str(tiny_llama_tok_dir), "--context", "300", "--fit", "1", "--heldout", "1"]
    args += ["--seq-len", "16", "--seeds", "1", "--fractions", "0.5", "--prune", "0", "--no-mean-ablation"]
    assert main(args + ["--no-patching", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "long context: 300 tokens" in printed and "VmHWM" in printed
    res = json.loads((out / "analysis.json").read_text())["long_context"]
    assert res["tokens"] == 300 and res["memory"]["peak_mib"] > 0
    assert len(res["roles"]["heads"]) == 2 and len(res["stats"]["entropy"][0]) == 6
    assert (out / "long_context.png").stat().st_size > 10_000
    page = (out / "report.html").read_text()
    data = json.loads(page.split('<script id="data" type="application/json">')[1].split("</script>")[0])
    assert data["summary"]["long_context"]["tokens"] == 300  # what the page's summary shows
    from playwright.sync_api import sync_playwright

    from .test_report import CHROMIUM

    problems = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM))
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto((out / "report.html").resolve().as_uri())
            text = page.text_content("#long-context")
        finally:
            browser.close()
    assert problems == []
    assert text.startswith("Long context: 300 tokens") and f"peak memory {res['memory']['peak_mib']} MiB" in text


def test_cli_context_past_learned_positions_is_refused_before_the_run(capsys):
    assert main(["analyze", "all-minilm-l6-v2", "--context", "1024"]) == 2
    assert "--context 1024 is longer than the 512 positions" in capsys.readouterr().err
