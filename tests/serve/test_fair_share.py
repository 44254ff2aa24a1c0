"""Fair shares through `headwise serve` (issue 43): one request of 64 prompts x n=16 once pushed
every other client's first token to 12.9 s. Here one client's request of 16 sequences holds all 4
slots of a tiny model; another client's chat, sent after it, is answered before any of the 16
finishes (first come, first served: after all 16). `priority` is vLLM's request field.

An in-process server of its own over the tiny random Llama, with two API keys (two clients).
"""

import threading
import time

import httpx
import openai
import pytest

from headwise.serve import create_app, parse_config

from .conftest import LiveServer

KEYS = ("sk-fair-a-1f2e3d", "sk-fair-b-4c5b6a")


@pytest.fixture(scope="module")
def srv(tiny_dir):
    models = {"tiny": {"source": str(tiny_dir), "max_num_seqs": 4}}
    server = LiveServer(
        create_app(parse_config({"server": {"api_keys": list(KEYS), "api_key_env": ""}, "models": models}))
    )
    yield server.start()
    server.stop()


def client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_another_clients_chat_is_answered_beside_sixteen_sequences(srv):
    engine = srv.app.state.serve.runtimes["tiny"].engine
    finished, errors = [], []  # the big request's choices, in the order they finish

    def big():
        try:
            body = dict(prompt="Once upon a time", n=16, max_tokens=240, temperature=0, extra_body={"ignore_eos": True})
            stream = client(srv, KEYS[0]).completions.create(model="tiny", stream=True, **body)
            for chunk in stream:
                finished.extend(c.index for c in chunk.choices if c.finish_reason)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=big)
    thread.start()
    deadline = time.monotonic() + 60
    while len(engine.scheduler.running) < 4 or not engine.scheduler.waiting:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.005)
    clients = {r.group.client_key for r in engine.scheduler.running}
    assert len(clients) == 1 and not any(KEYS[0] in str(k) for k in clients)  # hashed, never the key
    out = client(srv, KEYS[1]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert out.choices[0].message.content is not None
    assert finished == []  # none of the 16 had finished
    thread.join(300)
    assert not errors and sorted(finished) == list(range(16))


@pytest.mark.parametrize(("priority", "status"), [(-3, 200), (7, 200), ("high", 400), (2**40, 400), (1.5, 400)])
def test_priority_is_an_integer(srv, priority, status):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "priority": priority}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60)
    assert r.status_code == status, r.text
    if status == 400:
        assert "priority" in r.text
