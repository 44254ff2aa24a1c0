"""Models whose layers keep only a window of K/V (Mistral: every layer; Gemma 3: 5 local to 1
global), run by generate() (a ring per windowed layer, cache/sliding.py) and by the engine (a
block table per group of layers, windowed groups giving back blocks, cache/hybrid.py).

The reference is transformers' own greedy search on the same random checkpoint, over sequences
many windows long, so a cache that dropped a key still in the window, or showed one out of it,
changes the tokens.
"""

import re

import pytest
import torch

import headwise
from headwise import Engine, SamplingParams
from headwise.cache import HybridPagedKVCache, SlidingWindowLayerCache
from headwise.kernels import attention as kernel_attention
from headwise.kernels import layer as kernel_layer
from headwise.runtime.batch import ContiguousRunner

from ..helpers import save_hf

import transformers as tf  # noqa: E402  (the independent reference)

tf.logging.set_verbosity_error()

V, W, BS, NEW = 96, 8, 4, 44  # vocab, window, block size, tokens generated (> 5 windows)
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    vocab_size=V,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

MODELS = {
    "mistral": lambda: tf.MistralForCausalLM(
        tf.MistralConfig(**BASE, num_hidden_layers=2, num_key_value_heads=2, sliding_window=W)
    ),
    "gemma3": lambda: tf.Gemma3ForCausalLM(
        tf.Gemma3TextConfig(
            **BASE, num_hidden_layers=6, num_key_value_heads=1, head_dim=16, sliding_window=W, query_pre_attn_scalar=16
        )
    ),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            torch.manual_seed(7)
            hf = MODELS[name]().eval()
            made[name] = hf, headwise.load(save_hf(tmp_path_factory, name, hf))
        return made[name]

    return get


def prompts(n=5, seed=0):
    """Ragged prompts (3 to 30 tokens: some longer than the window); the last two share 12 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, V, (int(torch.randint(3, 31, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    shared = torch.randint(0, V, (12,), generator=g).tolist()
    return out + [shared + [5, 6, 7], shared + [9]]


@torch.no_grad()
def hf_greedy(hf, prompt):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, do_sample=False, max_new_tokens=NEW, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_keeps_rings_and_matches_hf(pair, name):
    hf, model = pair(name)
    runner = ContiguousRunner(model, 1, 64)
    windowed = [type(x) is SlidingWindowLayerCache for x in runner.cache.layers]
    assert windowed == [w is not None for w in model.config.windows] and any(windowed)
    for p in prompts()[:3]:
        assert headwise.generate(model, p, GREEDY).token_ids == hf_greedy(hf, p), p


@pytest.fixture
def stacked(monkeypatch):
    """Layer-steps the fused executor's C decode stack ran (kernels.layer.run_stack entries)."""
    count = [0]
    real = kernel_layer.run_stack

    def spy(steps, x):
        count[0] += len(steps)
        return real(steps, x)

    monkeypatch.setattr(kernel_layer, "run_stack", spy)
    return count


@pytest.mark.parametrize("name", list(MODELS))
def test_engine_frees_out_of_window_blocks_and_matches_hf(pair, name, stacked):
    """Seven requests at once (chunked prefill of 8 tokens a step, two sharing a prefix): every
    completion is HF's, and after every step each windowed group holds at most the blocks of its
    window (W - 1 keys, and the block the next token starts) per sequence. Decode steps run in the
    C layer stack over the groups' block tables, whose entries before the window are the null
    block (zeros): a read of one would change the tokens."""
    hf, model = pair(name)
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=16, block_size=BS, num_blocks=400)
    cache = engine.cache
    assert isinstance(cache, HybridPagedKVCache)
    ps = prompts()
    ids = [engine.add_request(p, GREEDY) for p in ps]
    done, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        for k, group in enumerate(cache.groups):
            if group.window is None:
                continue
            for s in group.seq_ids():
                held = len(group.held_blocks(s))
                most = max(most, held)
                assert held <= -(-(W - 1) // BS) + 1, (k, s, group.length(s))
        cache.check()
    assert most == -(-(W - 1) // BS) + 1  # the bound is reached, not loose
    for rid, p in zip(ids, ps):
        assert done[rid] == hf_greedy(hf, p), p
    assert cache.num_free_blocks == cache.num_blocks - 1  # everything back but the null block
    assert engine.scheduler.prefix_hits > 0  # the shared prefix was found in every group
    if kernel_attention.decode_attention_unavailable() is None:  # the C stack is built here
        assert stacked[0] >= model.config.num_layers * (NEW - 1)  # every layer's decode steps, windowed ones too


def test_engine_pool_reports_layer_types(pair):
    _, model = pair("gemma3")
    engine = Engine(model, max_num_seqs=2, block_size=BS, num_blocks=64)
    info = engine.core.pool_info()
    per_layer = 2 * 1 * 16 * 4  # K and V, 1 KV head x D 16, fp32
    assert info["layer_types"] == [
        {"window": None, "layers": 1, "kv_bytes_per_token": per_layer},
        {"window": W, "layers": 5, "kv_bytes_per_token": 5 * per_layer},
    ]
    assert info["bytes"] == 64 * BS * per_layer  # 64 blocks of one layer (6 groups of 1)
    assert info["tokens"] == 64 * BS // 6


@pytest.mark.parametrize("name, blocks", [("mistral", 12), ("gemma3", 100)])
def test_a_small_pool_preempts_and_still_matches_hf(pair, name, blocks):
    """A pool too small for every request at once: the scheduler's counts (over every group, net
    of the blocks a step frees) preempt and recompute, and every completion is still HF's."""
    hf, model = pair(name)
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=16, block_size=BS, num_blocks=blocks)
    ps = prompts(seed=3)
    outs = engine.generate(ps, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for p, out in zip(ps, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p), p
    engine.cache.check()
    assert engine.cache.num_free_blocks == blocks - 1


def test_engine_states_its_pool_per_layer_type(pair):
    """The line a server logs at start-up: tokens and bytes of the pool, and per layer type the
    bytes a token takes, as the config's arithmetic gives them (fp32 K and V, Hkv heads of D)."""
    _, model = pair("gemma3")
    cfg = model.config
    engine = Engine(model)
    line = engine.kv_pool_line()
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4 / 1024  # KiB a token takes in one layer
    glob = sum(w is None for w in cfg.windows)
    assert f"{glob} global layers {glob * per_layer:.1f} KiB/token" in line
    assert f"{cfg.num_layers - glob} sliding-{W} layers {(cfg.num_layers - glob) * per_layer:.1f} KiB/token" in line
    assert f"{engine.core.cache.memory_bytes() / 1e9:.2f} GB" in line
    assert line in repr(engine)


def test_a_pool_too_small_for_the_windows_says_how_many_blocks(pair):
    """num_blocks below what the windowed groups hold (window + one chunk each): the request's error
    names the count, and that count serves the request with HF's tokens."""
    hf, model = pair("gemma3")
    chunk = 16
    small = Engine(model, max_num_seqs=1, max_num_batched_tokens=chunk, block_size=BS, num_blocks=8)
    prompt = prompts(seed=5)[0]
    with pytest.raises(ValueError, match=r"too few for this model's windowed layers.* num_blocks >= (\d+)") as err:
        small.generate([prompt], GREEDY)
    need = int(re.search(r"num_blocks >= (\d+)", str(err.value)).group(1))
    per_group = -(-(W - 1 + chunk) // BS) + 1  # a windowed group's blocks: its window and one chunk
    assert need == 5 * per_group + 1 + 1  # 5 windowed groups, the null block, one global block
    enough = Engine(model, max_num_seqs=1, max_num_batched_tokens=chunk, block_size=BS, num_blocks=need + 40)
    assert enough.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(hf, prompt)
