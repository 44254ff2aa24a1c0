"""Models shared by the analysis tests: the real MiniLM (with transformers' BertModel on the
same files as the reference) and tiny random HF checkpoints saved to temp dirs."""

import shutil

import pytest
import torch

import headwise

import transformers as tf  # noqa: E402  (the independent reference)

from ..helpers import save_hf, tiny_llama_config

tf.logging.set_verbosity_error()

SENTENCES = [
    "The bank approved the loan after the river bank flooded.",
    "A short one.",
    "Attention heads are hints, not explanations, of what a model does.",
]


@pytest.fixture(scope="session")
def minilm_dir():
    from headwise.models.builtin import resolve

    return resolve("all-minilm-l6-v2")


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    return headwise.load(minilm_dir)


@pytest.fixture(scope="session")
def minilm_hf(minilm_dir):
    return tf.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random Llama with GQA 6:2 (G = 3, SmolLM2's ratio), saved like tests/models do."""
    torch.manual_seed(1234)
    config = tiny_llama_config(
        hidden_size=48,
        intermediate_size=64,
        num_attention_heads=6,
        vocab_size=96,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    path = save_hf(tmp_path_factory, "tiny-llama", tf.LlamaForCausalLM(config).eval())
    return tf.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval(), path


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, minilm_dir):
    """A random 2-layer BERT with MiniLM's vocabulary and tokenizer files: a fast subject
    for the whole `headwise analyze` pipeline."""
    torch.manual_seed(4321)
    config = tf.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    path = save_hf(tmp_path_factory, "tiny-bert", tf.BertModel(config).eval())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_dir / name, path / name)
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests run small models: one thread is as fast on a quiet machine and does not
    collapse when other jobs share the two cores (2 threads spin-wait on each other there:
    a tiny training step took 0.4 s instead of 15 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(tmp_path_factory, minilm_dir):
    """A random GQA Llama (6:2) with a 30522-token vocabulary and MiniLM's tokenizer files:
    a fast decoder subject for the whole pipeline (the tokenizer only has to turn text into ids)."""
    torch.manual_seed(99)
    config = tiny_llama_config(
        hidden_size=48,
        intermediate_size=64,
        num_attention_heads=6,
        vocab_size=30522,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    path = save_hf(tmp_path_factory, "tiny-llama-tok", tf.LlamaForCausalLM(config).eval())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_dir / name, path / name)
    return path
