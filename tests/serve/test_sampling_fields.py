"""OpenAI's sampling fields against a live `headwise serve` (SmolLM2 fp32), through the official
openai client: logit_bias (ban greedy's token: the next best comes; +100: every token is the
forced one), presence_penalty and frequency_penalty (at temperature 0 the answer is the argmax
of OpenAI's formula, `logits - presence * (count > 0) - frequency * count` over the output
so far, computed here with a plain forward per step), top_logprobs, seeds; bad values are 400s
in OpenAI's envelope naming the param; the gateway forwards the fields unchanged upstream."""

from __future__ import annotations

import collections
import json

import httpx
import openai
import pytest
import torch

from .conftest import LiveServer, auth

PROMPT = "one one one one one one one one one one one one"
CHAT = [{"role": "user", "content": "Name three colours."}]


def formula_greedy(model, prompt: list[int], n: int, presence=0.0, frequency=0.0) -> list[int]:
    """n tokens, each the argmax of OpenAI's formula on a whole-sequence forward (no cache)."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1].double()
        for t, c in collections.Counter(out).items():
            logits[t] -= presence * (c > 0) + frequency * c
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def token_ids(client, **kw) -> list[int]:
    """The completion's token ids, from a stream's headwise.token_ids (ours: exact ids, no decoding)."""
    ids = []
    stream = client.completions.create(model="smollm2", stream=True, extra_body={"headwise": {"token_ids": True}}, **kw)
    for chunk in stream:
        ids += (getattr(chunk, "headwise", None) or chunk.model_extra.get("headwise") or {}).get("token_ids", [])
    return ids


def test_logit_bias_bans_greedys_token_for_the_next_best(client, smol):
    first = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=1, temperature=0, logprobs=True, top_logprobs=3
    )
    top = first.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == 3 and first.choices[0].logprobs.content[0].token == top[0].token
    best_id = smol.tokenizer.encode(top[0].token, add_special_tokens=False)
    assert len(best_id) == 1 and smol.tokenizer.decode(best_id) == top[0].token
    best_id = best_id[0]
    banned = client.chat.completions.create(
        model="smollm2",
        messages=CHAT,
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        logit_bias={str(best_id): -100},
    )
    got = banned.choices[0].logprobs.content[0]
    assert got.token == top[1].token  # the next best
    # logprobs stay the model's own (OpenAI's and vLLM's default): the banned token still ranks first
    assert [t.token for t in got.top_logprobs] == [t.token for t in top]


def test_logit_bias_plus_100_forces_every_token(client, smol):
    forced = smol.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert token_ids(client, prompt="Hello", max_tokens=6, temperature=0, logit_bias={str(forced): 100}) == [forced] * 6
    chat = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=4, temperature=0.8, seed=3, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == smol.tokenizer.decode([forced] * 4)


@pytest.mark.parametrize("presence, frequency", [(0.0, 0.0), (2.0, 0.0), (0.0, 1.0), (1.0, 0.5)])
def test_penalties_follow_the_formula_at_temperature_0(client, smol, presence, frequency):
    prompt = smol.tokenizer.encode(PROMPT, add_special_tokens=False)
    got = token_ids(
        client, prompt=prompt, max_tokens=8, temperature=0, presence_penalty=presence, frequency_penalty=frequency
    )
    assert got == formula_greedy(smol, prompt, 8, presence, frequency)


def test_penalties_change_a_repeating_answer(client):
    kw = dict(prompt=PROMPT, max_tokens=12, temperature=0)
    plain = collections.Counter(token_ids(client, **kw)).most_common(1)[0][1]
    assert plain >= 4  # the prompt makes greedy repeat itself
    pen = collections.Counter(token_ids(client, frequency_penalty=2.0, presence_penalty=2.0, **kw))
    assert pen.most_common(1)[0][1] <= 2  # counted once generated, then pushed down


def test_seeds_per_request_in_one_batch(aclient, client):
    """Four concurrent requests (two seeds, twice each): each equals its own request sent alone."""
    import asyncio

    kw = dict(model="smollm2", prompt="The weather today", max_tokens=12, temperature=1.0)
    alone = {s: client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2)}

    async def together():
        c = aclient()
        outs = await asyncio.gather(*(c.completions.create(seed=s, **kw) for s in (1, 2, 1, 2)))
        return [o.choices[0].text for o in outs]

    assert asyncio.run(together()) == [alone[1], alone[2], alone[1], alone[2]]
    assert alone[1] != alone[2]


def test_top_logprobs(client):
    r = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 4 and t.token == t.top_logprobs[0].token  # greedy: the top one
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    for k in (0, 2):  # completions: the top k plus the sampled token, which OpenAI always returns
        c = client.completions.create(
            model="smollm2", prompt="Hello", max_tokens=6, temperature=0.9, seed=5, logprobs=k
        )
        lp = c.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == logprob and max(k, 1) <= len(top) <= k + 1


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("logit_bias", {"5": 150}, "logit_bias"),
        ("logit_bias", {"49152": 1}, "'49152' is outside the vocabulary (size 49152)"),
        ("logit_bias", {"abc": 1}, "'abc' is not a token id"),
        ("logit_bias", {"-4": 1}, "'-4' is not a token id"),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_values_are_400s_naming_the_param(client, field, value, words, endpoint):
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    where = {"messages": CHAT} if endpoint == "chat" else {"prompt": "Hello"}
    with pytest.raises(openai.BadRequestError) as e:
        create(model="smollm2", max_tokens=2, extra_body={field: value}, **where)
    body = e.value.body
    assert e.value.status_code == 400 and body["param"].startswith(field) and body["type"] == "invalid_request_error"
    assert words in body["message"]


# ---------------------------------------------------------------- through the gateway
def _recording_upstream(seen: list):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request):
        seen.append(await request.json())
        return JSONResponse(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": "up",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])


def test_gateway_forwards_the_fields_unchanged():
    from headwise.serve import create_app, parse_config

    seen: list = []
    upstream = LiveServer(_recording_upstream(seen)).start()
    config = {
        "server": {"api_key_env": ""},
        "providers": {"up": {"base_url": upstream.url + "/v1", "models": ["m"], "timeout": 10}},
    }
    gateway = LiveServer(create_app(parse_config(config))).start()
    try:
        fields = {
            "logit_bias": {"123": -100, "50000": 7.5},  # an id past SmolLM2's vocabulary: the upstream's to judge
            "presence_penalty": 1.25,
            "frequency_penalty": -0.5,
            "seed": 42,
            "logprobs": True,
            "top_logprobs": 5,
        }
        r = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "up/m", "messages": CHAT, **fields})
        assert r.status_code == 200, r.text
        assert {k: seen[-1][k] for k in fields} == json.loads(json.dumps(fields))
    finally:
        gateway.stop()
        upstream.stop()


def test_main_gateway_applies_the_fields_upstream(client, main, smol):
    """Through `main` to its peer (another headwise server): the bias is applied there."""
    r = httpx.post(
        main.url + "/v1/completions",
        json={"model": "peer/tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "logit_bias": {"42": 100}},
        headers=auth(),
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == smol.tokenizer.decode([42] * 5)


def test_a_resumed_completion_counts_what_was_generated_before(client, smol):
    """The gateway's failover continues a completion after its ids (headwise.resume): the penalties
    still count those ids as output, so the rest is what the whole run would have generated."""
    prompt = smol.tokenizer.encode(PROMPT, add_special_tokens=False)
    kw = dict(prompt=prompt, max_tokens=12, temperature=0, presence_penalty=0.8, frequency_penalty=0.6)
    full = token_ids(client, **kw)
    resume = {"token_ids": full[:5], "text_chars": 0}
    rest = []
    stream = client.completions.create(
        model="smollm2", stream=True, extra_body={"headwise": {"token_ids": True, "resume": resume}}, **kw
    )
    for chunk in stream:
        rest += (chunk.model_extra.get("headwise") or {}).get("token_ids", [])
    assert full[:5] + rest == full and len(set(full)) > 3
