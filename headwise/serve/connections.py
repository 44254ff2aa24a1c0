"""Open connections capped per process and per client address ([server] max_connections,
max_connections_per_client), so idle sockets cannot take every file descriptor.

Without a cap, 20,000 clients that connect and dribble header bytes hold 20,000 descriptors:
accept() then fails with EMFILE, asyncio stops accepting for a second at a time, and /health
fails with everything else until they go. uvicorn's own `limit_concurrency` does not help: it
counts connections and requests only once a request has been parsed, so idle connections never
meet it, and at the limit it answers /health with a 503 like any other request.

Here every accepted connection is counted (timeouts.timed_h11 asks `admit`). At a cap:

- the oldest connection with no request in progress (nothing sent yet, part of the headers, or a
  kept-alive one between requests) that has been idle for `evict_after` seconds is closed to make
  room: at the per-client cap one of that address's own, at the process cap anyone's. A monitoring
  probe that sends its request at once gets in beside any number of idle sockets; a connection is
  safe for `evict_after` s after it opens, time enough for a request sent with the handshake.
- with none to close (every connection busy, or all younger than `evict_after`), the new
  connection is refused: a 503 with Retry-After and a JSON error naming the cap and its key, written
  before reading anything, then closed.

Defaults come from the open-files limit (RLIMIT_NOFILE): the soft limit is raised towards the hard
one when the caps need it (as Go does at start since 1.19); half the descriptors go to client
connections, at most 8,192, and half of those to any one address.
"""

from __future__ import annotations

import json
import logging
import resource
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .config import ConfigError, ServerSettings

log = logging.getLogger("headwise.serve")

MAX_CONNECTIONS = 8192  # an idle connection costs ~10-20 KB of Python objects: 8,192 of them ~150 MB
RESERVE_FDS = 256  # model files, logs, the engine's pipes, tensor-parallel followers, /health's socket
EVICT_AFTER_S = 0.5  # a new connection's request arrives with its handshake: 0.5 s covers a busy loop
RETRY_AFTER_S = 1  # connections come free as header_timeout ends the idle ones
LOG_EVERY_S = 10.0  # refusals come in floods: one log line per this many seconds

KEYS = {"process": "max_connections", "client": "max_connections_per_client"}


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft RLIMIT_NOFILE to `wanted` (at most the hard limit) when it is lower; the soft
    limit after. Only the soft limit moves: any process may raise it up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # a sandbox may refuse; the caps then follow the old limit
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
            return soft
        log.info("raised the open-files limit (RLIMIT_NOFILE soft) from %d to %d for client connections", soft, target)
        return target
    return soft if soft != resource.RLIM_INFINITY else 2**31


