"""OpenAI's logit_bias, presence_penalty and frequency_penalty, held to OpenAI's formula written
out here (https://platform.openai.com/docs/advanced-usage):

    logits[j] - presence * (count[j] > 0) - frequency * count[j] + logit_bias[j]

with count[j] the times token j was generated so far (the output only, as OpenAI and vLLM).
transformers has no presence/frequency processors, so the reference is that line, on random
logits and histories and on transformers' own GPT-2 forward; plus seeds per request in one
engine batch: each row draws what it draws alone."""

import collections

import pytest
import torch

import headwise
from headwise import Engine, SamplingParams
from headwise.runtime.sampler import Row, Sampler

V = 50


def openai_logits(
    logits: torch.Tensor, output: list[int], presence: float, frequency: float, bias: dict
) -> torch.Tensor:
    """OpenAI's formula for one row (V,), counting in Python."""
    out = logits.double().clone()
    for j, c in collections.Counter(output).items():
        out[j] -= presence * (c > 0) + frequency * c
    for j, b in bias.items():
        out[j] += b
    return out


def random_case(seed: int, R: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g) * 3
    rows = []
    for _ in range(R):
        n = int(torch.randint(0, 12, (1,), generator=g))
        output = torch.randint(0, 8, (n,), generator=g).tolist()  # few ids: repeats
        presence, frequency = (torch.rand(2, generator=g) * 4 - 2).tolist()
        ids = torch.randperm(V, generator=g)[: int(torch.randint(0, 4, (1,), generator=g))].tolist()
        bias = {t: float(torch.rand(1, generator=g) * 200 - 100) for t in ids}
        rows.append((output, presence, frequency, bias))
    return logits, rows


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("counts", ["running", "from_ids"])
def test_greedy_tokens_and_logprobs_follow_the_formula(seed, counts):
    logits, cases = random_case(seed)
    rows = []
    for output, presence, frequency, bias in cases:
        params = SamplingParams(
            temperature=0, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias, logprobs=3
        )
        running = None
        if counts == "running":  # as the engine keeps them: one += per generated token
            running = torch.zeros(V)
            for t in output:
                running[t] += 1
        rows.append(Row(params, output_token_ids=output, output_counts=running))
    tokens, logprobs = Sampler().sample(logits, rows)
    for b, (output, presence, frequency, bias) in enumerate(cases):
        ref = openai_logits(logits[b], output, presence, frequency, bias)
        assert tokens[b] == int(ref.argmax())
        # logprobs are of the model's own distribution (OpenAI's, vLLM's default), before bias
        raw = logits[b].double().log_softmax(-1)
        assert logprobs[b].logprob == pytest.approx(float(raw[tokens[b]]), abs=1e-5)
        assert [t for t, _ in logprobs[b].top] == raw.topk(3).indices.tolist()


@pytest.mark.parametrize("seed", range(10))
def test_seeded_draws_follow_the_formula(seed):
    """At temperature 0.7 each row's draw is the draw from softmax(formula / 0.7) with its own seed."""
    logits, cases = random_case(seed)
    rows = [
        Row(
            SamplingParams(temperature=0.7, presence_penalty=p, frequency_penalty=f, logit_bias=bias, seed=seed + b),
            generator=torch.Generator().manual_seed(seed + b),
            output_token_ids=output,
        )
        for b, (output, p, f, bias) in enumerate(cases)
    ]
    tokens, _ = Sampler().sample(logits, rows)
    for b, (output, p, f, bias) in enumerate(cases):
        probs = (openai_logits(logits[b], output, p, f, bias) / 0.7).softmax(-1).float()
        want = int(torch.multinomial(probs[None], 1, generator=torch.Generator().manual_seed(seed + b)))
        assert tokens[b] == want


def test_unused_fields_leave_the_plain_path():
    """Zero penalties and an empty bias are the neutral values: the same as not setting them."""
    p = SamplingParams(temperature=0, presence_penalty=0.0, frequency_penalty=0, logit_bias={})
    assert p.plain and p.logit_bias is None and not p.penalized


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"logit_bias": {5: 101}}, "logit_bias values must be in [-100, 100], got 101 for token 5"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids (ints >= 0), got -1"),
        ({"logit_bias": {"5": 1}}, "logit_bias keys must be token ids (ints >= 0), got '5'"),
    ],
)
def test_bad_values_name_the_field_and_range(fields, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert str(e.value) == message


# ---------------------------------------------------------------- whole runs
def reference_greedy(hf, prompt: list[int], n: int, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """transformers' forward over the whole sequence each step, OpenAI's formula, argmax."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        t = int(openai_logits(logits, out, presence, frequency, bias or {}).argmax())
        ids.append(t)
        out.append(t)
    return out


PROMPT = [5, 17, 3, 88, 41, 9, 60, 2]


def test_generate_with_logit_bias_bans_and_forces(gpt2_pair):
    hf, model = gpt2_pair
    plain = headwise.generate(model, PROMPT, max_new_tokens=12, temperature=0).token_ids
    assert plain == reference_greedy(hf, PROMPT, 12)
    banned = {plain[0]: -100.0}
    got = headwise.generate(model, PROMPT, max_new_tokens=12, temperature=0, logit_bias=banned).token_ids
    assert got == reference_greedy(hf, PROMPT, 12, bias=banned)
    assert plain[0] not in got and got[0] != plain[0]  # the next best, and never the banned one again
    forced = {7: 100.0}
    assert headwise.generate(model, PROMPT, max_new_tokens=12, temperature=0, logit_bias=forced).token_ids == [7] * 12


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.2), (-1.0, 0.5), (0.7, -0.4)])
def test_generate_with_penalties_equals_the_formula(gpt2_pair, presence, frequency):
    hf, model = gpt2_pair
    got = headwise.generate(
        model, PROMPT, max_new_tokens=24, temperature=0, presence_penalty=presence, frequency_penalty=frequency
    ).token_ids
    assert got == reference_greedy(hf, PROMPT, 24, presence, frequency)


def test_requests_in_one_engine_batch_equal_their_solo_runs(tiny_llama):
    """Different seeds, penalties and biases side by side in one engine's steps: each request's
    tokens and logprobs are those of its own run alone (generate())."""
    V = tiny_llama.config.vocab_size
    prompts = [[1 + i, 7, 30 + i, 12] for i in range(5)]
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.9, seed=1, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.9, seed=2, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(
            max_new_tokens=20, temperature=0, frequency_penalty=0.8, logit_bias={V - 1: 5.0}, ignore_eos=True
        ),
        SamplingParams(max_new_tokens=20, temperature=1.0, seed=4, top_k=20, logit_bias={3: -100}, ignore_eos=True),
    ]
    engine = Engine(tiny_llama, max_num_seqs=8)
    rids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    for rid, prompt, sampling in zip(rids, prompts, params):
        batched = engine.result(rid).outputs[0]
        solo = headwise.generate(tiny_llama, prompt, sampling)
        assert batched.token_ids == solo.token_ids
        if sampling.logprobs is not None:
            assert [lp.token_id for lp in batched.logprobs] == [lp.token_id for lp in solo.logprobs]
    assert len({tuple(engine.result(r).outputs[0].token_ids) for r in rids[:2]}) == 2  # seeds 1 and 2 differ
    assert 3 not in engine.result(rids[4]).outputs[0].token_ids


def test_engine_rejects_a_bias_outside_the_vocabulary(tiny_llama):
    V = tiny_llama.config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {V} is out of range"):
        Engine(tiny_llama).add_request([1, 2], SamplingParams(logit_bias={V: 1.0}))
