"""Activation patching and direct logit attribution per head, on tiny random models and one
built by hand, against transformers (the independent reference) and plain torch ops."""

import json

import numpy as np

import pytest
import torch
from torch import nn

import headwise
from headwise.analysis import attached, pairs, patching
from headwise.analysis.dla import direct_logit_attribution, pair_attribution
from headwise.analysis.hooks import Capture
from headwise.analysis.pairs import Pair, encode_pair, load_pairs
from headwise.core.config import ModelConfig
from headwise.models.gpt2 import GPT2

import transformers as tf

from ..helpers import save_hf

# prompts as ids: tokens 2 and 5 swapped at position 3, the rest shared (so a decoder reuses the 3-token prefix)
CLEAN = (7, 11, 3, 2, 9, 4, 13, 6)
CORRUPTED = (7, 11, 3, 5, 9, 4, 13, 6)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    hf, path = tiny_llama
    return hf, headwise.load(path)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(7)
    config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, bos_token_id=None)
    return headwise.load(save_hf(tmp_path_factory, "tiny-gpt2", tf.GPT2LMHeadModel(config).eval()))


def _patched_all(model, clean, corrupted):
    """The corrupted run with every head of every layer given its clean output z."""
    cap = Capture(("z",))
    with torch.no_grad():
        with attached(model, capture=cap):
            ref = model(clean)
        z = [cap.z[l][0] for l in range(len(cap.z))]
        with attached(model, mask=[torch.zeros(t.shape[0]) for t in z], replace=z):
            out = model(corrupted)
    return ref, out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patching_every_head_reproduces_the_clean_logits(family, llama, gpt2):
    # positions only read other positions through attention, so with every head's output
    # from the clean run, each position whose own token agrees is the clean run's exactly
    model = llama[1] if family == "llama" else gpt2
    clean, corrupted = torch.tensor([CLEAN]), torch.tensor([CORRUPTED])
    ref, out = _patched_all(model, clean, corrupted)
    same = torch.tensor(CLEAN) == torch.tensor(CORRUPTED)
    assert torch.equal(out[0, same], ref[0, same])
    assert not torch.allclose(out[0, 3], ref[0, 3])  # the corrupted token's own position still differs
    r = patching.patch_heads(model, Pair(CLEAN, CORRUPTED, 1, 8))
    assert r.all_heads == r.clean


def test_patching_every_head_of_an_encoder(tiny_bert_dir):
    bert = headwise.load(tiny_bert_dir)
    enc = encode_pair(bert, pairs.ENCODER_PAIRS[0])
    ref, out = _patched_all(bert, enc.clean[None], enc.corrupted[None])
    same = enc.clean == enc.corrupted
    assert (~same).sum() == 2  # "river bank" -> "city hall"
    assert torch.allclose(out[0, same], ref[0, same], atol=1e-5, rtol=0)
    r = patching.patch_heads(bert, enc)
    assert r.metric == "cosine" and r.clean == 1.0 and r.corrupted < 1.0
    # transformers' BertModel as the reference: each head's slice of attention.output.dense's input
    hf = tf.BertModel.from_pretrained(tiny_bert_dir, attn_implementation="eager").eval()
    D, kept = 8, {}

    def pooled(ids):
        h = hf(ids).last_hidden_state[0]
        return nn.functional.normalize(h.mean(0), dim=-1)

    dense = [layer.attention.output.dense for layer in hf.encoder.layer]
    hooks = [
        d.register_forward_pre_hook(lambda m, a, l=l: kept.__setitem__(l, a[0].clone())) for l, d in enumerate(dense)
    ]
    with torch.no_grad():
        clean = pooled(enc.clean[None])
    for h in hooks:
        h.remove()
    ref = []
    for l, d in enumerate(dense):
        for h in range(4):

            def swap(m, args, l=l, h=h):
                x = args[0].clone()
                x[..., h * D : (h + 1) * D] = kept[l][..., h * D : (h + 1) * D]
                return (x,)

            hook = d.register_forward_pre_hook(swap)
            with torch.no_grad():
                ref.append(float(pooled(enc.corrupted[None]) @ clean))
            hook.remove()
    assert torch.allclose(torch.cat(r.patched), torch.tensor(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("use_prefix", [True, False])
def test_one_head_patched_matches_transformers(llama, use_prefix):
    # transformers as the reference: o_proj's input is the heads' outputs side by side (B, T, H*D);
    # replace head h's slice in layer l by the clean run's and read the logit difference
    hf, model = llama
    H, D, answer, wrong = 6, 8, 1, 8
    clean, corrupted = torch.tensor([CLEAN]), torch.tensor([CORRUPTED])
    kept = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, l=l: kept.__setitem__(l, a[0].clone()))
        for l, layer in enumerate(hf.model.layers)
    ]
    with torch.no_grad():
        hf(clean)
    for h in hooks:
        h.remove()
    ref = []
    for l, layer in enumerate(hf.model.layers):
        for h in range(H):

            def swap(m, args, l=l, h=h):
                x = args[0].clone()
                x[..., h * D : (h + 1) * D] = kept[l][..., h * D : (h + 1) * D]
                return (x,)

            hook = layer.self_attn.o_proj.register_forward_pre_hook(swap)
            with torch.no_grad():
                lg = hf(corrupted).logits[0, -1]
            hook.remove()
            ref.append(float(lg[answer] - lg[wrong]))
    r = patching.patch_heads(model, Pair(CLEAN, CORRUPTED, answer, wrong), use_prefix=use_prefix, token_budget=40)
    assert r.shared_prefix == (3 if use_prefix else 0)
    assert torch.allclose(torch.cat(r.patched), torch.tensor(ref), atol=1e-4, rtol=0)
    with torch.no_grad():
        lc, lk = hf(clean).logits[0, -1], hf(corrupted).logits[0, -1]
    assert r.clean == pytest.approx(float(lc[answer] - lc[wrong]), abs=1e-4)
    assert r.corrupted == pytest.approx(float(lk[answer] - lk[wrong]), abs=1e-4)
    gap = r.clean - r.corrupted
    assert torch.allclose(torch.cat(r.recovered), (torch.tensor(ref) - r.corrupted) / gap, atol=1e-4)


