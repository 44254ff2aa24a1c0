"""Engine.generate on tiny random models against headwise.generate run one prompt at a time
(and, for greedy GPT-2, against transformers' own generate): continuous batching, chunked
prefill, preemption, prefix sharing and per-request sampling must change no output."""

import pytest
import torch

import headwise
import transformers as tf
from headwise import Engine, SamplingParams

from .conftest import all_blocks_free, ragged_prompts, reference

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def assert_same_as_reference(model, prompts, params, outs):
    params = params if isinstance(params, list) else [params] * len(prompts)
    assert len(outs) == len(prompts)
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs)):
        refs = reference(model, p, sp)
        assert out.prompt_token_ids == list(p)
        assert len(out.outputs) == len(refs) == sp.n
        for j, (got, ref) in enumerate(zip(out.outputs, refs)):
            assert got.token_ids == ref.token_ids, f"prompt {i} (len {len(p)}), completion {j}"
            assert got.finish_reason == ref.finish_reason
            assert got.text == ref.text


def test_greedy_equals_generate_one_at_a_time(tiny):
    """12 prompts of 1-64 tokens, six sharing a 33-token prefix, different max_new_tokens; a
    budget of 32 tokens per step forces chunked prefill mixed with decodes, and max_num_seqs=8
    admits new requests as others finish."""
    prompts = ragged_prompts(tiny.config.vocab_size)
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in (12, 5, 12, 1, 9, 12, 3, 12, 7, 12, 12, 2)]
    engine = Engine(tiny, num_blocks=128, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    outs = engine.generate(prompts, params)
    assert_same_as_reference(tiny, prompts, params, outs)
    assert all_blocks_free(engine)
    assert engine.stats().steps < sum(len(p) for p in prompts)  # really batched


@torch.no_grad()
def test_greedy_gpt2_equals_transformers(gpt2_pair):
    """The same, against transformers' generate with the same weights."""
    hf, model = gpt2_pair
    prompts = ragged_prompts(96, seed=3)
    outs = Engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=24, max_num_seqs=8).generate(
        prompts, GREEDY
    )
    for p, out in zip(prompts, outs):
        ids = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            pad_token_id=0,
        )
        assert out.token_ids == ids[0, len(p) :].tolist()


def test_pool_too_small_preempts_and_outputs_stay_identical(tiny):
    """30 blocks of 4 tokens cannot hold 12 sequences of up to 76 tokens: requests are
    preempted and recomputed, every one completes, outputs unchanged, every block freed."""
    prompts = ragged_prompts(tiny.config.vocab_size, seed=1)
    engine = Engine(tiny, num_blocks=30, block_size=4, max_num_batched_tokens=32, max_num_seqs=12)
    outs = engine.generate(prompts, GREEDY)
    assert_same_as_reference(tiny, prompts, GREEDY, outs)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.requests_finished == 12
    assert all_blocks_free(engine)


def test_prefix_sharing_across_batches(tiny_llama):
    """A second batch with the same 33-token prefix finds its 8 full blocks (of 4 tokens)
    in the prefix table: 32 tokens per request not recomputed (more for a prompt seen whole
    before), same outputs."""
    V = tiny_llama.config.vocab_size
    prompts = ragged_prompts(V, seed=2)
    prefix = prompts[-1][:33]
    engine = Engine(tiny_llama, num_blocks=256, block_size=4, max_num_batched_tokens=64)
    first = engine.generate(prompts[6:], GREEDY)
    assert_same_as_reference(tiny_llama, prompts[6:], GREEDY, first)
    before = engine.stats().prefix_cache_hits
    g = torch.Generator().manual_seed(5)
    second = [prefix + torch.randint(0, V, (n,), generator=g).tolist() for n in (2, 6, 10)] + prompts[6:8]
    outs = engine.generate(second, GREEDY)
    assert_same_as_reference(tiny_llama, second, GREEDY, outs)
    # new tails: the 8 prefix blocks; prompts seen before: every full block but the last token's
    expected = [32] * 3 + [(len(p) - 1) // 4 * 4 for p in prompts[6:8]]
    assert [o.num_cached_tokens for o in outs] == expected
    assert engine.stats().prefix_cache_hits - before == sum(expected)
    assert all_blocks_free(engine)


def test_per_request_sampling_equals_generate(tiny_llama):
    """Seeded sampling (temperature, top-k, top-p, min-p), repetition penalty, n > 1 and
    logprobs, all in one batch: each request draws what generate() draws for it alone."""
    prompts = ragged_prompts(tiny_llama.config.vocab_size, seed=4)[3:9]
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=11),
        SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, min_p=0.05, seed=12),
        SamplingParams(max_new_tokens=10, temperature=0, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=8, temperature=0.7, seed=13, n=3),
        SamplingParams(max_new_tokens=10, temperature=0, logprobs=3),
        SamplingParams(max_new_tokens=10, temperature=1.2, seed=14, logprobs=2, repetition_penalty=1.2),
    ]
    engine = Engine(tiny_llama, num_blocks=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=8)
    outs = engine.generate(prompts, params)
    assert_same_as_reference(tiny_llama, prompts, params, outs)
    for i in (4, 5):
        ref = reference(tiny_llama, prompts[i], params[i])[0]
        for got, want in zip(outs[i].outputs[0].logprobs, ref.logprobs):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert len({tuple(o.token_ids) for o in outs[3].outputs}) > 1  # n=3 draws differ
    assert all_blocks_free(engine)


