"""/v1/models' KV figures for a model whose layers differ in window (the card's "kv_layer_types"):
bytes a token takes per layer type, measured on the engine's pool, written out here from the
formula 2 x Hkv x D x 4 bytes (fp32) per layer."""

from types import SimpleNamespace

import torch

import headwise
from headwise import Engine
from headwise.serve.local import LocalRuntime

from ..helpers import save_hf

import transformers as tf  # noqa: E402


def test_card_reports_kv_bytes_per_layer_type(tmp_path_factory):
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=6, vocab_size=96, sliding_window=8, query_pre_attn_scalar=16, max_position_embeddings=128,
    )  # fmt: skip
    model = headwise.load(save_hf(tmp_path_factory, "gemma3", tf.Gemma3ForCausalLM(config).eval()))
    engine = Engine(model, max_num_seqs=2, block_size=4, num_blocks=64)
    card = LocalRuntime.card(SimpleNamespace(state="ready", model=model, engine=engine, tp=None))
    per_layer = 2 * 1 * 16 * 4
    assert card["kv_layer_types"] == [
        {"window": None, "layers": 1, "kv_bytes_per_token": per_layer},
        {"window": 8, "layers": 5, "kv_bytes_per_token": 5 * per_layer},
    ]
    assert card["kv_bytes_per_token"] == 6 * per_layer and card["kv_pool_blocks"] == 64
