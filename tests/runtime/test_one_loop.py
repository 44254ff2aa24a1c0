"""generate() and the Engine are one loop (headwise.runtime): the same tokens, finish reasons
and usage for greedy and seeded sampling, stop strings that span tokens, a stop on exactly the
last allowed token, and the context limit. The reference for their tokens is transformers'
own greedy search (tests/generation checks generate() against it); here each is held to the
other, through two different caches (one contiguous batch vs the paged pool) and schedules."""

import pytest

import headwise
from headwise import Engine, SamplingParams

from ..engine.conftest import ragged_prompts

CHAT = [{"role": "user", "content": "Write a short story about a fox and a crow."}]


@pytest.fixture(scope="module")
def smol():
    return headwise.load("smollm2-135m-instruct")


def both(model, prompt, params, **engine_kw):
    """-> ([generate()'s results], [the engine's completions]) for one prompt."""
    got = headwise.generate(model, prompt, params)
    got = got if isinstance(got, list) else [got]
    engine = Engine(model, max_num_seqs=4, **engine_kw)
    out = engine.generate([prompt], params)[0]
    assert len(out.prompt_token_ids) == len(got[0].prompt_token_ids)  # usage: prompt tokens
    return got, out.outputs


def same(got, outs):
    assert len(got) == len(outs)
    for g, o in zip(got, outs):
        assert o.token_ids == g.token_ids and len(o.token_ids) == len(g.token_ids)  # usage: completion tokens
        assert o.text == g.text
        assert o.finish_reason == g.finish_reason


def test_greedy_chat(smol):
    got, outs = both(smol, CHAT, SamplingParams(max_new_tokens=24, temperature=0))
    same(got, outs)
    assert got[0].finish_reason == "length" and len(got[0].token_ids) == 24


