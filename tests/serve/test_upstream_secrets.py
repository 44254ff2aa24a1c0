"""The gateway keeps its secrets and its memory (issue 43): what an upstream provider sends back is
scrubbed of the key we sent it (stream events and extra fields included), read under a size and a
decompression cap, and a stream has an idle and an overall deadline.

The upstream is a fake in this process that misbehaves by `model`: it echoes the request's headers
(our key) inside extra fields of its answers and stream events, sends a 1.5 GB body, a gzip bomb
(1 GiB of JSON in a 1 MB body, Content-Encoding: gzip), or drips `:` keep-alives (or slow events)
forever. Memory is the RSS of this process (the gateway runs in it), sampled while a request runs.
"""

import asyncio
import json
import os
import secrets
import struct
import threading
import time
import zlib

import anthropic
import httpx
import openai
import pytest

from headwise.serve import ConfigError, create_app, parse_config

from .conftest import LOG, LiveServer

KEY, KEY_ENV = "sk-sec-" + secrets.token_hex(12), "HEADWISE_TEST_SECRETS_KEY"
ANT_KEY, ANT_ENV = "sk-ant-sec-" + secrets.token_hex(12), "HEADWISE_TEST_SECRETS_ANT_KEY"
MSG = [{"role": "user", "content": "hi"}]
CAP = 8 << 20  # [providers.fake] max_response_bytes here
HUGE = 1536 << 20  # the 1.5 GB body of the issue
IDLE, TOTAL = 1.0, 2.5  # [providers.fake] idle_timeout / total_timeout here


def escaped(text: str) -> str:
    """`text` as a JSON string literal with every character \\u-escaped: the same string once parsed."""
    return '"' + "".join(f"\\u{ord(c):04x}" for c in text) + '"'


def gzip_bomb(prefix: bytes, size: int, suffix: bytes) -> bytes:
    """A valid gzip body of prefix + `size` spaces + suffix, about size / 1000 bytes: one deflate
    block of 1 MiB of spaces, cut with a full flush (no back-references across it), repeated."""
    spaces = b" " * (1 << 20)

    def part(data: bytes) -> bytes:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        return c.compress(data) + c.flush(zlib.Z_FULL_FLUSH)

    crc = zlib.crc32(prefix)
    for _ in range(size >> 20):
        crc = zlib.crc32(spaces, crc)
    crc = zlib.crc32(suffix, crc)
    end = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = part(prefix) + part(spaces) * (size >> 20) + end.compress(suffix) + end.flush()
    length = (len(prefix) + size + len(suffix)) & 0xFFFFFFFF
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + body + struct.pack("<II", crc, length)


BOMB = gzip_bomb(b'{"choices": [', 1 << 30, b"]}")  # 1 GiB of valid JSON


# ---------------------------------------------------------------- the misbehaving upstream
def _chunk(text: str, **extra) -> dict:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice], **extra}


def _data(event: dict | bytes) -> bytes:
    return b"data: " + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n\n"


def _answer() -> dict:
    message = {"role": "assistant", "content": "hello"}
    choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return {"id": "c1", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice], "usage": usage}


