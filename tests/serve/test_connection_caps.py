"""Open connections capped per process and per client address (issue 43: idle connections that
dribble header bytes took every file descriptor and /health failed until they went).

A live in-process server with small caps from its [server] table; hundreds of raw sockets that
connect and send part of a request line play the flooders, from 127.0.0.1 and 127.0.0.2 (both
loopback on Linux: two client addresses). What the sockets read is parsed with h11 (the
independent reference for HTTP), /health and /metrics are read with httpx and prometheus_client.
"""

from __future__ import annotations

import json
import resource
import select
import socket
import threading
import time

import h11
import httpx
import pytest
import uvicorn

from headwise.serve import create_app, parse_config
from headwise.serve.config import ConfigError, ServerSettings
from headwise.serve.connections import ConnectionCaps, resolve_caps
from headwise.serve.timeouts import timed_h11

from .conftest import wait_healthy

PROCESS_CAP, CLIENT_CAP = 40, 25
FLOOD = 150  # sockets per flooding address


@pytest.fixture(scope="module")
def capped():
    """(url, caps): a gateway (one provider, nothing to load) with max_connections = 40 and 25 per
    client, on the protocol `headwise serve` runs, its caps registered on /metrics as the CLI does."""
    config = parse_config(
        {
            "server": {"api_key_env": "", "max_connections": PROCESS_CAP, "max_connections_per_client": CLIENT_CAP},
            "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "models": ["m"]}},
        }
    )
    caps = ConnectionCaps.of(config.server)
    caps.evict_after = 3600.0  # nothing is old enough to close until a test says so
    app = create_app(config)
    app.state.serve.metrics.registry.register(caps)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on", http=timed_h11(30, 60, caps=caps)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_healthy(url, 60)
    yield url, caps
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def flood(url: str, n: int, source: str) -> list[socket.socket]:
    """n sockets from `source`, each with the start of a request line and nothing more."""
    port = int(url.rsplit(":", 1)[1])
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Dribble: ")
        out.append(s)
    return out


