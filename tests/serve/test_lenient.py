"""Lenient where peers are (llama-server, vLLM, ollama), strict where it matters: OpenAI's fields
that do not change the answer are accepted and ignored, those that would are a 400 naming them;
`model` may be left out when one model can answer; client.models.retrieve; token-id input as
LangChain's OpenAIEmbeddings sends it. The official openai client is the judge throughout."""

import httpx
import openai
import pytest
import torch

import headwise
from headwise.serve import create_app, parse_config

from .conftest import LiveServer, auth

CHAT = [{"role": "user", "content": "Name a colour."}]


def test_known_fields_that_do_not_change_the_answer_are_ignored(client, smol):
    ref = headwise.generate(smol, CHAT, max_new_tokens=5, temperature=0).text
    got = client.chat.completions.create(
        model="smollm2",
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        prompt_cache_key="user-42-session",
        safety_identifier="hash-of-user",
        verbosity="low",
        modalities=["text"],
        reasoning_effort="none",
    )
    assert got.choices[0].message.content == ref
    done = client.completions.create(
        model="smollm2",
        prompt="Once upon",
        max_tokens=3,
        temperature=0,
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"},
    )
    assert done.choices[0].text == headwise.generate(smol, "Once upon", max_new_tokens=3, temperature=0).text


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"reasoning_effort": "high"}, "reasoning_effort"),  # would change a reasoning model's answer
        ({"modalities": ["text", "audio"]}, "modalities"),  # no audio output here
        ({"verbosity": "terse"}, "verbosity"),  # not one of OpenAI's values
        ({"frobnicate": True}, "frobnicate"),  # unknown fields stay a 400
    ],
)
def test_fields_that_would_change_the_answer_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400
    assert param in e.value.body["param"] + e.value.body["message"]


def test_models_retrieve(client, main):
    m = client.models.retrieve("smollm2")
    assert (m.id, m.object, m.owned_by) == ("smollm2", "model", "headwise")
    listed = {x.id: x for x in client.models.list().data}
    assert m.model_dump() == listed["smollm2"].model_dump()
    assert client.models.retrieve("peer/tiny").id == "peer/tiny"  # a slash in the id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]
    raw = httpx.get(main.url + "/v1/models/no-such-model", headers=auth())
    assert raw.status_code == 404 and set(raw.json()) == {"error"}


def test_embeddings_take_token_ids_as_langchain_sends_them(client, minilm):
    """OpenAIEmbeddings (langchain-openai) tokenizes and calls client.embeddings.create(input=[[ids],
    ...]); the openai client adds encoding_format="base64". Ids are this model's own."""
    texts = ["A man is eating food.", "The stock market fell."]
    ids = [list(e) for e in minilm.tokenizer.encode_batch(texts)]
    ref = headwise.embed(minilm, texts)
    res = client.embeddings.create(model="minilm", input=ids)
    torch.testing.assert_close(torch.tensor([d.embedding for d in res.data]), ref, atol=1e-5, rtol=1e-5)
    assert res.usage.prompt_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(model="minilm", input=ids[0])  # one list of ids: one input
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), ref[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="minilm", input=[ids[0], [101, 10**6, 102]])
    assert e.value.body["param"] == "input[1]" and "vocabulary" in e.value.body["message"]
    assert "check_embedding_ctx_length=False" in e.value.body["message"]  # what a LangChain user changes


def test_completions_take_lists_of_token_ids(client, smol):
    prompts = ["Once upon", "The capital of France is"]
    ids = [smol.tokenizer.encode(p) for p in prompts]
    res = client.completions.create(model="smollm2", prompt=ids, max_tokens=3, temperature=0)
    refs = [headwise.generate(smol, i, max_new_tokens=3, temperature=0).text for i in ids]
    assert [c.text for c in res.choices] == refs


@pytest.fixture(scope="module")
def solo(tiny_dir):
    """One decoder, nothing else: `model` may be left out of chat and completions."""
    live = LiveServer(
        create_app(parse_config({"server": {"api_key_env": ""}, "models": {"tiny": {"source": str(tiny_dir)}}}))
    )
    yield live.start()
    live.stop()


def test_model_may_be_left_out_when_one_model_can_answer(solo):
    url = solo.url + "/v1"
    chat = httpx.post(url + "/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "tiny"
    done = httpx.post(url + "/completions", json={"prompt": "Hi", "max_tokens": 2, "model": None})
    assert done.status_code == 200 and done.json()["model"] == "tiny"
    emb = httpx.post(url + "/embeddings", json={"input": "hello"})  # no encoder here
    assert emb.status_code == 400 and emb.json()["error"]["param"] == "model"
    assert "tiny" in emb.json()["error"]["message"]
    empty = httpx.post(url + "/chat/completions", json={"messages": CHAT, "model": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "model"


def test_model_is_required_when_several_could_answer(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body={"messages": CHAT, "max_tokens": 2}, cast_to=httpx.Response)
    body = e.value.body
    assert body["param"] == "model" and "smollm2" in body["message"] and "tiny" in body["message"]