def _message_events(headers: dict, key: str) -> list[bytes]:
    def sse(name, data):
        raw = data if isinstance(data, bytes) else json.dumps(data).encode()
        return b"event: " + name.encode() + b"\ndata: " + raw + b"\n\n"

    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": []}
    message |= {"stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hello"}}
    delta_raw = json.dumps({**delta, "debug": headers})[:-1] + ', "escaped": ' + escaped(key) + "}"
    end = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    return [
        sse("message_start", {"type": "message_start", "message": message}),
        sse(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        sse("content_block_delta", delta_raw.encode()),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("message_delta", {**end, "usage": {"output_tokens": 1}}),
        sse("message_stop", {"type": "message_stop"}),
    ]


def _upstream_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def stream(events):
        async def gen():
            for e in events:
                if e is None:
                    await asyncio.sleep(0.05)
                else:
                    yield e

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def huge():
        yield b'{"choices": ['
        spaces = b" " * (1 << 20)  # the one chunk, sent again and again: this process's memory stays flat
        for _ in range(HUGE >> 20):
            yield spaces
        yield b"]}"

    async def drip(slow: bool):
        yield _data(_chunk("hel"))
        for _ in range(20 * 60):  # a minute: longer than any deadline here
            await asyncio.sleep(0.05 if not slow else 0.2)
            yield _data(_chunk("lo")) if slow else b": keep-alive\n\n"

    async def handle(request):
        body = await request.json()
        model, headers = body["model"], dict(request.headers)
        key = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if request.url.path.endswith("/messages"):
            return stream(_message_events(headers, key))
        if model == "echo":
            if not body.get("stream"):
                raw = json.dumps({**_answer(), "debug": headers})[:-1] + ', "escaped": ' + escaped(key) + "}"
                return Response(raw.encode(), media_type="application/json")
            first = json.dumps(_chunk("hel", debug=headers)).encode()
            second = json.dumps(_chunk("lo"))[:-1].encode() + b', "escaped": ' + escaped(key).encode() + b"}"
            return stream([_data(first), _data(second), b"data: [DONE]\n\n"])
        if model == "huge":
            return StreamingResponse(huge(), media_type="application/json")
        if model in ("bomb", "bomb-500"):
            headers = {"content-encoding": "gzip"}
            return Response(BOMB, status_code=500 if model == "bomb-500" else 200, headers=headers)
        if model in ("gzip", "deflate", "rawdeflate"):  # a real provider's compression: decoded as before
            events = [_data(_chunk(t, pad=" " * 70_000)) for t in ("hel", "lo")] + [b"data: [DONE]\n\n"]
            plain = b"".join(events) if body.get("stream") else json.dumps(_answer()).encode()
            wbits = {"gzip": 31, "deflate": 15, "rawdeflate": -15}[model]
            c = zlib.compressobj(6, zlib.DEFLATED, wbits)
            media = "text/event-stream" if body.get("stream") else "application/json"
            headers = {"content-encoding": model.removeprefix("raw")}
            return Response(c.compress(plain) + c.flush(), media_type=media, headers=headers)
        if model in ("drip", "slow"):
            return StreamingResponse(drip(model == "slow"), media_type="text/event-stream")
        return JSONResponse(_answer())

    async def health(request):  # LiveServer.start waits for it
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/{path:path}", handle, methods=["POST"]), Route("/health", health)])


@pytest.fixture(scope="module")
def gw():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, KEY)
        mp.setenv(ANT_ENV, ANT_KEY)
        upstream = LiveServer(_upstream_app()).start()
        limits = {"timeout": 10, "max_response_bytes": CAP, "idle_timeout": IDLE, "total_timeout": TOTAL}
        config = {
            "server": {"api_key_env": ""},
            "providers": {
                "fake": {
                    "base_url": upstream.url + "/v1",
                    "api_key_env": KEY_ENV,
                    "models": [
                        "ok",
                        "echo",
                        "huge",
                        "bomb",
                        "bomb-500",
                        "drip",
                        "slow",
                        "gzip",
                        "deflate",
                        "rawdeflate",
                    ],
                    **limits,
                },
                "claude": {
                    "base_url": upstream.url + "/v1",
                    "api": "anthropic",
                    "api_key_env": ANT_ENV,
                    "models": ["echo"],
                    **limits,
                },
            },
        }
        server = LiveServer(create_app(parse_config(config))).start()
        yield server
        server.stop()
        upstream.stop()


def sse_events(gw, path: str, body: dict, headers=None, within: float = 15.0) -> tuple[list[str], float]:
    """The raw events of a stream (split on blank lines) and the seconds it took; fails when the
    stream is still open after `within` seconds (an upstream that holds it forever)."""
    start, buf = time.monotonic(), ""
    with httpx.stream("POST", gw.url + path, json=body, headers=headers, timeout=within) as r:
        assert r.status_code == 200, r.read()
        for text in r.iter_text():
            buf += text
            assert time.monotonic() - start < within, f"still streaming after {within} s: {buf[-300:]!r}"
    return [e for e in buf.replace("\r\n", "\n").split("\n\n") if e.strip()], time.monotonic() - start


def leaked(text: str, key: str) -> bool:
    """The key in the text as sent, or in any JSON string of its events once decoded."""
    if key in text:
        return True
    for event in text.split("\n\n"):
        for line in event.splitlines():
            if line.startswith("data: {") and key in json.dumps(json.loads(line[6:]), ensure_ascii=False):
                return True
    return False


# ---------------------------------------------------------------- secrets
def test_a_streamed_event_never_carries_our_key(gw):
    events, _ = sse_events(gw, "/v1/chat/completions", {"model": "fake/echo", "messages": MSG, "stream": True})
    text = "\n\n".join(events)
    assert not leaked(text, KEY), text
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]" and [p["choices"][0]["delta"]["content"] for p in payloads] == ["hel", "lo"]
    assert payloads[0]["debug"]["authorization"] == "Bearer [redacted]"  # the rest of the event as sent
    assert payloads[0]["debug"]["host"].startswith("127.0.0.1:") and payloads[1]["escaped"] == "[redacted]"
    # the official client reads the scrubbed stream as any other
    oai = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=15)
    chunks = list(oai.chat.completions.create(model="fake/echo", messages=MSG, stream=True))
    assert "".join(c.choices[0].delta.content for c in chunks) == "hello"