# ---------------------------------------------------------------------------- a planted head


def planted_model():
    """A 2-layer GPT-2 (8 tokens, width 32, 4 heads of 8) with small random weights, except
    layer 1 head 2, built to copy: it attends from every position to position 1 (a flag in
    the position embedding that its key reads) and writes that token's one-hot embedding,
    scaled, back onto the token dimensions, which the tied unembedding reads as logits."""
    V, C, H, D, flag = 8, 32, 4, 8, 16
    cfg = ModelConfig(
        name="planted",
        arch="gpt2",
        vocab_size=V,
        d_model=C,
        num_layers=2,
        num_heads=H,
        d_ff=16,
        max_positions=16,
        attn_bias=True,
        mlp_bias=True,
    )
    torch.manual_seed(0)
    model = GPT2(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.normal_(0, 0.02)
        model.embed.weight[:, :V] += torch.eye(V)  # token i -> dim i (the tied unembedding reads dims 0..7)
        model.pos_embed.weight[1, flag] += 1.0
        attn = model.layers[1].attn
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias  # rows [Q | K | V], H*D each
        q, k, v = (slice(i * H * D + 2 * D, i * H * D + 3 * D) for i in range(3))
        for rows in (q, k, v):
            w[rows], b[rows] = 0.0, 0.0
        b[q.start] = 1.0  # a constant query ...
        w[k.start, flag] = 20.0  # ... meets a key that is large only at the flagged position
        w[v.start : v.start + V, :V] = torch.eye(V)  # value: the token's one-hot
        attn.out_proj.weight[:, 2 * D : 3 * D] = 0.0
        attn.out_proj.weight[:V, 2 * D : 2 * D + V] = 5.0 * torch.eye(V)  # written back onto dims 0..7
    return model


def test_the_planted_head_recovers_the_answer_and_no_other_does():
    model = planted_model()
    pair = Pair((4, 1, 5, 6, 3), (4, 2, 5, 6, 3), answer=1, wrong=2)
    r = patching.patch_heads(model, pair)
    assert r.clean > 5 and r.corrupted < -5  # the copy decides the answer either way
    rec = torch.stack(r.recovered)  # (2, 4)
    assert rec[1, 2] > 0.95
    others = torch.ones_like(rec, dtype=torch.bool)
    others[1, 2] = False
    assert rec[others].abs().max() < 0.05
    dla = direct_logit_attribution(model, torch.tensor(pair.clean), 1, 2)
    heads = torch.stack(dla.heads)
    assert heads[1, 2] > 0.9 * dla.logit
    assert heads.flatten()[torch.arange(8) != 6].abs().max() < 0.05 * dla.logit


# ---------------------------------------------------------------------------- direct logit attribution


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_attributions_sum_to_the_logit(family, llama, gpt2):
    model = llama[1] if family == "llama" else gpt2
    ids = torch.tensor(CLEAN)
    with torch.no_grad():
        logits = model(ids[None])[0, -1]
    views = pair_attribution(model, ids, 1, 8)
    for view, want in (("answer", logits[1]), ("diff", logits[1] - logits[8])):
        a = views[view]
        assert a.logit == pytest.approx(float(want), abs=1e-5)
        assert abs(a.total - float(want)) <= 1e-4
        assert [t.shape[0] for t in a.heads] == [attn.num_heads for attn in (b.attn for b in model.layers)]
    kinds = set(views["diff"].terms)
    if family == "gpt2":  # learned positions, biases, LayerNorm's bias
        assert kinds == {"embed", "pos_embed", "attn_bias", "mlp", "norm_bias"}
    else:
        assert kinds == {"embed", "mlp"}


def test_dla_of_a_head_is_its_result_through_the_frozen_norm(llama):
    # one head's share by hand on the transformers model: z_h W_O[:, h]^T at the last position,
    # times the final RMSNorm's weight and 1/rms of the residual it normalizes, dot the
    # unembedding direction W_U[answer] - W_U[wrong]
    hf, model = llama
    ids = torch.tensor([CLEAN])
    kept = {}
    hooks = [
        hf.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: kept.__setitem__("z", a[0])),
        hf.model.norm.register_forward_pre_hook(lambda m, a: kept.__setitem__("x", a[0][0, -1])),
    ]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    h, D = 4, 8
    with torch.no_grad():
        result = (
            hf.model.layers[1].self_attn.o_proj.weight[:, h * D : (h + 1) * D] @ kept["z"][0, -1, h * D : (h + 1) * D]
        )
        scale = torch.rsqrt(kept["x"].pow(2).mean() + hf.config.rms_norm_eps)
        u = (hf.lm_head.weight[1] - hf.lm_head.weight[8]) * hf.model.norm.weight * scale
    a = direct_logit_attribution(model, ids[0], 1, 8)
    assert float(a.heads[1][h]) == pytest.approx(float(result @ u), abs=1e-5)


