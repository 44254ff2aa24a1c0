"""16-bit K/V (kv_dtype "bfloat16" / "float16") in the caches and the engine, the default that picks
them for a quantized model, and the paged pool that becomes resident as it fills.

References: torch's own .to(bfloat16 / float16) for what is stored; the same model and steps with fp32
K/V for the logits (close: a 16-bit K/V element carries a relative error <= 2^-9 (bf16) or 2^-12
(fp16), which moves a SmolLM2-shaped tiny model's logits by ~1e-3 of their range); /proc/self/status
for resident memory."""

import pytest
import torch

import headwise
import transformers as tf
from headwise.cache import BlockPool, ContiguousKVCache, PagedKVCache
from headwise.kernels import layer as kernel_layer
from headwise.runtime.batch import ContiguousRunner
from headwise.runtime.config import DEFAULT_KV_TOKENS, EngineConfig, default_kv16

from ..helpers import save_hf, tiny_llama_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# SmolLM2's attention shape (9 heads over 3 KV heads of 64), 2 layers
SMOL_SHAPED = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(2)
    return save_hf(tmp_path_factory, "smol-shaped", tf.LlamaForCausalLM(tiny_llama_config(**SMOL_SHAPED)).eval())


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return headwise.load(tiny_dir)


@pytest.fixture(scope="module")
def tiny_q8(tiny_dir):
    return headwise.load(tiny_dir, weights="q8_0")


@pytest.mark.parametrize("kv", list(DTYPES))
def test_caches_store_torch_rounding_and_read_it_back(kv):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 3, 5, 64, generator=g) * 3 for _ in range(2))
    want_k, want_v = k.to(DTYPES[kv]).float(), v.to(DTYPES[kv]).float()
    paged = PagedKVCache(1, 3, 64, num_blocks=8, block_size=4, kv_dtype=kv)
    for s in ("a", "b"):
        paged.add_sequence(s)
    paged.batch(["a", "b"], num_new=5).layer(0).update(k, v)
    for b, s in enumerate(("a", "b")):
        got_k, got_v = paged.read_sequence(s)
        assert torch.equal(got_k, want_k[b]) and torch.equal(got_v, want_v[b])
    cont = ContiguousKVCache(1, 2, 3, 8, 64, kv_dtype=kv)
    read = cont.update(k, v)
    assert cont.layers[0].store.k[0].dtype == DTYPES[kv]
    assert torch.equal(read.k[:, :, :5], want_k) and torch.equal(read.v[:, :, :5], want_v)
    assert paged.memory_bytes() == 2 * 8 * 4 * 3 * 64 * 2  # K and V, 2 bytes an element


def _run(model, kv, prompts, steps, feed=None):
    """Prefill `prompts` through a paged cache of kv_dtype `kv`, then `steps` decode steps of all of
    them at once (the one-call decode stack), each the greedy token, or feed[i] (B,) where given ->
    (logits per step (steps + 1, B, V), the cache)."""
    cache = PagedKVCache(2, 3, 64, num_blocks=64, block_size=16, kv_dtype=kv)
    ids = [f"s{i}" for i in range(len(prompts))]
    for s, p in zip(ids, prompts):
        cache.add_sequence(s)
    out = []
    with torch.inference_mode():
        step = cache.packed(ids, [len(p) for p in prompts], prompts)
        logits = model(torch.tensor([sum(prompts, [])]), step)[0]  # (N, V)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        out.append(logits[ends])
        for _ in range(steps):
            nxt = out[-1].argmax(-1) if feed is None else feed[len(out) - 1]
            step = cache.packed(ids, [1] * len(ids), [[t] for t in nxt.tolist()])
            out.append(model(nxt[None], step)[0])
    return torch.stack(out), cache


