"""What the gateway must never let out: the upstream key (in error answers or logs), secrets in
query strings (uvicorn's access log), and, beyond loopback, /metrics without an API key."""

import logging
import time

import httpx
import openai
import pytest

from headwise.serve import create_app, parse_config
from headwise.serve.config import ConfigError

from .conftest import FAKE_KEY, LOG, ServeProcess, auth

SECRET = "hunter2-query-secret-0f3a"


def wait_for(predicate, timeout: float = 10.0):
    """uvicorn writes its access line after the response has gone out: poll for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory()


@pytest.mark.parametrize(
    "model,status,code,param",
    [
        ("echo-400", 400, None, "max_tokens"),  # the key sat in `code`: dropped
        ("echo-400-plain", 400, "context_length_exceeded", "messages[0].content"),
        ("echo-500", 502, "upstream_error", None),
        ("echo-429", 429, "upstream_rate_limited", None),
    ],
)
def test_upstream_error_text_never_reaches_the_client(gw, caplog, model, status, code, param):
    """The fake upstream echoes the request's headers (our Authorization: Bearer <key>) into its
    error body and an x-echo header; none of it may reach the client or the log."""
    caplog.set_level(logging.DEBUG)
    start = len(LOG.getvalue())
    for stream in (False, True):
        r = httpx.post(
            gw.url + "/v1/completions", json={"model": f"fake/{model}", "prompt": "hi", "stream": stream}, timeout=30
        )
        assert r.status_code == status, r.text
        assert FAKE_KEY not in r.text and FAKE_KEY not in str(r.headers.raw)
        assert "x-echo" not in r.headers
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == code and error["param"] == param
        assert f"fake/{model}" in error["message"] and str(status if status != 502 else 500) in error["message"]
        assert "you sent" not in error["message"] and "Internal error" not in error["message"]
    if status == 429:
        assert r.headers["retry-after"] == "3"
    time.sleep(0.2)  # the access lines of the last request
    assert FAKE_KEY not in caplog.text and FAKE_KEY not in LOG.getvalue()[start:]


def test_the_official_client_sees_our_message(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake/echo-400-plain", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "context_length_exceeded"
    assert FAKE_KEY not in str(e.value) and FAKE_KEY not in e.value.response.text
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="fake/echo-500", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 502 and FAKE_KEY not in e.value.response.text


def test_upstream_debug_logging_does_not_print_the_echoed_key(gw, caplog):
    """httpcore's DEBUG trace prints upstream response headers verbatim; x-echo holds our key."""
    caplog.set_level(logging.DEBUG)
    r = httpx.post(gw.url + "/v1/completions", json={"model": "fake/echo-400", "prompt": "hi"}, timeout=30)
    assert r.status_code == 400
    assert "fake/echo-400" in r.json()["error"]["message"]
    assert FAKE_KEY not in caplog.text


def access_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "/v1/models?" in line]


def test_query_secrets_are_redacted_in_the_access_log(gateway_factory):
    gw = gateway_factory(server={"api_keys": ["sk-gw-key"]})
    start = len(LOG.getvalue())
    url = f"{gw.url}/v1/models?api_key={SECRET}&limit=3&access_token={SECRET}&Password={SECRET}"
    assert httpx.get(url, headers=auth("sk-gw-key")).status_code == 200
    lines = wait_for(lambda: [x for x in access_lines(LOG.getvalue()[start:]) if "uvicorn.access" in x])
    assert lines
    assert SECRET not in "\n".join(lines)
    assert "limit=3" in lines[0] and "api_key=" in lines[0]  # the line still says what was asked


def test_query_secrets_are_redacted_by_headwise_serve(servers_dir):
    """The real `headwise serve` process, with uvicorn's own log config."""
    server = ServeProcess(
        {"server": {"api_key_env": ""}, "providers": {"x": {"base_url": "http://127.0.0.1:9/v1", "models": ["m"]}}},
        servers_dir,
        "redact",
    )
    try:
        server.wait_ready(60)
        assert httpx.get(f"{server.url}/v1/models?key={SECRET}&x=1").status_code == 200
        lines = wait_for(lambda: access_lines(server.log()))
    finally:
        server.stop()
    assert lines and "x=1" in lines[0]
    assert SECRET not in server.log()


@pytest.mark.parametrize(
    "host,mode,protected",
    [
        ("0.0.0.0", None, True),  # auto (the default): keys + beyond loopback
        ("127.0.0.1", None, False),  # auto on loopback: open, as before
        ("127.0.0.1", "always", True),
        ("0.0.0.0", "never", False),
    ],
)
def test_metrics_auth(gateway_factory, host, mode, protected):
    server = {"api_keys": ["sk-gw-key"], "host": host, **({"metrics_auth": mode} if mode else {})}
    gw = gateway_factory(server=server)
    anonymous = httpx.get(gw.url + "/metrics")
    if protected:
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
        assert "fake/ok" not in anonymous.text
        assert httpx.get(gw.url + "/metrics", headers=auth("wrong")).status_code == 401
    else:
        assert anonymous.status_code == 200
    r = httpx.get(gw.url + "/metrics", headers=auth("sk-gw-key"))
    assert r.status_code == 200 and "headwise_requests" in r.text
    assert httpx.get(gw.url + "/health").status_code == 200  # probes stay open


def test_metrics_auth_without_keys_stays_open(gateway_factory):
    gw = gateway_factory(server={"host": "0.0.0.0"})
    assert httpx.get(gw.url + "/metrics").status_code == 200


def test_metrics_auth_config_errors():
    providers = {"x": {"base_url": "http://127.0.0.1:9/v1", "models": ["m"]}}
    with pytest.raises(ConfigError, match="metrics_auth.*auto, always, never"):
        parse_config({"server": {"metrics_auth": "sometimes"}, "providers": providers})
    config = parse_config({"server": {"metrics_auth": "always", "api_key_env": ""}, "providers": providers})
    with pytest.raises(ConfigError, match="metrics_auth = 'always'.*no API keys"):
        create_app(config)
