"""The official `openai` client against a live server; outputs checked against
headwise.generate / headwise.embed run in this process, one prompt at a time."""

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch

import headwise

from .conftest import auth

CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name three colors."}]


def test_models_are_listed(client, main):
    ids = {m.id for m in client.models.list()}
    assert ids == set(main.config.model_names())
    assert {"smollm2", "minilm", "peer/tiny", "spread"} <= ids


def test_chat_greedy_equals_generate(client, smol):
    ref = headwise.generate(smol, CHAT, max_new_tokens=24, temperature=0)
    res = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0)
    choice = res.choices[0]
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert choice.finish_reason == ref.finish_reason
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == len(ref.token_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    assert res.model == "smollm2" and res.object == "chat.completion"


def test_chat_stream_with_usage_equals_generate(client, smol):
    ref = headwise.generate(smol, CHAT, max_new_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=CHAT,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in body)
    assert len({c.id for c in chunks}) == 1


def test_completions_greedy_equal_generate_for_text_ids_and_lists(client, smol):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    refs = [headwise.generate(smol, p, max_new_tokens=12, temperature=0) for p in prompts]
    one = client.completions.create(model="smollm2", prompt=prompts[0], max_tokens=12, temperature=0)
    assert one.choices[0].text == refs[0].text and one.usage.completion_tokens == len(refs[0].token_ids)
    ids = client.completions.create(model="smollm2", prompt=refs[1].prompt_token_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == refs[1].text
    both = client.completions.create(model="smollm2", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [r.text for r in refs]
    assert both.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


def test_completion_stream_and_stop_string(client, smol):
    prompt = "1, 2, 3, 4,"
    ref = headwise.generate(smol, prompt, max_new_tokens=16, temperature=0, stop=[" 7"])
    chunks = list(
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop=" 7", stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason == "stop"


def test_chat_logprobs_match_generate(client, smol):
    ref = headwise.generate(smol, CHAT, max_new_tokens=6, temperature=0, logprobs=3)
    res = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    got = res.choices[0].logprobs.content
    assert len(got) == len(ref.logprobs)
    tok = smol.tokenizer
    for g, r in zip(got, ref.logprobs):
        assert g.token == tok.decode([r.token_id])
        assert g.logprob == pytest.approx(r.logprob, abs=1e-3)
        assert [t.token for t in g.top_logprobs] == [tok.decode([i]) for i, _ in r.top]
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([lp for _, lp in r.top], abs=1e-3)


def test_seeded_sampling_repeats_and_n_gives_n_choices(client, smol):
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=0.9, seed=7, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in a.choices)
    assert 3 <= a.usage.completion_tokens <= 30 and a.usage.completion_tokens == b.usage.completion_tokens
    assert a.usage.prompt_tokens == len(smol.tokenizer.encode("Once upon a time"))


def test_embeddings_equal_embed(client, main, minilm):
    texts = ["A man is eating food.", "Someone is having a meal.", "The stock market fell."]
    ref = headwise.embed(minilm, texts)
    res = client.embeddings.create(model="minilm", input=texts)  # the client asks for base64
    got = torch.tensor([d.embedding for d in res.data])
    assert [d.index for d in res.data] == [0, 1, 2]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert res.usage.prompt_tokens == sum(len(minilm.tokenizer.encode(t)) for t in texts)
    raw = httpx.post(
        main.url + "/v1/embeddings",
        headers=auth(),
        json={"model": "minilm", "input": texts[0], "encoding_format": "float"},
    ).json()
    torch.testing.assert_close(torch.tensor(raw["data"][0]["embedding"]), ref[0], atol=1e-5, rtol=1e-5)
    b64 = httpx.post(
        main.url + "/v1/embeddings",
        headers=auth(),
        json={"model": "minilm", "input": texts[0], "encoding_format": "base64"},
    ).json()
    vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(vec.copy()), ref[0], atol=1e-5, rtol=1e-5)


def test_16_concurrent_streams_equal_one_at_a_time(aclient, smol):
    prompts = [f"Write one short sentence about the number {i}." for i in range(16)]
    refs = [
        headwise.generate(smol, [{"role": "user", "content": p}], max_new_tokens=8, temperature=0).text for p in prompts
    ]

    async def one(c, p):
        stream = await c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": p}], max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all():
        async with aclient() as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(run_all())
    assert got == refs