@pytest.mark.parametrize("kv", list(DTYPES))
def test_16bit_kv_logits_close_to_fp32_kv_and_greedy_tokens_equal(tiny, kv, monkeypatch):
    calls = []
    real = kernel_layer._call_stack
    monkeypatch.setattr(kernel_layer, "_call_stack", lambda *a: calls.append(1) or real(*a))
    prompts = [[5, 9, 3, 7, 1, 2, 40, 41, 17], [3, 3, 8]]
    ref, _ = _run(tiny, None, prompts, 12)
    n = len(calls)
    got, _ = _run(tiny, kv, prompts, 12, feed=ref.argmax(-1))  # the same tokens in: logits comparable
    assert len(calls) - n == 12  # every decode step of the 16-bit run went through the C stack
    diff, span = float((got - ref).abs().max()), float(ref.abs().max())
    assert diff < (3e-2 if kv == "bfloat16" else 4e-3) * span  # measured 1.4e-2, 1.2e-3
    top2 = ref.topk(2, -1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * diff  # where no rounding of this size can swap the top two
    assert clear.float().mean() > 0.8 and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("kv", list(DTYPES))
def test_decode_kernel_writes_what_torch_rounds(tiny, kv):
    """A one-token prompt is a decode row: the C stack writes its keys and values (hw_store_row_16);
    layer 0's inputs are the same in both runs, so its stored K/V equal fp32's rounded by torch."""
    _, ref = _run(tiny, None, [[11], [7]], 0)
    _, got = _run(tiny, kv, [[11], [7]], 0)
    for s in ("s0", "s1"):
        for mine, theirs in zip(got.read_sequence(s, 0), ref.read_sequence(s, 0)):
            assert torch.equal(mine, theirs.to(DTYPES[kv]).float())


def test_default_is_16bit_for_a_quantized_model_only(tiny, tiny_q8):
    small = dict(max_num_seqs=2, num_blocks=8)
    assert headwise.Engine(tiny, **small).cache.kv_dtype is None
    assert headwise.Engine(tiny_q8, **small).cache.kv_dtype == default_kv16()
    assert headwise.Engine(tiny_q8, kv_dtype="float32", **small).cache.kv_dtype is None
    assert headwise.Engine(tiny, kv_dtype="fp16", **small).cache.kv_dtype == "float16"
    assert ContiguousRunner(tiny, 1, 16).cache.kv_dtype is None  # generate()'s cache
    assert ContiguousRunner(tiny_q8, 1, 16).cache.kv_dtype == default_kv16()
    # the q8_0 model's greedy run: the engine's 16-bit pool and generate()'s 16-bit cache agree
    params = headwise.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    engine = headwise.Engine(tiny_q8, **small)
    rid = engine.add_request([4, 8, 15, 16, 23, 42], params)
    while engine.has_unfinished():
        engine.step()
    assert engine.result(rid).token_ids == headwise.generate(tiny_q8, [[4, 8, 15, 16, 23, 42]], params)[0].token_ids


def test_pool_sized_in_the_dtype_stored(tiny):
    cfg = tiny.config
    budget = EngineConfig(memory_budget_bytes=1 << 22)
    fp32 = budget.blocks_for(cfg, torch.float32)
    assert budget.replace(kv_dtype="bfloat16").blocks_for(cfg, torch.float32) == 2 * fp32
    per_token16 = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    default = EngineConfig(max_num_seqs=256, kv_dtype="bf16").blocks_for(cfg, torch.float32)
    assert default * 16 == min(DEFAULT_KV_TOKENS, 256 * cfg.max_positions)  # a stated token budget
    assert default * 16 * per_token16 <= (1 << 30)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _padded_run(model, cache):
    """Two prompts of 7 and 2 tokens as one right-padded batch step (the read's tiles hold masked
    slots: each meets a 0 weight), then 40 greedy steps -> logits of every step."""
    prompts, out = [[1, 2, 3, 4, 5, 6, 7], [9, 8]], []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            cache.add_sequence(i, p)
        step = cache.batch([0, 1], num_new=[7, 2], token_ids=prompts)
        logits = model(torch.tensor([prompts[0], prompts[1] + [0] * 5]), step)  # (2, 7, V)
        out.append(logits[[0, 1], [6, 1]])
        for _ in range(40):
            nxt = out[-1].argmax(-1)
            out.append(model(nxt[:, None], cache.batch([0, 1], token_ids=[[t] for t in nxt.tolist()]))[:, -1])
    return torch.stack(out)


def test_pool_becomes_resident_as_it_fills_and_unwritten_memory_is_never_read(tiny):
    pool_bytes = 2 * 2 * 3 * 64 * 4 * 16 * 4096  # 2 layers' K and V, fp32, 4096 blocks of 16: 192 MiB
    before = _rss()
    big = PagedKVCache(2, 3, 64, num_blocks=4096, block_size=16)
    assert big.memory_bytes() == pool_bytes
    assert _rss() - before < pool_bytes // 20
    want = _padded_run(tiny, PagedKVCache(2, 3, 64, num_blocks=16, block_size=16))
    assert torch.equal(_padded_run(tiny, big), want)
    assert _rss() - before < pool_bytes // 20  # 6 blocks written of 4096
    # what torch.empty gives may hold anything: NaN everywhere before any block is handed out
    poisoned = PagedKVCache(2, 3, 64, num_blocks=64, block_size=16)
    for plane in (*poisoned._k, *poisoned._v):
        plane.fill_(float("nan"))
    assert torch.equal(_padded_run(tiny, poisoned), want)


def test_block_pool_hands_out_lowest_ids_and_reports_first_use():
    pool, first = BlockPool(8), []
    pool.on_first_use = first.extend
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert (a, b, first) == ([0, 1, 2], [3, 4], [0, 1, 2, 3, 4])
    for x in (4, 1, 0):
        pool.release(x)
    assert pool.allocate(2) == [0, 1]  # used before, lowest first: no new block touched
    assert pool.allocate(2) == [4, 5] and first[-1] == 5
    pool.check()


def test_windowed_layers_16bit_engine_and_generate_agree(tmp_path_factory, monkeypatch):
    """A Mistral-shaped model with a sliding window of 8: the engine's hybrid pool (a block table per
    group, windowed blocks given back) and generate()'s rings, both bf16 and decoded by the C stack,
    give the same greedy tokens over many windows; the rings hold torch's rounding of fp32 K/V."""
    torch.manual_seed(7)
    hf = tf.MistralForCausalLM(tf.MistralConfig(**{**tiny_llama_config().to_dict(), "sliding_window": 8})).eval()
    model = headwise.load(save_hf(tmp_path_factory, "mistral-w8", hf))
    calls = []
    real = kernel_layer._call_stack
    monkeypatch.setattr(kernel_layer, "_call_stack", lambda *a: calls.append(1) or real(*a))
    params = headwise.SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1]]
    engine = headwise.Engine(
        model, max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_blocks=64, kv_dtype="bf16"
    )
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.kv_dtype == "bfloat16" and len(calls) >= 29
    for rid, p in zip(ids, prompts):
        assert engine.result(rid).token_ids == headwise.generate(model, [p], params, kv_dtype="bfloat16")[0].token_ids
    ring = ContiguousRunner(model, 1, 64, kv_dtype="bfloat16").cache
    k = torch.randn(1, 2, 3, 8)
    ring.layer(0).update(k, k)
    assert ring.layer(0).store.k[0].dtype == torch.bfloat16
    assert torch.equal(ring.layer(0).store.k[0][:, :, :3].float(), k.bfloat16().float())
