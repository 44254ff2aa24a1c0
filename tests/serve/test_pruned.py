"""A pruned model served beside the full one (issue 16): `headwise serve` loads a folder
written by save_pruned, /v1/models lists its parameters, KV bytes per token and measured
quality, its greedy completions equal headwise.generate on the folder loaded directly, and a
weighted route splits traffic between the two variants."""

from __future__ import annotations

import collections

import httpx
import openai
import pytest
import torch

import headwise
from headwise.analysis import attention_layers, param_count, prune_heads, save_pruned
from headwise.analysis.prune import load_pruned, record_quality
from headwise.serve import create_app, parse_config

from .conftest import LiveServer

PROMPTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def pruned(tiny_dir, tmp_path_factory):
    """tiny (2 layers, 4 query heads over 2 KV heads) with layer 0's KV group 1 (heads 2, 3)
    removed: layer 0 keeps 1 KV head, layer 1 keeps 2. -> (folder, parameters as pruned)."""
    model = headwise.load(tiny_dir)
    prune_heads(model, {0: [2, 3]})
    assert [(m.num_heads, m.num_kv_heads) for m in attention_layers(model)] == [(2, 1), (4, 2)]
    path = save_pruned(model, tmp_path_factory.mktemp("tiny-pruned"))
    # a quality as `headwise analyze` writes it, measured here by hand: perplexity of one text
    ids = torch.tensor([model.tokenizer.encode("The bank approved the loan after the river flooded.")])
    with torch.no_grad():
        logits = model(ids)
    loss = float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]))
    record_quality(
        path, {"metric": "perplexity", "after": {"loss": loss, "perplexity": float(torch.tensor(loss).exp())}}
    )
    return path, param_count(model), loss


@pytest.fixture(scope="module")
def server(tiny_dir, pruned):
    limits = {"max_num_seqs": 4, "num_blocks": 64}
    config = {
        "server": {"api_key_env": ""},
        "models": {
            "tiny": {"source": str(tiny_dir), **limits},
            "tiny-pruned": {"source": str(pruned[0]), **limits},
            "requantized": {"source": str(pruned[0]), "weights": "q8_0"},  # refused: served as saved
        },
        "routes": {"split": {"targets": [{"target": "tiny", "weight": 3}, {"target": "tiny-pruned", "weight": 1}]}},
    }
    live = LiveServer(create_app(parse_config(config))).start()
    yield live
    live.stop()


def test_pruned_variant_listed_with_its_numbers(server, pruned, tiny_dir):
    path, params, loss = pruned
    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    full, small = cards["tiny"]["headwise"], cards["tiny-pruned"]["headwise"]
    assert full["parameters"] == param_count(headwise.load(tiny_dir))
    assert small["parameters"] == params < full["parameters"]
    D = 64 // 4
    # the pool holds one KV-head count for every layer: the largest left (2), so no saving here
    assert full["kv_bytes_per_token"] == small["kv_bytes_per_token"] == 2 * 2 * 2 * D * 4  # layers*K,V*Hkv*D*fp32
    assert small["pruned"] == {"kv_heads_per_layer": [1, 2]}
    assert small["quality"]["after"]["loss"] == pytest.approx(loss)
    assert "quality" not in full and "pruned" not in full
    bad = cards["requantized"]
    assert bad["status"] == "failed" and "served in the weights it was saved in" in bad["error"]
    # plain OpenAI clients read the same list
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert {"tiny", "tiny-pruned", "requantized", "split"} == {m.id for m in client.models.list().data}


def test_pruned_outputs_equal_the_folder_loaded_directly(server, pruned):
    model = load_pruned(pruned[0], uniform_kv=True)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for prompt in PROMPTS:
        ref = headwise.generate(model, prompt, max_new_tokens=12, temperature=0)
        res = client.completions.create(model="tiny-pruned", prompt=prompt, max_tokens=12, temperature=0)
        assert res.choices[0].text == ref.text
        assert res.usage.completion_tokens == len(ref.token_ids)


def test_route_splits_between_full_and_pruned(server):
    targets = collections.Counter()
    for _ in range(40):
        r = httpx.post(
            server.url + "/v1/completions", json={"model": "split", "prompt": "Hi", "max_tokens": 1}, timeout=60
        )
        assert r.status_code == 200, r.text
        targets[r.headers["x-headwise-target"]] += 1
    # 3:1 weights; no request to tiny-pruned in 40 draws has p = 0.75^40 ~ 1e-5
    assert set(targets) == {"tiny", "tiny-pruned"} and sum(targets.values()) == 40


