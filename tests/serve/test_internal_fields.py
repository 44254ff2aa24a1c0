"""Internal fields stay internal: headwise.resume (the gateway's failover, serve/failover.py) is
accepted only from a peer ([server] accept_resume: by default a request with one of the server's
API keys), and a gateway never lends its replica key to a client's resume. Secrets in query
strings never reach the access log, however they are quoted or encoded."""

import asyncio
import json
import logging
import threading
import time
import urllib.parse

import httpx
import pytest

from headwise.serve import create_app, parse_config
from headwise.serve.config import ConfigError
from headwise.serve.middleware import PEER, ApiKeyAuth, RedactQuery

from .conftest import LOG, MAIN_KEY, LiveServer, auth

KEY_ENV = "HEADWISE_TEST_INTERNAL_REPLICA_KEY"
SECRET = "s3cr3t-0f-the-query-9d1c"


@pytest.fixture(scope="module")
def gw(tiny_dir, main):
    """No API keys of its own; a local tiny model; `main` as its replica set and as a provider,
    behind main's key."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, MAIN_KEY)
        pool = {"urls": [main.url], "models": ["tiny"], "api_key_env": KEY_ENV, "health_interval": 0.2}
        up = {"base_url": main.url + "/v1", "models": ["tiny"], "api_key_env": KEY_ENV}  # main as a provider
        config = {
            "providers": {"up": up},
            "server": {"api_key_env": ""},
            "models": {"tiny": {"source": str(tiny_dir)}},
            "replicas": {"pool": pool},
        }
        live = LiveServer(create_app(parse_config(config))).start()
        yield live
        live.stop()


def _resume(ids):
    return {"headwise": {"resume": {"token_ids": ids, "text_chars": 0}}}


BODY = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("model", ["tiny", "pool/tiny", "up/tiny"])
def test_a_client_without_a_key_cannot_resume(gw, model):
    ok = httpx.post(gw.url + "/v1/completions", json={**BODY, "model": model}, timeout=60)
    assert ok.status_code == 200, ok.text  # the target serves
    r = httpx.post(gw.url + "/v1/completions", json={**BODY, "model": model, **_resume([42] * 3)}, timeout=60)
    assert r.status_code == 400, r.text  # pool/tiny, up/tiny: not sent on with the gateway's key to main
    err = r.json()["error"]
    assert err["param"] == "headwise.resume" and err["code"] == "internal_field"
    assert "accept_resume" in err["message"]


def test_a_keyed_peer_resumes_within_the_context(main):
    url = main.url + "/v1/completions"
    r = httpx.post(url, json={**BODY, "model": "tiny", **_resume([42] * 3)}, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    long = httpx.post(
        url, json={**BODY, "max_tokens": 250, "model": "tiny", **_resume([42] * 200)}, headers=auth(), timeout=60
    )
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"  # max_model_len 96


@pytest.mark.parametrize(
    "mode,keys,sent,peer",
    [
        ("keyed", ("k1",), "k1", True),
        ("keyed", (), None, False),  # no keys: no one is known
        ("always", (), None, True),
        ("never", ("k1",), "k1", False),
    ],
)
def test_who_counts_as_a_peer(mode, keys, sent, peer):
    seen = []

    async def app(scope, receive, send):
        seen.append(PEER.get())

    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"authorization", f"Bearer {sent}".encode())]}
    asyncio.run(ApiKeyAuth(app, keys, accept_resume=mode)(scope, None, None))
    assert seen == [peer]
    with pytest.raises(ConfigError, match="accept_resume"):
        parse_config({"server": {"accept_resume": "sometimes"}, "models": {"m": {"source": "x"}}})


NAMES = ("api_key", "sig", "jwt", "session", "sid", "code", "bearer", "token", "key", "X-Amz-Signature", "API_KEY")


def _access(path: str) -> str:
    """One uvicorn access record through the filter -> the line it logs."""
    record = logging.LogRecord(
        "uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', ("1.2.3.4:5", "GET", path, "1.1", 200), None
    )
    RedactQuery().filter(record)
    return record.getMessage()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [SECRET, f'"{SECRET}"', f"'{SECRET}'", urllib.parse.quote(f'"{SECRET}"')])
def test_secret_params_are_redacted_however_quoted(name, value):
    line = _access(f"/v1/models?limit=3&{name}={value}&design=x&encoding=y")
    assert SECRET not in line
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(line.split()[3]).query)
    assert query["limit"] == ["3"] and query["design"] == ["x"] and query["encoding"] == ["y"]  # not secrets
    assert query[name] == ["[redacted]"]


@pytest.mark.parametrize(
    "query",
    [
        f"api%5Fkey={SECRET}",  # an encoded name
        f"api%255Fkey={SECRET}",  # encoded twice
        f"api_key%3D{SECRET}",  # an encoded '='
        f"x=1;session_id={SECRET}",  # ';' separates too
        f"Access-Token={SECRET}#frag",
    ],
)
def test_encoded_secret_params_are_redacted(query):
    assert SECRET not in _access("/v1/models?" + query)


def test_a_quoted_key_never_reaches_the_access_log(gateway_factory):
    gw = gateway_factory()
    start = len(LOG.getvalue())
    assert httpx.get(f'{gw.url}/v1/models?api_key="{SECRET}"&sig={SECRET}&limit=3').status_code == 200
    for _ in range(100):
        if "/v1/models?" in LOG.getvalue()[start:]:
            break
        asyncio.run(asyncio.sleep(0.05))
    logged = LOG.getvalue()[start:]
    assert "/v1/models?" in logged and "limit=3" in logged and SECRET not in logged


def _stream_ids(url: str, body: dict) -> list[int]:
    """A streamed completion's token ids (headwise.token_ids: the replicas' own extension)."""
    ids = []
    hw = {**body.get("headwise", {}), "token_ids": True}
    with httpx.stream("POST", url, json={**body, "stream": True, "headwise": hw}, headers=auth(), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += (json.loads(line[6:]).get("headwise") or {}).get("token_ids", [])
    return ids


def test_a_seeded_resume_draws_what_the_whole_run_drew(main):
    """Seeded sampling resumed after k ids goes on as the uninterrupted run (the draws replayed,
    now on a loop of the resume's own: serve/local.py)."""
    url = main.url + "/v1/completions"
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    full = _stream_ids(url, body)
    rest = _stream_ids(url, {**body, **_resume(full[:5])})
    assert len(full) == 12 and full[:5] + rest == full


def test_a_long_seeded_resume_does_not_hold_the_loop(main):
    """1,500 ids and a seed: the engine replays 1,500 draws over SmolLM2's 49,152 ids (~1.5 s of
    CPU) before the request is queued; /health keeps answering meanwhile."""
    body = {
        "model": "smollm2",
        "prompt": "Hi",
        "max_tokens": 1502,
        "temperature": 1.0,
        "seed": 3,
        **_resume([42] * 1500),
    }
    done = []
    worker = threading.Thread(
        target=lambda: done.append(httpx.post(main.url + "/v1/completions", json=body, headers=auth(), timeout=120))
    )
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(main.url + "/health", timeout=30).status_code == 200
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.02)
    assert done[0].status_code == 200, done[0].text
    assert slowest < 0.5, f"/health took {slowest:.2f} s while the resume was queued"
