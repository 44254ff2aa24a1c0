"""Streamed chunks written by the engine's thread (serve/direct.py): in order, equal to the
loop's, and handed back to the loop where the socket is full or the framing is not ours."""

import asyncio
import json
import socket

import httpx
import pytest

import headwise
from headwise.serve import ConfigError, create_app, parse_config
from headwise.serve.direct import DirectWriter

from .conftest import MAIN_KEY, LiveServer, auth, metrics_values

CHAT = [{"role": "user", "content": "Name three colors."}]


def direct_chunks(url: str) -> float:
    return metrics_values(url, "headwise_stream_direct_chunks_total").get((("model", "smollm2"),), 0.0)


def frame(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def test_a_full_socket_hands_the_rest_and_every_later_chunk_to_the_loop_in_order():
    """The peer does not read: a write from another thread comes up short, its rest and every
    later chunk go through the loop's transport, and the peer gets every byte, in order."""

    async def run():
        loop = asyncio.get_running_loop()
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            transport, _ = await loop.create_connection(asyncio.Protocol, *listener.getsockname())
            peer, _ = listener.accept()
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        writer = DirectWriter(transport, loop)
        writer.start(lambda body: body or None)  # here a "piece" is its chunk's body; b"" sends nothing
        expected, by_loop = [], 0
        for i in range(400):
            body = f"data: chunk {i} ".encode() * 8 if i % 50 else b""
            if await asyncio.to_thread(writer, body):  # from another thread, as the engine's
                expected.append(frame(body) if body else b"")
            else:  # what the loop does with a piece the writer did not take: frame and write it
                transport.write(frame(body))
                expected.append(frame(body))
                by_loop += 1
        want = b"".join(expected)
        got = bytearray()
        peer.setblocking(False)
        while len(got) < len(want):
            try:
                got += peer.recv(65536)
            except BlockingIOError:
                await asyncio.sleep(0.005)  # the loop writes what it holds as the peer drains
        transport.close()
        peer.close()
        return bytes(got), want, writer, by_loop

    got, want, writer, by_loop = asyncio.run(run())
    assert got == want
    assert 0 < writer.written < 400 - 8 and by_loop > 0  # some taken before the socket filled, the rest by the loop
    assert writer.fd is None  # disarmed for good once a write came up short


def test_one_choice_streams_from_the_engine_thread_and_equals_generate(client, main, smol):
    ref = headwise.generate(smol, CHAT, max_new_tokens=24, temperature=0, ignore_eos=True)
    before = direct_chunks(main.url)
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=CHAT,
            max_completion_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    # every text chunk but the first piece's (sent before the stream is armed) and the last's (the loop's),
    # less one or two the engine made while the loop was still sending the first
    texts = sum(bool(c.choices and c.choices[0].delta.content) for c in chunks)
    assert direct_chunks(main.url) - before >= texts - 2 - 3 > 0


def test_two_choices_and_http_1_0_stream_through_the_loop(client, main, smol):
    ref = headwise.generate(smol, "The sky is", max_new_tokens=12, temperature=0, ignore_eos=True)
    before = direct_chunks(main.url)
    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt="The sky is",
            max_tokens=12,
            temperature=0,
            n=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == ref.text
    # HTTP/1.0 has no chunked framing: the body ends when the server closes the connection
    body = json.dumps(
        {
            "model": "smollm2",
            "prompt": "The sky is",
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    head = f"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in auth(MAIN_KEY).items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", int(main.url.rsplit(":", 1)[1])), timeout=60) as s:
        s.sendall(head.encode() + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    status, _, payload = raw.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in status.lower()
    events = [json.loads(line[6:]) for line in payload.split(b"\n") if line.startswith(b"data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ref.text
    assert payload.rstrip().endswith(b"data: [DONE]")
    assert direct_chunks(main.url) == before  # neither stream was the engine thread's to write


@pytest.mark.parametrize("direct", [True, False])
def test_direct_streams_setting(tiny_dir, direct):
    """`[server] direct_streams = false`: the same stream, every chunk through the loop (true: most
    of them from the engine's thread)."""
    config = {"server": {"api_key_env": "", "direct_streams": direct}, "models": {"tiny": {"source": str(tiny_dir)}}}
    with pytest.raises(ConfigError, match="direct_streams must be true or false"):
        parse_config({**config, "server": {"direct_streams": "no"}})
    live = LiveServer(create_app(parse_config(config))).start()
    try:
        body = {"model": "tiny", "prompt": "The sky is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        whole = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        pieces = []
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(pieces) == whole and len(whole) > 0
        counts = metrics_values(live.url, "headwise_stream_direct_chunks_total")
        taken = counts.get((("model", "tiny"),), 0.0)
        if direct:  # all but the first and last chunks, less one or two made while the first was being sent
            assert taken >= sum(map(bool, pieces)) - 2 - 3 and taken > 0
        else:
            assert taken == 0.0
    finally:
        live.stop()