def test_a_non_streamed_answer_never_carries_our_key(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake/echo", "messages": MSG}, timeout=15)
    assert r.status_code == 200 and not leaked(r.text, KEY), r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] == "hello" and answer["escaped"] == "[redacted]"
    assert answer["debug"]["authorization"] == "Bearer [redacted]"


def test_an_anthropic_stream_never_carries_our_key(gw):
    body = {"model": "claude/echo", "max_tokens": 5, "messages": MSG, "stream": True}
    events, _ = sse_events(gw, "/v1/messages", body)
    text = "\n\n".join(events)
    assert not leaked(text.replace("data: ", "\ndata: "), ANT_KEY) and ANT_KEY not in text, text
    delta = json.loads(next(e for e in events if "content_block_delta" in e).split("data: ", 1)[1])
    assert delta["debug"]["x-api-key"] == "[redacted]" and delta["escaped"] == "[redacted]"
    claude = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=15)
    with claude.messages.stream(model="claude/echo", max_tokens=5, messages=MSG) as stream:
        assert "".join(stream.text_stream) == "hello"
    assert KEY not in LOG.getvalue() and ANT_KEY not in LOG.getvalue()


# ---------------------------------------------------------------- memory
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakGrowth:
    """The most this process's resident memory grew above its start while the block ran."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.mb = (self.peak - self.base) / 1e6


@pytest.mark.parametrize("model", ["huge", "bomb"])
def test_a_too_big_answer_is_a_502_naming_the_cap(gw, model):
    with PeakGrowth() as growth:
        body = {"model": f"fake/{model}", "messages": MSG}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=60) as r:
            status = r.status_code
            answer = r.read() if status != 200 else b""  # a 200 here would be the whole body: not read
    assert status == 502, f"{model}: answered {status}"
    error = json.loads(answer)["error"]
    assert error["code"] == "upstream_too_large", error
    assert f"{CAP} bytes" in error["message"] and "max_response_bytes" in error["message"], error
    assert growth.mb < 50, f"{model}: resident memory grew {growth.mb:.0f} MB"


@pytest.mark.parametrize("model", ["gzip", "deflate", "rawdeflate"])
def test_compressed_answers_still_pass(gw, model):
    """What real providers send (OpenAI gzips): decoded, each stream event over several zlib steps."""
    oai = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=15)
    answer = oai.chat.completions.create(model=f"fake/{model}", messages=MSG)
    assert answer.choices[0].message.content == "hello"
    chunks = list(oai.chat.completions.create(model=f"fake/{model}", messages=MSG, stream=True))
    assert [c.choices[0].delta.content for c in chunks] == ["hel", "lo"]
    assert chunks[0].model_extra["pad"] == " " * 70_000


def test_a_bomb_in_an_error_body_is_bounded(gw):
    with PeakGrowth() as growth:
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake/bomb-500", "messages": MSG}, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text
    assert growth.mb < 50, f"resident memory grew {growth.mb:.0f} MB"


# ---------------------------------------------------------------- deadlines
@pytest.mark.parametrize("model, seconds, named", [("drip", IDLE, "idle_timeout"), ("slow", TOTAL, "total_timeout")])
def test_a_stream_that_never_ends_ends_at_its_deadline(gw, model, seconds, named):
    """drip: one event, then `:` keep-alives every 50 ms (they keep the socket busy, not the
    stream alive); slow: an event every 200 ms for a minute."""
    body = {"model": f"fake/{model}", "messages": MSG, "stream": True, "max_tokens": 4}
    events, took = sse_events(gw, "/v1/chat/completions", body)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "upstream_timeout" and named in error["message"], error
    assert f"{seconds:g} s" in error["message"]
    assert seconds <= took < seconds + 2, took
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "hel"  # what came before is kept


@pytest.mark.parametrize(
    "key, value", [("idle_timeout", 0), ("total_timeout", -1), ("max_response_bytes", 10), ("max_response_bytes", 1.5)]
)
def test_the_limits_are_checked_and_named(key, value):
    provider = {"base_url": "http://127.0.0.1:1/v1", "models": ["m"], key: value}
    with pytest.raises(ConfigError, match=rf"\[providers.p\] {key} must be"):
        parse_config({"providers": {"p": provider}})