def test_stop_token_ids_end_a_request(tiny_gpt2):
    prompt = ragged_prompts(96)[4]
    free_run = reference(tiny_gpt2, prompt, GREEDY)[0].token_ids
    stop = free_run[4]
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(stop,))
    out = Engine(tiny_gpt2, num_blocks=32, block_size=4).generate([prompt], params)[0]
    assert out.token_ids == free_run[: free_run.index(stop) + 1]
    assert out.finish_reason == "stop"
    assert_same_as_reference(tiny_gpt2, [prompt], params, [out])


def test_stats_count_what_happened(tiny_gpt2):
    prompts = ragged_prompts(96, seed=6)
    engine = Engine(tiny_gpt2, num_blocks=128, block_size=4)
    outs = engine.generate(prompts, GREEDY)
    s = engine.stats()
    assert s.prompt_tokens == sum(map(len, prompts))
    assert s.output_tokens == sum(len(o.token_ids) for o in outs) == 12 * 12
    assert s.requests_finished == 12 and s.requests_aborted == 0
    assert len(s.ttft_s) == 12 and len(s.itl_s) == 12 * 11
    assert all(t > 0 for t in s.ttft_s + s.itl_s)
    assert s.running == s.waiting == 0
    assert s.kv_blocks_total == 128 and s.kv_block_size == 4
    d = s.as_dict()
    assert d["prefix_cache_queries"] == sum(map(len, prompts)) and d["preemptions"] == 0


def test_pool_sized_from_memory_budget(tiny_llama):
    cfg = tiny_llama.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V, every layer
    engine = Engine(tiny_llama, memory_budget_bytes=100 * 16 * per_token * 4, block_size=16)
    assert engine.cache.num_blocks == 100
    assert engine.cache.memory_bytes() == 100 * 16 * per_token * 4
    int8 = Engine(tiny_llama, memory_budget_bytes=100 * 16 * per_token * 4, block_size=16, kv_dtype="int8")
    per_token_int8 = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)  # int8 + fp32 scale per head
    assert int8.cache.num_blocks == 100 * 16 * per_token * 4 // (16 * per_token_int8)
    assert int8.cache.memory_bytes() <= 100 * 16 * per_token * 4
    default = Engine(tiny_llama, max_num_seqs=4)  # enough for 4 full contexts
    assert default.cache.num_blocks == 4 * cfg.max_positions // 16
    assert default.max_model_len == cfg.max_positions
    out = int8.generate([ragged_prompts(128)[5]], GREEDY)[0]
    assert len(out.token_ids) == 12


def test_bad_input_names_the_problem(tiny_gpt2, tmp_path):
    engine = Engine(tiny_gpt2, num_blocks=16, block_size=4)
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="the prompt has 60 tokens; with max_new_tokens=12 .* max_model_len=64"):
        engine.add_request(list(range(60)), GREEDY)
    with pytest.raises(ValueError, match=r"token ids \[96, 200\] are out of range .* vocabulary of 96"):
        engine.add_request([1, 96, 200], GREEDY)
    with pytest.raises(ValueError, match="one prompt per request"):
        engine.add_request([[1, 2], [3]], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text", GREEDY)
    with pytest.raises(ValueError, match="sampling has 1 entries for 2 prompts"):
        engine.generate([[1], [2]], [GREEDY])
    with pytest.raises(ValueError, match="sampling must be a headwise.SamplingParams"):
        engine.add_request([1], {"temperature": 0})
    engine.add_request([1, 2], GREEDY, request_id="r1")
    with pytest.raises(ValueError, match="request id 'r1' is already in use"):
        engine.add_request([3], GREEDY, request_id="r1")
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 < max_num_seqs=16"):
        Engine(tiny_gpt2, max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        Engine(tiny_gpt2, num_blocks=0)
    with pytest.raises(ValueError, match="does not hold one KV block"):
        Engine(tiny_gpt2, memory_budget_bytes=10)
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        Engine(tiny_gpt2, num_blocks=4, kv_dtype="fp8")
    bert_path = tmp_path / "bert"
    tf.BertModel(
        tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=50)
    ).save_pretrained(bert_path)
    with pytest.raises(ValueError, match="decoder language models .* 'bert'"):
        Engine(headwise.load(bert_path))
    assert engine.stats().waiting == 1  # only r1 got in