# ---------------------------------------------------------------------------- bad input


def test_bad_pairs_say_what_is_wrong(llama, tiny_bert_dir, tmp_path):
    model = llama[1]
    with pytest.raises(ValueError, match="clean prompt has 8 tokens and the corrupted one 7"):
        patching.patch_heads(model, Pair(CLEAN, CORRUPTED[:-1], 1, 8))
    with pytest.raises(ValueError, match=r"answer token id 96 is outside the vocabulary \[0, 96\)"):
        encode_pair(model, Pair(CLEAN, CORRUPTED, 96, 8))
    with pytest.raises(ValueError, match="a decoder pair needs wrong="):
        encode_pair(model, Pair(CLEAN, CORRUPTED, 1))
    with pytest.raises(ValueError, match="same token"):
        encode_pair(model, Pair(CLEAN, CORRUPTED, 3, 3))
    with pytest.raises(ValueError, match="has no tokenizer; give the clean prompt as token ids"):
        encode_pair(model, Pair("some text", CORRUPTED, 1, 8))
    with pytest.raises(ValueError, match="are the same tokens"):
        patching.patch_heads(model, Pair(CLEAN, CLEAN, 1, 8))
    bert = headwise.load(tiny_bert_dir)
    with pytest.raises(ValueError, match="leave answer and wrong out"):
        encode_pair(bert, Pair("a b c", "a b d", "x", "y"))
    with pytest.raises(ValueError, match="needs a pre-norm decoder"):
        direct_logit_attribution(bert, torch.tensor([101, 2000, 102]), 5)
    for line, msg in (
        ("{not json", r"pairs.jsonl:2: not JSON"),
        ('{"clean": "a"}', r':2: needs an object with "clean" and "corrupted"'),
        ('{"clean": "a", "corrupted": "b", "answr": "c"}', r":2: unknown keys \['answr'\]"),
        ('{"clean": "a", "corrupted": [1, "b"]}', r":2: corrupted must be a text or a list of token ids"),
        ('{"clean": "a", "corrupted": "b", "answer": [3]}', r":2: answer must be a text or one token id"),
    ):
        path = tmp_path / "pairs.jsonl"
        path.write_text('{"clean": [1, 2], "corrupted": [1, 3], "answer": 4, "wrong": 5}\n' + line + "\n")
        with pytest.raises(ValueError, match=msg):
            load_pairs(path)


