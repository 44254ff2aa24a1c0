"""Pruning heads across a model for real: shapes, parameter counts, save and reload."""

import json

import pytest
import torch

import headwise
from headwise.analysis import attention_layers, encode, from_ids, load_pruned, param_count, prune_heads, save_pruned
from headwise.analysis.capture import forward
from headwise.analysis.prune import CONFIG_FILE

from .conftest import SENTENCES


@torch.no_grad()
def test_gqa_prune_save_reload(tiny_llama_tok_dir, tmp_path):
    model = headwise.load(tiny_llama_tok_dir)
    C, D = 48, 8
    before = param_count(model)
    plan = {0: [3, 4, 5, 0], 1: [2]}  # layer 0: KV group 1 entirely + one head of group 0
    prune_heads(model, plan)
    a0, a1 = attention_layers(model)
    assert (a0.num_heads, a0.num_kv_heads, a0.head_ids) == (2, 1, [1, 2])
    assert (a1.num_heads, a1.num_kv_heads, a1.head_ids) == (5, 2, [0, 1, 3, 4, 5])
    # 5 query heads gone (Q rows + O columns), 1 KV head gone (K and V rows)
    assert before - param_count(model) == 5 * 2 * C * D + 1 * 2 * C * D
    batch = encode(model, SENTENCES)
    want = forward(model, batch)
    save_pruned(model, tmp_path / "p")
    meta = json.loads((tmp_path / "p" / CONFIG_FILE).read_text())
    assert [(x["heads"], x["kv_heads"]) for x in meta["layers"]] == [(2, 1), (5, 2)]
    back = load_pruned(tmp_path / "p")
    assert param_count(back) == param_count(model)
    assert back.tokenizer.encode(SENTENCES[0]) == model.tokenizer.encode(SENTENCES[0])
    assert torch.equal(forward(back, batch), want)
    assert back.lm_head.weight is back.embed.weight  # tied weights stay tied


@torch.no_grad()
def test_bert_prune_save_reload(minilm, tmp_path):
    from headwise.analysis.prune import clone

    model = prune_heads(clone(minilm), {0: [0, 1], 3: list(range(11))})
    save_pruned(model, tmp_path / "m")
    back = load_pruned(tmp_path / "m")
    assert [m.num_heads for m in attention_layers(back)] == [10, 12, 12, 1, 12, 12]
    assert back.max_seq_length == minilm.max_seq_length
    texts = SENTENCES
    assert torch.equal(headwise.embed(back, texts), headwise.embed(model, texts))


def test_prune_errors(tiny_llama, tmp_path):
    _, path = tiny_llama
    model = headwise.load(path)
    with pytest.raises(ValueError, match="removes every head of layer 1"):
        prune_heads(model, {0: [1], 1: list(range(6))})
    assert attention_layers(model)[0].num_heads == 6  # nothing was touched
    with pytest.raises(ValueError, match="layer 7 is out of range"):
        prune_heads(model, {7: [0]})
    with pytest.raises(FileNotFoundError, match="not a directory written by save_pruned"):
        load_pruned(tmp_path)
    prune_heads(model, {1: [0]})
    prune_heads(model, {1: [0, 2]})  # already-pruned ids are ignored
    assert attention_layers(model)[1].head_ids == [1, 3, 4, 5]
    assert forward(model, from_ids([[1, 2, 3]])).shape == (1, 3, 96)
