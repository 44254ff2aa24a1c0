"""LangChain's OpenAI classes (langchain-openai, a test requirement) against a live `headwise serve`
(conftest's `main`: SmolLM2 fp32, MiniLM): ChatOpenAI's invoke, stream, bind_tools and
with_structured_output, and OpenAIEmbeddings as LangChain users configure it. Each answer is held to
the same greedy request sent through the official openai client, the independent reference."""

from __future__ import annotations

import json

import pytest
import torch
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel

import headwise
from headwise.models.builtin import resolve

from .conftest import MAIN_KEY

CHAT = [{"role": "user", "content": "Name three colours."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def llm(main):
    return ChatOpenAI(
        base_url=main.url + "/v1", api_key=MAIN_KEY, model="smollm2", temperature=0, max_tokens=12, max_retries=0
    )


def test_chat_invoke_and_stream(llm, client):
    ref = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0, max_tokens=12)
    text = ref.choices[0].message.content
    got = llm.invoke([("user", CHAT[0]["content"])])
    assert got.content == text
    assert got.response_metadata["finish_reason"] == ref.choices[0].finish_reason == "length"
    assert got.usage_metadata["output_tokens"] == ref.usage.completion_tokens == 12
    chunks = list(llm.stream([("user", CHAT[0]["content"])]))
    assert "".join(c.content for c in chunks) == text
    assert len(chunks) > 2  # streamed piece by piece, not one answer


def test_bind_tools_calls_the_tool(llm, client):
    ref = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=40,
    )
    call = ref.choices[0].message.tool_calls[0]
    got = llm.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Paris?", max_tokens=40
    )
    assert [(c["name"], c["args"]) for c in got.tool_calls] == [("get_weather", json.loads(call.function.arguments))]


def test_with_structured_output_parses_the_schema(llm, client):
    question = "Which city is the capital of France? Answer in JSON."
    ref = client.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": question}],
        response_format=City,
        temperature=0,
        max_tokens=40,
    )
    longer = llm.model_copy(update={"max_tokens": 40})
    got = longer.with_structured_output(City, method="json_schema").invoke(question)
    assert isinstance(got, City) and got == ref.choices[0].message.parsed


def test_openai_embeddings(main, minilm):
    texts = ["A man is eating food.", "The stock market fell."]
    ref = headwise.embed(minilm, texts)
    common = dict(base_url=main.url + "/v1", api_key=MAIN_KEY, model="minilm", max_retries=0)
    # text as it is: what a user of a non-OpenAI model sets (the server's 400 for foreign ids says so)
    plain = OpenAIEmbeddings(check_embedding_ctx_length=False, **common)
    torch.testing.assert_close(torch.tensor(plain.embed_documents(texts)), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(plain.embed_query(texts[0])), ref[0], atol=1e-5, rtol=1e-5)
    # the default sends token ids from a tokenizer LangChain picks by model name (tiktoken's, which
    # downloads its table, or a transformers one with tiktoken_enabled=False): here MiniLM's own, in
    # its folder, whose text chunks go out decoded
    folder = str(resolve("all-minilm-l6-v2"))
    chunked = OpenAIEmbeddings(tiktoken_enabled=False, tiktoken_model_name=folder, **common)
    torch.testing.assert_close(torch.tensor(chunked.embed_documents(texts)), ref, atol=1e-5, rtol=1e-5)