def resolve_caps(settings: ServerSettings | None = None) -> tuple[int, int]:
    """(max_connections, max_connections_per_client) for this process: the [server] values, or the
    defaults the open-files limit allows. Raises the soft limit where the caps need it."""
    s = settings or ServerSettings()
    want = s.max_connections or MAX_CONNECTIONS
    fds = raise_fd_limit(max(2 * want, want + RESERVE_FDS))
    if s.max_connections is None:
        most = max(1, min(MAX_CONNECTIONS, fds // 2))  # the other half: upstream sockets, files, the engine
    elif s.max_connections > fds - RESERVE_FDS:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise ConfigError(
            f"[server] max_connections = {s.max_connections} needs more open files than this process may "
            f"have ({fds}, hard limit {hard}; {RESERVE_FDS} stay for model files and sockets): lower it to at most "
            f"{max(1, fds - RESERVE_FDS)} or raise the limit (ulimit -n, LimitNOFILE= in systemd, docker --ulimit nofile=)"
        )
    else:
        most = s.max_connections
    per_client = s.max_connections_per_client or max(1, most // 2)
    return most, min(per_client, most)


def refusal(message: str, code: str, retry_after: int = RETRY_AFTER_S) -> bytes:
    """A whole HTTP/1.1 503 answer (OpenAI's error envelope), written before any request is read."""
    body = json.dumps(
        {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"retry-after: {retry_after}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


class ConnectionCaps:
    """The counts behind the caps, shared by one server's connections (one event loop: no locks).

    A connection is any object; `admit(conn, host)` says whether it may stay and which idle one to
    close first; `busy` / `idle` follow its requests; `closed` ends it. Also a Prometheus collector:
    `registry.register(caps)` adds headwise_connections_* to /metrics."""

    def __init__(self, max_connections: int, max_connections_per_client: int, evict_after: float = EVICT_AFTER_S):
        if max_connections < 1 or max_connections_per_client < 1:
            raise ValueError(
                f"max_connections={max_connections} and max_connections_per_client={max_connections_per_client} "
                "must both be >= 1"
            )
        self.max = max_connections
        self.per_client = max_connections_per_client
        self.evict_after = evict_after
        self.host: dict[object, str] = {}  # every admitted connection -> its client address
        self.count: dict[str, int] = {}  # client address -> open connections
        # connections with no request in progress -> since when, oldest first (dicts keep insertion order)
        self.idle_since: dict[object, float] = {}
        self.idle_by_host: dict[str, dict[object, float]] = {}
        self.refused = {"process": 0, "client": 0}
        self.evicted = {"process": 0, "client": 0}
        self._logged_at = 0.0
        self._unlogged = 0
        self._refusals: dict[tuple[str, str], bytes] = {}

    @classmethod
    def of(cls, settings: ServerSettings | None = None) -> "ConnectionCaps":
        return cls(*resolve_caps(settings))

    @property
    def open(self) -> int:
        return len(self.host)

    def admit(self, conn, host: str, now: float | None = None) -> tuple[bytes | None, object | None, bytes | None]:
        """-> (refusal, victim, notice): refusal is None or the whole 503 to write before closing `conn`;
        victim is None or an idle connection to close now (already uncounted) to make room, and notice
        the 503 to write to it first if it has not been answered before."""
        now = time.monotonic() if now is None else now
        scope = None
        if self.count.get(host, 0) >= self.per_client:
            scope, pool = "client", self.idle_by_host.get(host, {})
        elif self.open >= self.max:
            scope, pool = "process", self.idle_since
        victim = notice = None
        if scope is not None:
            victim = next(iter(pool), None)
            if victim is None or now - pool[victim] < self.evict_after:
                self.refused[scope] += 1
                self._log_refusal(host, scope)
                return self._refusal(scope, host), None, None
            self.evicted[scope] += 1
            notice = refusal(
                f"this connection sent no complete request within {self.evict_after:g} s and the server is at "
                f"{self._cap_words(scope, self.host[victim])}: it was closed to make room; send the request "
                "right after connecting",
                "connection_closed_idle",
            )
            self.closed(victim)
        self.host[conn] = host
        self.count[host] = self.count.get(host, 0) + 1
        self.idle(conn, now)
        return None, victim, notice

    def idle(self, conn, now: float | None = None) -> None:
        """`conn` has no request in progress (new, or between kept-alive requests): it may be closed
        to make room. A repeat call keeps its first time (bytes of a slow request do not renew it)."""
        host = self.host.get(conn)
        if host is None or conn in self.idle_since:
            return
        now = time.monotonic() if now is None else now
        self.idle_since[conn] = now
        self.idle_by_host.setdefault(host, {})[conn] = now

    def busy(self, conn) -> None:
        """`conn`'s request headers are in: it is never closed to make room while it runs."""
        if self.idle_since.pop(conn, None) is not None:
            self._drop_idle(conn, self.host[conn])

    def closed(self, conn) -> None:
        host = self.host.pop(conn, None)
        if host is None:
            return
        self.idle_since.pop(conn, None)
        self._drop_idle(conn, host)
        left = self.count[host] - 1
        if left:
            self.count[host] = left
        else:
            del self.count[host]

    def _drop_idle(self, conn, host: str) -> None:
        idle = self.idle_by_host.get(host)
        if idle is not None:
            idle.pop(conn, None)
            if not idle:
                del self.idle_by_host[host]

    def _cap_words(self, scope: str, host: str) -> str:
        if scope == "client":
            return f"its limit of {self.per_client} open connections from {host} ([server] {KEYS['client']})"
        return f"its limit of {self.max} open connections ([server] {KEYS['process']})"

    def _refusal(self, scope: str, host: str) -> bytes:
        """The 503 for a newcomer at a cap, kept per (cap, address): a flood asks for it thousands of times."""
        key = (scope, host if scope == "client" else "")
        answer = self._refusals.get(key)
        if answer is None:
            fix = "close idle connections or " if scope == "client" else ""
            why = (
                f"too many open connections: the server is at {self._cap_words(scope, host)} and none is idle; "
                f"{fix}retry in {RETRY_AFTER_S} s (the operator may raise [server] {KEYS[scope]})"
            )
            if len(self._refusals) >= 1024:  # many addresses: keep the memory bounded
                self._refusals.clear()
            answer = self._refusals[key] = refusal(why, "too_many_connections")
        return answer

    def _log_refusal(self, host: str, scope: str) -> None:
        now = time.monotonic()
        self._unlogged += 1
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "refused %d connection(s) in the last %g s (latest from %s): %s",
                self._unlogged,
                LOG_EVERY_S,
                host,
                self._cap_words(scope, host),
            )
            self._logged_at, self._unlogged = now, 0

    def collect(self):
        """Prometheus: open connections, the caps, refusals and closings to make room."""
        g = GaugeMetricFamily("headwise_connections_open", "open client connections of this process")
        g.add_metric([], float(self.open))
        yield g
        g = GaugeMetricFamily(
            "headwise_connections_limit", "open connections allowed, by cap ([server] key)", labels=["key"]
        )
        g.add_metric([KEYS["process"]], float(self.max))
        g.add_metric([KEYS["client"]], float(self.per_client))
        yield g
        c = CounterMetricFamily(
            "headwise_connections_refused", "new connections answered 503 at a cap ([server] key)", labels=["key"]
        )
        for scope, n in self.refused.items():
            c.add_metric([KEYS[scope]], float(n))
        yield c
        c = CounterMetricFamily(
            "headwise_connections_evicted",
            "idle connections closed to make room for a new one at a cap ([server] key)",
            labels=["key"],
        )
        for scope, n in self.evicted.items():
            c.add_metric([KEYS[scope]], float(n))
        yield c
