"""Models for the engine tests: random tiny GPT-2 (MHA) and Llama (GQA) saved with
transformers and loaded by headwise, and the reference every engine output is held to:
headwise.generate run on one prompt at a time (its own contiguous cache, no batching)."""

import pytest
import torch

import headwise
import transformers as tf

from ..helpers import save_hf, tiny_llama_config

tf.logging.set_verbosity_error()

_REFS: dict = {}


def reference(model, prompt, params):
    """headwise.generate on this prompt alone (memoised: the same call always gives the same)."""
    key = (id(model), repr(prompt), params)
    if key not in _REFS:
        res = headwise.generate(model, prompt, params)
        _REFS[key] = res if isinstance(res, list) else [res]
    return _REFS[key]


def _saved(tmp_path_factory, name, hf_model):
    return headwise.load(save_hf(tmp_path_factory, name, hf_model))


@pytest.fixture(scope="session")
def gpt2_pair(tmp_path_factory):
    """(transformers' GPT2LMHeadModel, headwise's GPT2 loaded from its checkpoint)."""
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=96, bos_token_id=None, eos_token_id=None
    )
    hf = tf.GPT2LMHeadModel(cfg).eval()
    return hf, _saved(tmp_path_factory, "gpt2", hf)


@pytest.fixture(scope="session")
def tiny_gpt2(gpt2_pair):
    return gpt2_pair[1]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(1)
    return _saved(tmp_path_factory, "llama", tf.LlamaForCausalLM(tiny_llama_config()).eval())


@pytest.fixture(params=["gpt2", "llama"])
def tiny(request):
    return request.getfixturevalue(f"tiny_{request.param}")


def ragged_prompts(V: int, seed: int = 0, prefix_len: int = 33):
    """12 prompts of 1 to 64 tokens; the last six share a prefix_len-token prefix."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 3, 5, 9, 16, 17]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    prefix = torch.randint(0, V, (prefix_len,), generator=g).tolist()
    prompts += [prefix + torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 4, 7, 12, 19, 31)]
    return prompts


def all_blocks_free(engine) -> bool:
    engine.cache.pool.check([engine.cache.block_table(s) for s in engine.cache.seq_ids()])
    s = engine.stats()
    return s.kv_blocks_free == s.kv_blocks_total and not engine.cache.seq_ids()
