"""The head analysis on Gemma 3's attention: MQA (4 query heads, 1 KV head), five sliding-window
layers to one global, QK-norm, post-norms and a query_pre_attn_scalar scale, on a tiny random
checkpoint saved by transformers. References: transformers' eager attention weights, the math
backend with the layer's window, and the ablation mask (heads zeroed) for pruning."""

import contextlib
import io
import json
import shutil

import pytest
import torch

import headwise
from headwise.analysis import attached, attention_layers, capture, from_ids, prune_heads
from headwise.analysis.ablation import masks_for
from headwise.analysis.capture import forward
from headwise.analysis.dla import pair_attribution
from headwise.analysis.prune import clone, load_pruned, param_count, plan_from, save_pruned
from headwise.analysis.roles import PatternStats
from headwise.attention import attend
from headwise.cli import main

import transformers as tf

from ..helpers import save_hf

W = 8  # the local layers' window; rows are longer (20 tokens)
TOL = 1e-5


def _randomize_norms(hf):
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)  # Gemma's norms are 1 + w: w = 0 would hide a wrong +1


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, minilm_dir):
    """(HF eager model, checkpoint dir with MiniLM's tokenizer files): layers 0-4 local, 5 global."""
    torch.manual_seed(33)
    config = tf.Gemma3TextConfig(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=30522,
        max_position_embeddings=128,
        sliding_window=W,
        query_pre_attn_scalar=24,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = tf.Gemma3ForCausalLM(config).eval()
    _randomize_norms(hf)
    path = save_hf(tmp_path_factory, "tiny-gemma3", hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_dir / name, path / name)
    return tf.Gemma3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval(), path


@pytest.fixture(scope="module")
def model(gemma3):
    return headwise.load(gemma3[1])


def _ids(B, T, seed=0):
    return torch.randint(0, 30522, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_captured_weights_are_the_math_backends_with_the_window(model, gemma3):
    hf, _ = gemma3
    assert model.config.windows == (W,) * 5 + (None,)
    ids = _ids(2, 20)
    batch = from_ids([ids[0].tolist(), ids[1, :13].tolist()])  # row 1 right-padded
    _, cap = capture(model, batch, points=("pattern", "q", "k"))
    valid = batch.valid
    for l, layer in enumerate(attention_layers(model)):
        assert layer.window == model.config.windows[l]
        q, k = cap.q[l], cap.k[l]  # (B, 4, T, D), (B, 1, T, D): MQA
        assert q.shape[1] == 4 and k.shape[1] == 1
        want = attend(
            q,
            k,
            k,
            backend="math",
            is_causal=True,
            key_padding_mask=~valid,  # True = a padded key
            window=layer.window,
            scale=layer.scale,
            need_weights=True,
        ).weights
        got = cap.pattern[l]
        assert (got - want).abs().amax(dim=(1, 3))[valid].max() <= TOL, l
        if layer.window is not None:  # nothing outside the window: query p sees keys p - W + 1 .. p
            p = torch.arange(20)
            outside = (p[None, :] <= p[:, None] - W).expand(2, 4, 20, 20)
            assert got[outside].abs().max() == 0
            assert got[0, :, 19, 19 - W + 1 :].sum(-1).sub(1).abs().max() <= TOL  # its window holds all mass
    # and transformers' own eager weights on the unpadded row (its sliding mask, its scale)
    ref = hf(ids[:1], output_attentions=True).attentions
    _, cap = capture(model, from_ids([ids[0].tolist()]), points=("pattern",))
    for l, want in enumerate(ref):
        assert (cap.pattern[l] - want).abs().max() <= TOL, l


def test_visible_keys_honour_the_window():
    """A head uniform over its window is perfectly broad (1.0) once the window is given, and
    only then: without it the unseen keys count against it."""
    T, B, H = 12, 1, 2
    p = torch.arange(T)
    d = p[None, :] - p[:, None]
    seen = ((d <= 0) & (d > -W)).float()
    pattern = (seen / seen.sum(-1, keepdim=True)).expand(B, H, T, T)
    valid, sinks = torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
    with_w, without = PatternStats([H], causal=True), PatternStats([H], causal=True)
    with_w.add(0, pattern, valid, sinks, window=W)
    without.add(0, pattern, valid, sinks)
    assert torch.allclose(with_w.mean("broad")[0], torch.ones(H), atol=1e-6)
    assert without.mean("broad")[0].max() < 0.99


@pytest.fixture(scope="module")
def report(gemma3, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3-report")
    args = ["analyze", str(gemma3[1]), "--out", str(out), "--fit", "2", "--heldout", "2", "--seq-len", "24"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(args + ["--seeds", "1", "--fractions", "0.25,0.5", "--quiet"])
    assert rc == 0
    return out, printed.getvalue()


def test_analyze_groups_heads_by_layer_type(report, model):
    report, printed = report
    res = json.loads((report / "analysis.json").read_text())
    windows = list(model.config.windows)
    assert res["model"]["windows"] == windows
    groups = {g["type"]: g for g in res["layer_types"]}
    assert set(groups) == {"local", "global"}
    assert groups["local"]["layers"] == [l for l, w in enumerate(windows) if w is not None] == [0, 1, 2, 3, 4]
    assert groups["global"]["layers"] == [l for l, w in enumerate(windows) if w is None] == [5]
    assert (groups["local"]["window"], groups["global"]["window"]) == (W, None)
    assert (groups["local"]["heads"], groups["global"]["heads"]) == (20, 4)
    assert groups["local"]["window_binds"] and "window_binds" not in groups["global"]  # rows of 24 > W = 8
    for g in groups.values():  # counts are the per-head labels of that type's layers
        labels = [info["labels"] for l in g["layers"] for info in res["roles"]["heads"][l]]
        assert g["role_counts"]["broad"] == sum("broad" in lab for lab in labels)
        imp = [x for l in g["layers"] for x in res["importance"]["normalized"][l]]
        assert g["mean_importance"] == pytest.approx(sum(imp) / len(imp), abs=1e-4)
    assert "roles by layer type: local (window 8; 5 layers, 20 heads" in printed
    assert "global (1 layer, 4 heads" in printed
    png = (report / "roles_by_layer_type.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report / "report.html").read_text()
    assert "roles_by_layer_type.png" in page and '"layer_types"' in page
    pr = res["pruning"]  # MQA pruned for real: query heads only, every layer keeps its one KV head
    assert all(x["kv_heads"] == 1 and x["heads"] >= 1 for x in pr["layers_after"])
    assert pr["reload_max_abs_diff"] == 0.0
    assert pr["quality_after"]["loss"] == pytest.approx(pr["quality_masked"]["loss"], abs=1e-5)
    assert all("dla" in p for p in res["patching"]["pairs"])  # post-norms: attribution still sums


def test_layer_type_table_in_chromium(report):
    from playwright.sync_api import sync_playwright

    report, _ = report
    groups = json.loads((report / "analysis.json").read_text())["layer_types"]
    problems = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium")
        try:
            page = browser.new_page()
            page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto((report / "report.html").resolve().as_uri())
            rows = page.locator("#layer-types + table tr")
            assert rows.count() == 1 + len(groups) == 3  # header, local, global
            cells = [rows.nth(i).locator("td").all_text_contents() for i in (1, 2)]
            assert [c[:4] for c in cells] == [["local", "8", "0,1,2,3,4", "20"], ["global", "-", "5", "4"]]
        finally:
            browser.close()
    assert problems == []


def test_summary_says_when_rows_fit_the_window():
    """Rows no longer than the window (Gemma 3 270M's 512 keys, the default 128-token rows):
    local layers saw every key, and the summary says so instead of implying a contrast."""
    from headwise.analysis.layer_types import by_layer_type, summary_line

    heads = [[{"labels": ["sink"], "scores": {"sink": 0.9, "broad": 0.1}}] * 2] * 3
    for seq_len, binds in ((128, False), (600, True)):
        result = {
            "model": {"windows": [512, 512, None], "causal": True},
            "settings": {"seq_len": seq_len},
            "roles": {"heads": heads},
        }
        local, glob = by_layer_type(result)
        assert (local["type"], local["layers"], local["window_binds"]) == ("local", [0, 1], binds)
        assert (glob["type"], glob["layers"], glob["role_share"]) == ("global", [2], {"sink": 1.0, "broad": 0.0})
        assert ("cut nothing" in summary_line([local, glob])) is not binds


def test_dla_sums_to_the_logit_through_post_norms(model):
    ids = _ids(1, 12, seed=3)[0]
    with torch.no_grad():
        logits = model(ids[None])[0, -1]
    views = pair_attribution(model, ids, 1, 8)
    for view, want in (("answer", logits[1]), ("diff", logits[1] - logits[8])):
        assert abs(views[view].total - float(want)) <= 1e-3 * max(1.0, abs(float(want)))


# ---------------------------------------------------------------------------- pruning with MQA and GQA


@pytest.fixture(scope="module")
def qwen2_gqa(tmp_path_factory):
    """A GQA 4:2 model with windows on its layers 1 and 2 (Qwen2's max_window_layers)."""
    torch.manual_seed(5)
    config = tf.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=W,
        max_window_layers=1,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return headwise.load(save_hf(tmp_path_factory, "tiny-qwen2", tf.Qwen2ForCausalLM(config).eval()))


# (layer, head) pairs removed: MQA keeps its single KV head; in the GQA model layer 0 loses KV group 1
# entirely (heads 2, 3) and layer 2 one head of each group
PLANS = {"gemma3": {(0, 0), (0, 2), (0, 3), (2, 1), (5, 0), (5, 3)}, "qwen2": {(0, 2), (0, 3), (2, 0), (2, 3)}}


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
@torch.no_grad()
def test_pruned_logits_equal_the_ablated_models(name, model, qwen2_gqa, tmp_path):
    full = model if name == "gemma3" else qwen2_gqa
    cfg = full.config
    removed = PLANS[name]
    ids = _ids(2, 20, seed=4) % cfg.vocab_size
    batch = from_ids([ids[0].tolist(), ids[1, :15].tolist()])
    with attached(full, mask=masks_for(removed, [cfg.num_heads] * cfg.num_layers)):
        masked = forward(full, batch)
    small = prune_heads(clone(full), plan_from(removed, full))
    layers = attention_layers(small)
    kv = [m.num_kv_heads for m in layers]
    if name == "gemma3":
        assert kv == [1] * 6  # MQA: the one KV head is shared by the heads left, never removed
        assert [m.num_heads for m in layers] == [1, 4, 3, 4, 4, 2]
    else:
        assert kv == [1, 2, 2] and [m.num_heads for m in layers] == [2, 4, 2]
    C, D = cfg.d_model, cfg.head_dim
    kv_gone = sum(cfg.num_kv_heads - n for n in kv)
    b = D if cfg.attn_bias else 0  # Qwen2 biases q, k and v (not o)
    assert param_count(full) - param_count(small) == len(removed) * (2 * C * D + b) + kv_gone * 2 * (C * D + b)
    assert [m.window for m in layers] == list(cfg.windows)
    got = forward(small, batch)
    assert (got - masked)[batch.valid].abs().max() <= 1e-4
    back = load_pruned(save_pruned(small, tmp_path / name))
    assert torch.equal(forward(back, batch), got)


def test_pruning_every_query_head_is_refused(model, qwen2_gqa):
    with pytest.raises(ValueError, match=r"every head of layer 2: its 4 query heads share one KV head \(MQA\)"):
        prune_heads(model, {0: [1], 2: [0, 1, 2, 3]})
    assert [m.num_heads for m in attention_layers(model)] == [4] * 6  # nothing was touched
    with pytest.raises(ValueError, match="removes every head of layer 1; keep at least one"):
        prune_heads(qwen2_gqa, {1: [0, 1, 2, 3]})


def test_long_context_statistics_equal_roles_on_windowed_layers(model):
    """The fused-kernel statistics (`--context`, O(T) memory) and roles.py on full patterns agree on
    every layer, local ones included: both count as visible only the keys inside the window."""
    from headwise.analysis.long_context import long_context_stats
    from headwise.analysis.roles import head_roles

    batch = from_ids([_ids(1, n, seed=n)[0].tolist() for n in (30, 21)])  # rows longer than W = 8
    ref = head_roles(model, [batch], induction=False)
    got = long_context_stats(model, batch, sinks=1, block_q=7, block_k=5)
    for l in range(6):
        for name in ref.scores:
            torch.testing.assert_close(got.roles.scores[name][l], ref.scores[name][l], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(got.roles.mean_distance[l], ref.mean_distance[l], atol=1e-5, rtol=1e-5)