@torch.no_grad()
def test_quantized_model_keeps_its_blocks_through_prune_save_load(tiny_dir, tmp_path):
    """A model held as GGUF blocks (q4_1) pruned, saved and loaded: every reloaded weight, decoded
    by gguf itself, is the kept rows / columns of the original's decoded weight; padded to one
    KV-head count (as served) it computes the same logits and generates."""
    import gguf

    from headwise.models.linear import QuantizedLinear

    def decoded(m):  # gguf's own dequantization of a module's blocks, (O, I)
        w = gguf.quants.dequantize(m.file_blocks().numpy(), gguf.GGMLQuantizationType.Q4_1)
        return torch.from_numpy(w).reshape(m.out_features, m.in_features)

    model = headwise.load(tiny_dir, weights="q4_1")
    D, C = 16, 64
    full = {n: decoded(m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    prune_heads(model, {0: [2, 3]})  # layer 0 keeps query heads 0, 1 and KV head 0
    back = load_pruned(save_pruned(model, tmp_path / "q"))
    got = {n: m for n, m in back.named_modules() if isinstance(m, QuantizedLinear)}
    q, kv = torch.arange(2 * D), torch.arange(D)  # layer 0's kept Q rows and K/V rows
    rows0 = torch.cat([q, 4 * D + kv, 6 * D + kv])  # of [Q (4 heads) | K (2) | V (2)]
    assert torch.equal(decoded(got["layers.0.attn.qkv_proj"]), full["layers.0.attn.qkv_proj"][rows0])
    # D = 16 cuts through q4_1's 32-value blocks: layer 0's O columns are float, the decoded values
    assert torch.equal(back.layers[0].attn.out_proj.weight, full["layers.0.attn.out_proj"][:, q])
    for name in ("layers.1.attn.qkv_proj", "layers.1.attn.out_proj", "layers.0.mlp.down", "lm_head"):
        assert torch.equal(decoded(got[name]), full[name])
    assert back.pruned["parameters"] == param_count(model) == param_count(back)
    assert param_count(headwise.load(tiny_dir, weights="q4_1")) - param_count(back) == 2 * D * C * 2 + D * C * 2
    served = load_pruned(tmp_path / "q", uniform_kv=True)
    assert [m.num_kv_heads for m in attention_layers(served)] == [2, 2] and served.config.num_kv_heads == 2
    assert isinstance(served.layers[0].attn.qkv_proj, QuantizedLinear)  # padded with zero blocks
    ids = torch.tensor([[5, 17, 300, 2, 99, 4000, 7]])
    assert torch.allclose(served(ids), back(ids), atol=1e-5, rtol=0)
    assert len(headwise.generate(served, ids[0].tolist(), max_new_tokens=4, temperature=0).token_ids) == 4


@torch.no_grad()
def test_split_q_k_v_keep_their_blocks_through_prune_save_load(tmp_path):
    """A llama.cpp Q4_K_M-style file whose layer 0 holds Q4_K Q, K beside a Q6_K V (three linears,
    MultiHeadAttention.unfuse): pruned, saved and loaded, layer 0's q, k, v stay blocks, each the kept
    rows of the fp32 path's weight (the file dequantized); the reload computes the same logits, and
    padded to one KV-head count (as served) k and v get zero blocks and the logits do not move."""
    from headwise.models.linear import QuantizedLinear

    from ..models.test_gguf import write_wide_q4_k_m

    path = write_wide_q4_k_m(tmp_path / "q4_k_m_wide.gguf")
    model, f = headwise.load(path), headwise.load(path, weights="fp32")
    assert not model.layers[0].attn.fused
    D = model.config.head_dim
    prune_heads(model, {0: [2, 3]})  # layer 0 keeps query heads 0, 1 and KV head 0
    back = load_pruned(save_pruned(model, tmp_path / "pruned"))
    a, wq, wk, wv = back.layers[0].attn, *f.layers[0].attn.projection_weights()[:3]
    assert not a.fused and [type(m) for m in (a.q_proj, a.k_proj, a.v_proj)] == [QuantizedLinear] * 3
    assert [a.q_proj.fmt, a.k_proj.fmt, a.v_proj.fmt] == ["q4_k", "q4_k", "q6_k"]
    assert torch.equal(a.q_proj.weight, wq[: 2 * D]) and torch.equal(a.k_proj.weight, wk[:D])
    assert torch.equal(a.v_proj.weight, wv[:D])
    ids = torch.tensor([[5, 17, 30, 2, 99, 40, 7]])
    assert torch.equal(back(ids), model(ids))
    served = load_pruned(tmp_path / "pruned", uniform_kv=True)
    s = served.layers[0].attn
    assert s.num_kv_heads == 2 and isinstance(s.k_proj, QuantizedLinear) and isinstance(s.v_proj, QuantizedLinear)
    assert torch.equal(s.v_proj.weight[D:], torch.zeros(D, s.v_proj.in_features))
    assert torch.allclose(served(ids), back(ids), atol=1e-5, rtol=0)
    assert len(headwise.generate(served, ids[0].tolist(), max_new_tokens=4, temperature=0).token_ids) == 4
