"""Every failure answers with the OpenAI envelope and the right status, each seen through
the official client's exception classes; the server keeps serving afterwards; no key
is ever logged."""

import asyncio
import json
import threading

import httpx
import openai
import pytest

from headwise.serve import create_app, parse_config
from headwise.serve.local import default_loader

from .conftest import LOG, MAIN_KEY, PEER_KEY, LiveServer, auth

MSG = [{"role": "user", "content": "Hi"}]


def envelope(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def still_serving(client):
    res = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, temperature=0)
    assert res.choices[0].finish_reason == "length"


def test_auth(main):
    wrong = openai.OpenAI(base_url=main.url + "/v1", api_key="sk-wrong-key-123", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401
    r = httpx.post(main.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG})
    assert r.status_code == 401 and "missing API key" in envelope(r)["message"]
    r = httpx.get(main.url + "/v1/models", headers={"Authorization": "Basic " + MAIN_KEY})
    assert r.status_code == 401
    assert httpx.get(main.url + "/health").status_code == 200  # open, for load balancers
    assert "headwise_requests_total" in httpx.get(main.url + "/metrics").text


def test_not_found_and_bad_parameters(client, main):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MSG)
    assert e.value.body["code"] == "model_not_found" and "smollm2" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:  # FastAPI's 422 -> 400
        client.chat.completions.create(model="tiny", messages=[])
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    cases = [
        ({"model": "tiny", "messages": MSG, "base_url": "http://attacker"}, "base_url"),
        ({"model": "tiny", "messages": MSG, "max_tokns": 3}, "max_tokns"),
        ({"model": "tiny", "messages": MSG, "presence_penalty": 2.5}, "presence_penalty"),  # over OpenAI's 2
        ({"model": "tiny", "messages": MSG, "tools": [{"type": "function"}]}, "tools"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
        ({"model": "minilm", "messages": MSG}, "model"),
    ]
    for body, param in cases:
        r = httpx.post(main.url + "/v1/chat/completions", json=body, headers=auth())
        assert r.status_code == 400, (body, r.text)
        assert envelope(r)["param"].startswith(param), (body, r.text)
    r = httpx.post(main.url + "/v1/completions", content=b"{not json", headers=auth())
    assert r.status_code == 400 and "JSON" in envelope(r)["message"]
    r = httpx.post(main.url + "/v1/completions", json={"model": "tiny", "prompt": [10**6]}, headers=auth())
    assert r.status_code == 400 and "vocabulary" in envelope(r)["message"]
    r = httpx.get(main.url + "/v2/nothing", headers=auth())
    assert r.status_code == 404 and envelope(r)["type"] == "not_found_error"
    still_serving(client)


def test_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hello", max_tokens=200)  # tiny: 96 tokens
    assert e.value.body["code"] == "context_length_exceeded" and "96" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 200}])
    assert e.value.body["code"] == "context_length_exceeded"
    still_serving(client)


def test_body_too_large(client, main):
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 70_000}]}  # limit: 64 KiB
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**big)
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted while reading
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"y" * 1000
        yield b'"}]}'

    r = httpx.post(main.url + "/v1/chat/completions", content=chunked(), headers=auth())
    assert r.status_code == 413 and envelope(r)["code"] == "request_too_large"
    still_serving(client)


def test_queue_full_is_429_with_retry_after(main, aclient, client):
    """tiny-1seq runs one sequence and queues one more: of 6 simultaneous requests,
    some must be refused, the rest complete."""

    async def one(c):
        try:
            stream = await c.chat.completions.create(
                model="tiny-1seq",
                messages=MSG,
                max_tokens=60,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return [c async for c in stream]
        except openai.RateLimitError as e:
            return e

    async def run():
        async with aclient() as c:
            return await asyncio.gather(*(one(c) for _ in range(6)))

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert refused and served
    assert all(r.body["code"] == "queue_full" for r in refused)
    assert all(int(r.response.headers["retry-after"]) >= 1 for r in refused)
    assert all(s[-1].choices[0].finish_reason == "length" for s in served)
    still_serving(client)


def test_loading_is_503_then_ready(tiny_dir):
    gate = threading.Event()

    def slow_loader(spec):
        gate.wait(60)
        return default_loader(spec)

    app = create_app(
        parse_config({"server": {"api_key_env": None}, "models": {"tiny": {"source": str(tiny_dir)}}}),
        loader=slow_loader,
    )
    server = LiveServer(app)
    server.thread.start()
    try:
        for _ in range(100):
            try:
                r = httpx.get(server.url + "/health")
                break
            except httpx.TransportError:
                asyncio.run(asyncio.sleep(0.05))
        assert r.status_code == 503 and envelope(r)["code"] == "loading"
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "model_loading"
        assert e.value.response.headers["retry-after"]
        gate.set()
        server.thread.start = lambda: None  # already running; start() now just waits for 200
        server.start(ready_timeout=60)
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        gate.set()
        server.stop()


def test_a_failing_engine_is_replaced(tiny_dir):
    """A step that raises stops an engine for every request (Engine._fail); the request that
    hit it gets a 500, and the next request is served by a fresh engine on the same model."""
    broken = threading.Event()

    def loader(spec):
        model = default_loader(spec)
        forward = model.forward

        def maybe_fail(*args, **kwargs):
            if broken.is_set():
                raise RuntimeError("simulated kernel failure")
            return forward(*args, **kwargs)

        model.forward = maybe_fail
        return model

    app = create_app(
        parse_config({"server": {"api_key_env": None}, "models": {"tiny": {"source": str(tiny_dir)}}}), loader=loader
    )
    server = LiveServer(app).start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        first = app.state.serve.runtimes["tiny"].engine
        broken.set()
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert e.value.body["code"] == "engine_error" and "simulated kernel failure" in e.value.body["message"]
        broken.clear()
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        assert app.state.serve.runtimes["tiny"].engine is not first
        # after the first byte the status is sent: the error travels in the stream, then [DONE]
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
            broken.set()
            events = [line for line in lines if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "engine_error" and set(error) == {"message", "type", "param", "code"}
    finally:
        broken.clear()
        server.stop()


def test_no_key_is_ever_logged(main, peer, client):
    """Requests with the right key, a wrong one, and through the gateway with the upstream's key."""
    httpx.get(main.url + "/v1/models", headers=auth("sk-wrong-secret-777"))
    client.completions.create(model="peer/tiny", prompt="hi", max_tokens=2)
    client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    for text in (main.log(), peer.log(), LOG.getvalue()):
        for key in (MAIN_KEY, PEER_KEY, "sk-wrong-secret-777"):
            assert key not in text
    assert '"GET /v1/models HTTP/1.1" 401' in main.log()  # the log did record the requests
    assert '"POST /v1/completions HTTP/1.1" 200' in peer.log()