def answers(socks: list[socket.socket], expect: int, timeout: float = 20.0) -> dict[socket.socket, tuple]:
    """Read whole answers until `expect` sockets have one (the server closes each after it):
    {socket: (h11.Response, body dict)}."""
    got, pending, deadline = {}, list(socks), time.monotonic() + timeout
    buffers = {s: h11.Connection(h11.CLIENT) for s in socks}
    for s, conn in buffers.items():  # the client side of a request already on the wire
        conn.send(h11.Request(method="GET", target="/v1/models", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
    while len(got) < expect and time.monotonic() < deadline:
        ready, _, _ = select.select(pending, [], [], 0.5)
        for s in ready:
            conn = buffers[s]
            conn.receive_data(s.recv(65536))
            events = []
            while (e := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                events.append(e)
                if isinstance(e, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            if any(isinstance(e, h11.EndOfMessage) for e in events):
                response = next(e for e in events if isinstance(e, h11.Response))
                body = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))
                got[s] = (response, json.loads(body))
                pending.remove(s)
    return got


def health(url: str, source: str, timeout: float = 5.0) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=timeout) as c:
        return c.get(url + "/health")


def metric(url: str, name: str) -> dict[str, float]:
    """{key label: value} of one family on /metrics, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=5)
    assert r.status_code == 200, r.text
    return {
        s.labels.get("key", ""): s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
        if s.name == name
    }


def until(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_flooders_are_refused_idle_ones_make_room_and_the_counts_come_back(capped):
    url, caps = capped
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * FLOOD + 256:  # both ends of every socket live in this process
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * FLOOD + 256), hard))

    # one address floods: its first 25 stay (accepted in the kernel's FIFO order), every later one
    # is a 503 naming the per-client cap
    first = flood(url, FLOOD, "127.0.0.1")
    refused = answers(first, FLOOD - CLIENT_CAP)
    assert set(refused) == set(first[CLIENT_CAP:])
    for response, body in refused.values():
        assert response.status_code == 503 and dict(response.headers)[b"retry-after"] == b"1"
        assert body["error"]["code"] == "too_many_connections"
        assert (
            "limit of 25 open connections from 127.0.0.1 ([server] max_connections_per_client)"
            in (body["error"]["message"])
        )
    assert health(url, "127.0.0.2").status_code == 200  # another address still gets in

    # a second address fills the process: 15 more fit, every later one is a 503 naming max_connections
    second = flood(url, FLOOD, "127.0.0.2")
    refused2 = answers(second, FLOOD - (PROCESS_CAP - CLIENT_CAP))
    assert set(refused2) == set(second[PROCESS_CAP - CLIENT_CAP :])
    for response, body in refused2.values():
        assert response.status_code == 503
        assert "limit of 40 open connections ([server] max_connections)" in body["error"]["message"]
    assert caps.open == PROCESS_CAP
    r = health(url, "127.0.0.3")  # at the cap, every connection too young to close: refused, with the reason
    assert r.status_code == 503 and "([server] max_connections)" in r.json()["error"]["message"]

    # once they have idled long enough (dribbled bytes are no request), a newcomer closes the oldest
    # idle connection: at the per-client cap one of its address's own, at the process cap anyone's
    held = first[:CLIENT_CAP] + second[: PROCESS_CAP - CLIENT_CAP]
    for s in held:
        s.sendall(b"a")
    caps.evict_after = 0.0
    assert health(url, "127.0.0.1").status_code == 200  # the flooder's own address: its oldest made room
    assert until(lambda: caps.open == PROCESS_CAP - 1)  # the probe's connection is gone
    held.append(flood(url, 1, "127.0.0.2")[0])  # the process is full again
    assert health(url, "127.0.0.3").status_code == 200  # the oldest of all made room
    assert until(lambda: caps.open == PROCESS_CAP - 1)
    closed = answers(held, 2, timeout=5.0)
    assert set(closed) == {first[0], first[1]}
    messages = [closed[s][1]["error"] for s in (first[0], first[1])]
    assert [m["code"] for m in messages] == ["connection_closed_idle"] * 2
    assert "([server] max_connections_per_client)" in messages[0]["message"]
    assert "([server] max_connections)" in messages[1]["message"]
    expected = {"max_connections": len(refused2) + 1.0, "max_connections_per_client": float(len(refused))}
    assert metric(url, "headwise_connections_refused_total") == expected
    assert until(lambda: caps.open == PROCESS_CAP - 1)  # /metrics below 40: it closes nothing either
    assert metric(url, "headwise_connections_evicted_total") == {
        "max_connections": 1.0,
        "max_connections_per_client": 1.0,
    }

    # the counts come back down as the sockets close
    for s in first + second + held:
        s.close()
    assert until(lambda: caps.open == 0), caps.open
    again = flood(url, CLIENT_CAP - 1, "127.0.0.1")
    assert answers(again, 1, timeout=1.0) == {}  # none refused
    assert metric(url, "headwise_connections_open") == {"": float(CLIENT_CAP)}  # with the /metrics request
    for s in again:
        s.close()
    assert until(lambda: caps.open == 0), caps.open


def test_a_busy_connection_is_never_closed_to_make_room():
    """ConnectionCaps alone, its clock given: the oldest idle connection goes first, one with a
    request in progress never, and with nothing idle for long enough the newcomer is refused."""
    caps = ConnectionCaps(3, 2, evict_after=1.0)
    a, b, c, d, e = "abcde"
    assert caps.admit(a, "h1", now=0.0)[:2] == (None, None)
    assert caps.admit(b, "h1", now=0.1)[:2] == (None, None)
    caps.busy(a)  # a's headers are in
    refused, victim, _ = caps.admit(c, "h1", now=0.5)  # per client: b is idle but too young
    assert victim is None and b"max_connections_per_client" in refused
    refused, victim, notice = caps.admit(c, "h1", now=2.0)
    assert refused is None and victim == b and b"connection_closed_idle" in notice
    caps.idle(a, now=2.0)  # a's answer is done: kept alive, idle from now on
    assert caps.admit(d, "h2", now=2.5)[:2] == (None, None)  # 3 open: a (idle 2.0), c (2.0), d
    caps.busy(c)
    refused, victim, _ = caps.admit(e, "h3", now=2.9)  # the process cap: a idle for 0.9 s only
    assert victim is None and b"([server] max_connections)" in refused
    refused, victim, _ = caps.admit(e, "h3", now=3.1)
    assert refused is None and victim == a
    assert (caps.open, caps.count) == (3, {"h1": 1, "h2": 1, "h3": 1})
    for x in (c, d, e):
        caps.closed(x)
    assert (caps.open, caps.count, caps.idle_since, caps.idle_by_host) == (0, {}, {}, {})


def test_caps_config():
    with pytest.raises(ConfigError, match=r"\[server\] max_connections must be an integer >= 1"):
        ServerSettings(max_connections=0)
    with pytest.raises(ConfigError, match="max_connections_per_client = 9 is above max_connections = 8"):
        ServerSettings(max_connections=8, max_connections_per_client=9)
    with pytest.raises(ConfigError, match=r"max_connections = 1000000000 needs more open files.*ulimit -n"):
        resolve_caps(ServerSettings(max_connections=10**9))
    most, per_client = resolve_caps(ServerSettings())  # from the open-files limit, raised where it may be
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert most == min(8192, soft // 2) and per_client == most // 2
    assert resolve_caps(ServerSettings(max_connections=50)) == (50, 25)


def test_an_upgrade_request_is_plain_http_and_its_connection_is_counted_out(capped):
    """uvicorn would hand an `Upgrade: websocket` connection to a WebSocket protocol of its own,
    whose close the caps never saw: each such connection would hold a slot for good."""
    url, caps = capped
    assert until(lambda: caps.open == 0), caps.open
    port = int(url.rsplit(":", 1)[1])
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            )
            assert s.recv(65536).startswith(b"HTTP/1.1 200 "), "answered as plain HTTP"
    assert until(lambda: caps.open == 0), caps.open


def test_a_kept_alive_connection_made_room_for_is_closed_silently_unless_a_request_had_begun(capped):
    url, caps = capped
    assert until(lambda: caps.open == 0), caps.open
    caps.evict_after = 0.0
    port = int(url.rsplit(":", 1)[1])
    kept = []
    for _ in range(2):  # answered once each, kept alive (the oldest idle of their address)
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.4", 0))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/health", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        while not isinstance(e := conn.next_event(), h11.EndOfMessage):  # the whole answer read
            if e is h11.NEED_DATA:
                conn.receive_data(s.recv(65536))
            elif isinstance(e, h11.Response):
                assert e.status_code == 200
        kept.append(s)
    kept[1].sendall(b"GET /hea")  # the next request begun, not finished
    idle = flood(url, CLIENT_CAP - 2, "127.0.0.4")  # the address at its cap
    newcomers = flood(url, 2, "127.0.0.4")  # each closes the oldest idle one
    assert kept[0].recv(65536) == b""  # closed as a keep-alive timeout would close it
    got = answers([kept[1]], 1, timeout=5.0)[kept[1]]
    assert got[0].status_code == 503 and got[1]["error"]["code"] == "connection_closed_idle"
    assert answers(idle + newcomers, 1, timeout=0.5) == {}  # nobody else was closed
    for s in kept + idle + newcomers:
        s.close()
    assert until(lambda: caps.open == 0), caps.open