def test_seeded_sampling_with_every_processor(smol):
    """n=3 completions drawn from seed + i through penalty, temperature, top-k, top-p and min-p,
    with logprobs: the same draws and (to rounding of the two caches' sums) the same logprobs."""
    params = SamplingParams(
        max_new_tokens=16,
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        min_p=0.02,
        repetition_penalty=1.15,
        seed=11,
        n=3,
        logprobs=2,
        ignore_eos=True,
    )
    got, outs = both(smol, CHAT, params)
    same(got, outs)
    assert len({tuple(g.token_ids) for g in got}) > 1  # the three seeds drew differently
    for g, o in zip(got, outs):
        for a, b in zip(g.logprobs, o.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def _stop_across_tokens(model):
    """A greedy run, and a stop string made of the end of one token and the start of the next."""
    base = headwise.generate(model, CHAT, max_new_tokens=40, temperature=0)
    tok = model.tokenizer
    texts = [tok.decode(base.token_ids[:i]) for i in range(1, len(base.token_ids) + 1)]
    i = next(i for i in range(6, len(texts)) if len(texts[i]) - len(texts[i - 1]) >= 3 and len(texts[i - 1]) >= 2)
    edge = len(texts[i - 1])
    stop = base.text[edge - 2 : edge + 2]
    assert base.text.find(stop) == edge - 2  # the first place it occurs straddles the seam
    return base, stop, i + 1  # the stop completes on token i+1 (1-based count of new tokens)


def test_stop_strings_across_tokens_and_on_the_last_allowed_token(smol):
    base, stop, at = _stop_across_tokens(smol)
    for max_new in (40, at):  # a stop mid-run, and one on exactly the last allowed token: "stop", not "length"
        got, outs = both(smol, CHAT, SamplingParams(max_new_tokens=max_new, temperature=0, stop=(stop,)))
        same(got, outs)
        assert got[0].finish_reason == "stop" and got[0].text == base.text[: base.text.find(stop)]
        assert len(got[0].token_ids) == at
    got, outs = both(smol, CHAT, SamplingParams(max_new_tokens=at - 1, temperature=0, stop=(stop,)))
    same(got, outs)
    assert got[0].finish_reason == "length" and len(got[0].token_ids) == at - 1


def test_the_context_limit(tiny_llama):
    """One rule: a prompt plus max_new_tokens over max_model_len is refused up front with the
    same words; exactly at the limit, both run to it and finish "length"."""
    limit = tiny_llama.config.max_positions
    prompt = (ragged_prompts(tiny_llama.config.vocab_size)[5] * 20)[: limit - 6]
    at_limit = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    got, outs = both(tiny_llama, prompt, at_limit, num_blocks=64, block_size=16)
    same(got, outs)
    assert got[0].finish_reason == "length" and len(got[0].token_ids) == 6
    over = SamplingParams(max_new_tokens=7, temperature=0)
    want = f"has {len(prompt)} tokens; with max_new_tokens=7 that exceeds max_model_len={limit}"
    with pytest.raises(ValueError, match=want):
        headwise.generate(tiny_llama, prompt, over)
    with pytest.raises(ValueError, match=want):
        Engine(tiny_llama, num_blocks=64, block_size=16).generate([prompt], over)


class BanRepeats:
    """A per-request processor: never the same token twice in a row. Records the rows it saw."""

    def __init__(self):
        self.calls = []

    def __call__(self, logits, requests):
        self.calls.append([list(r.output_token_ids) for r in requests])
        for i, r in enumerate(requests):
            if r.output_token_ids:
                logits[i, r.output_token_ids[-1]] = float("-inf")
        return logits


def test_a_request_s_own_processor_sees_its_tokens_batched_across_requests(tiny_llama):
    """SamplingParams.logits_processors: called once per step over every row that carries it
    (here two requests of three), seeing each request's tokens so far; its mask holds, and the
    request without it draws as it would alone. generate() runs the same chain."""
    V = tiny_llama.config.vocab_size
    prompts = ragged_prompts(V, seed=3)[6:9]
    ban = BanRepeats()
    with_ban = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logits_processors=(ban,))
    plain = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine(tiny_llama, max_num_seqs=4, num_blocks=64, block_size=4)
    outs = engine.generate(prompts, [with_ban, plain, with_ban])
    assert max(len(rows) for rows in ban.calls) == 2  # both carriers in one call
    for rows in ban.calls:
        assert all(len(r) == len(rows[0]) for r in rows)  # the rows' tokens so far, step by step
    for i in (0, 2):
        ids, free = outs[i].token_ids, headwise.generate(tiny_llama, prompts[i], plain).token_ids
        assert any(a == b for a, b in zip(free, free[1:]))  # without it, this prompt repeats
        assert all(a != b for a, b in zip(ids, ids[1:]))
    assert outs[1].token_ids == headwise.generate(tiny_llama, prompts[1], plain).token_ids
    for i in (0, 2):
        alone = headwise.generate(
            tiny_llama, prompts[i], SamplingParams(**{**vars(with_ban), "logits_processors": (BanRepeats(),)})
        )
        assert alone.token_ids == outs[i].token_ids


def test_a_weight_edited_in_place_between_requests_is_seen(tmp_path_factory):
    """An fp32 weight edited in place (no invalidate) after a run: the next generate() call and
    the engine's next request compute with the new numbers (the pool's prefix cache forgets K/V of
    the old weights) -- the same tokens as the reference
    executor (the modules as written, which a no-op hook forces) -- not a stale fused copy."""
    import torch
    import transformers as tf

    from ..helpers import save_hf, tiny_llama_config

    torch.manual_seed(2)
    model = headwise.load(save_hf(tmp_path_factory, "edit", tf.LlamaForCausalLM(tiny_llama_config()).eval()))
    prompt = ragged_prompts(model.config.vocab_size, seed=5)[4]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine(model, max_num_seqs=2, num_blocks=64, block_size=4)
    before = headwise.generate(model, prompt, greedy).token_ids
    assert engine.generate([prompt], greedy)[0].token_ids == before
    with torch.no_grad():
        model.layers[0].mlp.down.weight.mul_(-3.0)  # in place: the same tensor, a new version
    after = headwise.generate(model, prompt, greedy).token_ids
    handle = model.layers[1].register_forward_hook(lambda m, a, out: None)  # -> the reference executor
    try:
        reference = headwise.generate(model, prompt, greedy).token_ids
    finally:
        handle.remove()
    assert after == reference != before
    # the engine's next request, the same prompt: its prefix blocks of the old weights are not reused
    hits = engine.stats().prefix_cache_hits
    assert engine.generate([prompt], greedy)[0].token_ids == reference
    assert engine.stats().prefix_cache_hits == hits
    assert engine.generate([prompt], greedy)[0].token_ids == reference  # and now they are again
    assert engine.stats().prefix_cache_hits > hits