def test_answers_must_be_one_known_token(tiny_llama_tok_dir):
    model = headwise.load(tiny_llama_tok_dir)  # a decoder with MiniLM's WordPiece tokenizer
    clean, corrupted = "when mary and john left, john waved to", "when mary and john left, mary waved to"
    with pytest.raises(ValueError, match=r"answer ' zxqvw' is 5 tokens .*pick a single-token answer"):
        encode_pair(model, Pair(clean, corrupted, " zxqvw", " John"))
    with pytest.raises(ValueError, match=r"wrong '☃' is unknown to the tokenizer \(it becomes '\[UNK\]'\)"):
        encode_pair(model, Pair(clean, corrupted, " Mary", "☃"))


def test_replace_per_position_checks_its_length(llama):
    model = llama[1]
    z = [torch.zeros(6, 5, 8), None]  # 5 positions, the run has 8
    with pytest.raises(ValueError, match=r"replace\[0\] has 5 positions but this run has T=8"):
        with torch.no_grad(), attached(model, mask=[torch.zeros(6), None], replace=z):
            model(torch.tensor([CLEAN]))


# ---------------------------------------------------------------------------- study and pairs file


def test_study_reads_a_pairs_file(llama, tmp_path):
    model = llama[1]
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"clean": list(CLEAN), "corrupted": list(CORRUPTED), "answer": 1, "wrong": 8},
        {"clean": list(CORRUPTED), "corrupted": list(CLEAN), "answer": 8, "wrong": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = patching.study(model, load_pairs(path))
    assert [p["clean"] for p in res["pairs"]] == [str(tuple(r["clean"])) for r in rows] and not res["skipped"]
    one = patching.patch_heads(model, Pair(CLEAN, CORRUPTED, 1, 8))
    two = patching.patch_heads(model, Pair(CORRUPTED, CLEAN, 8, 1))
    mean = (torch.stack(one.recovered) + torch.stack(two.recovered)) / 2
    assert torch.allclose(torch.tensor(res["mean_recovered"]), mean, atol=1e-4)
    first = res["pairs"][0]["dla"]["diff"]
    assert abs(first["total"] - first["logit"]) < 1e-3
    with pytest.raises(ValueError, match=r"pair 1: the clean prompt has 8 tokens and the corrupted one 2"):
        patching.study(model, [Pair(CLEAN, (1, 2), 1, 8)])


def test_default_pairs_line_up_on_a_word_piece_decoder(tiny_llama_tok_dir):
    model = headwise.load(tiny_llama_tok_dir)
    res = patching.study(model)
    assert len(res["pairs"]) + len(res["skipped"]) == len(pairs.LM_PAIRS)
    for p in res["pairs"]:
        assert len(p["tokens"]) == len(p["corrupted_tokens"])
        assert len(p["patching"]["recovered"]) == 2 and len(p["dla"]["diff"]["heads"][0]) == 6


def test_analyze_with_a_pairs_file_reports_patching(tiny_llama_tok_dir, tmp_path, capsys):
    from headwise.cli import main

    import matplotlib.image as mpimg

    path = tmp_path / "pairs.jsonl"
    pair = {"clean": "the capital of france is", "corrupted": "the capital of italy is", "answer": " paris"}
    path.write_text(json.dumps(pair | {"wrong": " rome"}) + "\n")
    out = tmp_path / "out"
    args = ["analyze", str(tiny_llama_tok_dir), "--out", str(out), "--fit", "1", "--heldout", "1", "--seq-len", "16"]
    args += ["--seeds", "1", "--fractions", "0.5", "--prune", "0", "--no-mean-ablation", "--quiet"]
    assert main(args + ["--pairs", str(path)]) == 0
    assert "patching (logit_diff, 1 pairs): heads that recover most: L" in capsys.readouterr().out
    res = json.loads((out / "analysis.json").read_text())
    pt = res["patching"]
    assert [p["clean"] for p in pt["pairs"]] == [pair["clean"]] and pt["pairs"][0]["answer"] == " paris"
    model = headwise.load(tiny_llama_tok_dir)
    direct = patching.patch_heads(model, Pair(pair["clean"], pair["corrupted"], " paris", " rome"))
    assert np.allclose(pt["mean_recovered"], torch.stack(direct.recovered).numpy(), atol=1e-4)
    for name in ("patching.png", "dla.png"):
        img = mpimg.imread(out / name)
        assert img.shape[0] > 100 and img[..., :3].std() > 0.01
    html = (out / "report.html").read_text()
    assert 'alt="patching.png"' in html and 'alt="dla.png"' in html and '"metric_corrupted"' in html

    path.write_text(json.dumps(pair | {"wrong": " rome", "corrupted": "the capital of the italian republic is"}))
    assert main(args + ["--pairs", str(path)]) == 2
    assert "pair 1: the clean prompt has" in capsys.readouterr().err
    assert main(args + ["--pairs", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err
