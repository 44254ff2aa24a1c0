"""A replica set as a gateway target: send to one replica, and when it dies mid-stream, finish the
stream on another without the client noticing.

Before the first byte, a replica that cannot be reached, answers 503 (loading, draining) or 5xx,
or is at capacity (429) is passed over for the next one the pool picks (replicas.py); a client's
mistake (400, 413) is the same on every replica and goes back as it is. A non-streamed request
that breaks is sent again from the start (the client has seen nothing).

A stream asks its replica for the token ids of each chunk (`"headwise": {"token_ids": true}`,
stripped again before the client sees a chunk, unless the client asked for them itself). When
the replica dies (connection cut, an event that does not come within `timeout`, no [DONE], an
error event such as a drain's), the gateway sends the same request to another replica with
`"headwise": {"resume": {"token_ids": <ids so far>, "text_chars": <characters sent>}}`: that
replica reads prompt + ids as its prompt (for chat, the chat-templated messages + ids), counts
max_tokens from the original, and its detokenizer and stop strings pick up at the seam
(runtime/output.py Resume). The client's stream goes on with the same id and `created`; no
text is repeated or lost. Greedy decoding gives the text of an uninterrupted run; seeded sampling
too (the resumed request skips the random draws already made); unseeded sampling continues
from the same text but draws afresh. One completion per stream only: n > 1 and a batch of
prompts end with an error event, as before. The replicas are headwise servers configured here,
so their error messages are passed on (an upstream provider's never are: upstream.py).
A replica accepts `resume` only from a request with its key ([server] accept_resume); the
gateway passes on a client's own `resume` only where it would accept it itself.
What a replica sends back is read as a provider's is (upstream_body.py): decoded under a cap, a
body held whole up to max_response_bytes; a stream's leg dies when no event came for its idle
timeout (`:` keep-alives do not count), and the client's stream ends at its total timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
from fastapi import Request
from fastapi.responses import Response

from .config import ReplicaSet
from .errors import APIError
from .openai.common import SSE_DONE, require_peer, sse
from .openai.streams import EventStream
from .replicas import Replica, ReplicaPool, affinity_key
from .upstream import MAX_ERROR_BYTES, PATHS, Events, Fault
from .upstream_body import ACCEPT_ENCODING, decoded, read_capped

log = logging.getLogger("headwise.serve")

_DONE = object()  # a leg's [DONE]


def limits(spec: ReplicaSet) -> tuple[int, float, float]:
    """-> (max_response_bytes, idle_timeout, total_timeout) of a replica set: [replicas.NAME] limits,
    as [providers.NAME] has them (issue 43). Without them a 1.5 GB answer was read whole and `:`
    keep-alives held a stream forever."""
    return spec.max_response_bytes, spec.idle_timeout, spec.total_timeout


class _Pass(Exception):
    """This replica cannot take the request now; try another."""

    def __init__(self, error: APIError):
        self.error = error


class Leg:
    """One replica's stream of a client's stream; its in-flight count is held until close()."""

    def __init__(self, replica: Replica, resp: httpx.Response, events: Events):
        self.replica, self.resp, self.events, self.closed = replica, resp, events, False
        self.first = None

    async def next(self):
        """The next event as a dict, or _DONE. Raises Fault, httpx.HTTPError."""
        while True:
            raw = await self.events.next()
            if raw is None:
                raise Fault("truncated", "ended the stream without data: [DONE]", code="replica_truncated")
            if raw == SSE_DONE:
                return _DONE
            if raw != b":\n\n":
                return self.events.event

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.replica.in_flight -= 1
            await self.resp.aclose()  # the replica sees the hang-up and frees the request's blocks


class Progress:
    """What the client has of one stream: the ids and characters to resume from, and the id and
    `created` every later chunk carries."""

    def __init__(self, endpoint: str, body: dict, client_ids: bool):
        self.chat, self.client_ids = endpoint == "chat", client_ids
        prompt = body.get("prompt")
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        self.resumable = (body.get("n") or 1) == 1 and not batch
        self.ids: list[int] = []
        self.chars = 0
        self.head: tuple | None = None  # (id, created) of the first replica's chunks
        self.role_sent = self.finished = False

    def take(self, event: dict) -> bytes | None:
        """A replica's chunk -> the client's (or None: nothing in it for the client)."""
        hw = event.pop("headwise", None)
        if isinstance(hw, dict) and isinstance(hw.get("token_ids"), list):
            self.ids += hw["token_ids"]
        if self.head is None:
            self.head = (event.get("id"), event.get("created"))
        else:
            event["id"], event["created"] = self.head
        visible = bool(event.get("usage")) or self.client_ids
        for c in event.get("choices") or ():
            if not isinstance(c, dict):
                continue
            if c.get("index", 0) != 0:
                self.resumable = False
            if self.chat:
                delta = c.get("delta") or {}
                if "role" in delta:
                    if self.role_sent:  # a fresh replica greets again: once is enough
                        del delta["role"]
                    self.role_sent = visible = True
                text = delta.get("content") or ""
            else:
                text = c.get("text") or ""
            self.chars += len(text)
            visible = visible or bool(text or c.get("finish_reason") or c.get("logprobs"))
            self.finished = self.finished or bool(c.get("finish_reason"))
        if self.client_ids and hw is not None:
            event["headwise"] = hw
        return sse(event) if visible else None


class ReplicaTarget:
    """Model `model` on the replicas of `spec` (clients send "NAME/model")."""

    settles_streams = True  # a stream's outcome is known at its end: the gateway's settle(ok)

    def __init__(self, name: str, spec: ReplicaSet, model: str, pool: ReplicaPool, client: httpx.AsyncClient):
        self.name, self.spec, self.model, self.pool, self.client = name, spec, model, pool, client
        self.owner = spec.name

    # ---- one replica --------------------------------------------------------------
    def _passed(self, replica: Replica, status: int, content: bytes, headers) -> Exception:
        try:
            error = json.loads(content).get("error") or {}
        except (ValueError, AttributeError):
            error = {}
        said = error.get("message") if isinstance(error.get("message"), str) else f"status {status}"
        where = f"replica {replica.url} of {self.name}"
        if status in (400, 413, 422):  # the client's request: the same on every replica
            return APIError(400 if status == 422 else status, said, code=error.get("code"), param=error.get("param"))
        if status == 429:
            retry = headers.get("retry-after")
            return _Pass(
                APIError(
                    429,
                    f"{where} is at capacity: {said}",
                    code="queue_full",
                    retry_after=float(retry) if retry and retry.replace(".", "", 1).isdigit() else None,
                )
            )
        if status == 503:  # loading or draining: out until /health says otherwise
            self.pool.down(replica, f"answered 503 ({error.get('code') or said})")
        elif status == 404:
            said = f"it answered 404 ({said}); check [replicas.{self.spec.name}] models"
        elif status in (401, 403):
            said = f"it refused the key ({status}); check [replicas.{self.spec.name}] api_key_env"
        return _Pass(APIError(502, f"{where} failed: {said}", code="replica_error"))

    async def _open(self, replica: Replica, endpoint: str, body: dict, limit: float, stream: bool):
        """Send to one replica -> a Leg whose first event is read (stream) or the whole answer.
        Raises _Pass (try another), APIError (the client's mistake, or a timeout)."""
        key = self.spec.api_key
        request = self.client.build_request(
            "POST",
            replica.url + "/v1" + PATHS[endpoint],
            json=body,
            headers={"Accept-Encoding": ACCEPT_ENCODING, **({"Authorization": f"Bearer {key}"} if key else {})},
            timeout=httpx.Timeout(self.spec.timeout, connect=min(limit, 10.0)),
        )
        cap, where = limits(self.spec)[0], f"replica {replica.url} of {self.name}"
        replica.in_flight += 1
        resp = leg = None
        try:
            async with asyncio.timeout(limit):  # until the first event (stream) or the whole answer
                resp = await self.client.send(request, stream=True)
                if resp.status_code != 200:
                    try:
                        content = await read_capped(decoded(resp), MAX_ERROR_BYTES, "an error body")
                    except Fault:
                        content = b""
                    raise self._passed(replica, resp.status_code, content, resp.headers)
                if not stream:
                    return await read_capped(decoded(resp), cap, f"[replicas.{self.spec.name}] max_response_bytes")
                leg = Leg(replica, resp, Events(decoded(resp), key))
                leg.first = await leg.next()
                return leg
        except TimeoutError:
            raise APIError(504, f"{where} sent nothing within {limit:g} s", code="timeout")
        except Fault as e:
            if e.kind != "too_large":  # too large: the same answer on every replica, which is up
                raise _Pass(self._down(replica, e, where))
            raise APIError(502, f"{where} {e.what}", code=e.code) from None
        except httpx.HTTPError as e:
            raise _Pass(self._down(replica, e, where))
        finally:
            if leg is None or leg.first is None:  # not handed on: release it here
                replica.in_flight -= 1
                if resp is not None:
                    await resp.aclose()

    def _down(self, replica: Replica, e: Exception, where: str) -> APIError:
        why = f"{type(e).__name__}: {e}" if isinstance(e, Fault) else type(e).__name__
        self.pool.down(replica, why)
        return APIError(502, f"{where} failed ({why})", code="replica_error")

    def _deadlines(self, leg: Leg, start: float) -> Leg:
        """From its first event on, a leg has the set's idle timeout, and the client's stream
        (every leg of it) its total timeout counted from `start`."""
        _, idle, total = limits(self.spec)
        leg.events.deadlines(idle, total, start, f"[replicas.{self.spec.name}] ")
        return leg

    async def _first(self, endpoint, body, key, limit, stream, metrics, how=None, exclude=()):
        """Pick replicas until one answers -> (its Leg or answer, the replicas tried)."""
        tried, last = set(exclude), None
        while True:
            replica, chosen = self.pool.pick(self.model, key, exclude=tried)
            if replica is None:
                raise last or APIError(
                    503,
                    f"no replica of {self.name} is up ({self.pool.reasons(self.model)}); retry shortly",
                    code="no_replica",
                    retry_after=self.spec.health_interval,
                )
            tried.add(replica)
            try:
                got = await self._open(replica, endpoint, body, limit, stream)
            except _Pass as p:
                last = p.error
                continue
            if metrics:
                metrics.replica_request(self.name, replica.url, how or (chosen if len(tried) == 1 else "retry"))
            return got, tried

    # ---- the gateway's call -----------------------------------------------------------
    async def handle(self, endpoint: str, req, body: dict, request: Request, model: str, timeout, metrics, settle=None):
        limit = timeout or self.spec.timeout
        start = asyncio.get_running_loop().time()
        stream = bool(body.get("stream")) and endpoint != "embeddings"
        key = affinity_key(endpoint, body, self.spec.affinity_chars)
        own = dict(body.get("headwise") or {})
        if own.get("resume") is not None:  # the replica trusts our key: pass on only what we would accept
            require_peer()
        send = {**body, "model": self.model}
        if stream:
            send["headwise"] = {**own, "token_ids": True}
        got, tried = await self._first(endpoint, send, key, limit, stream, metrics)
        if not stream:
            return Response(got, media_type="application/json")
        progress = Progress(endpoint, body, bool(own.get("token_ids")))
        self._deadlines(got, start)

        async def resume() -> Leg:
            hw = {**own, "token_ids": True}
            if progress.ids:  # after what the client resumed from itself, if it did
                before = own.get("resume") or {"token_ids": [], "text_chars": 0}
                hw["resume"] = {
                    "token_ids": before["token_ids"] + progress.ids,
                    "text_chars": before["text_chars"] + progress.chars,
                }
            leg, more = await self._first(
                endpoint, {**send, "headwise": hw}, key, limit, True, metrics, "resume", tried
            )
            tried.update(more)
            return self._deadlines(leg, start)

        return EventStream(self._relay(got, progress, resume, metrics, settle), request)

    async def _relay(self, leg: Leg, progress: Progress, resume, metrics, settle):
        """Relay a stream, moving it to another replica when its own dies. Settles the target
        when the stream ends (a client that hangs up reports nothing)."""
        ended = ok = False
        moves, event = 0, leg.first
        try:
            while True:
                try:
                    if event is None:
                        event = await leg.next()
                    if event is _DONE:
                        ended = ok = True
                        yield SSE_DONE
                        return
                    out = progress.take(event)
                    event = None
                    if out is not None:
                        yield out
                    continue
                except (Fault, httpx.HTTPError) as e:
                    why = e.what if isinstance(e, Fault) else f"broke off the stream ({type(e).__name__})"
                    dead = leg.replica
                    await leg.close()
                    expired = isinstance(e, Fault) and asyncio.get_running_loop().time() >= leg.events.end
                    if not expired:  # the client's time being up is no fault of the replica's
                        self.pool.down(dead, why)
                if progress.finished:  # every token is out; only [DONE] was missing
                    ended = ok = True
                    yield SSE_DONE
                    return
                error = None
                if expired or not progress.resumable or moves >= self.spec.failovers:
                    more = "n > 1 or a batch of prompts" if not progress.resumable else f"{moves} failovers"
                    more = "the stream's time is up" if expired else more
                    error = APIError(502, f"replica {dead.url} of {self.name} {why}; cannot resume ({more})")
                else:
                    try:
                        leg = await resume()
                    except APIError as e:
                        error = APIError(502, f"replica {dead.url} of {self.name} {why}; resuming failed: {e.message}")
                if metrics:
                    metrics.failover(self.name, "failed" if error else "resumed")
                if error is not None:
                    ended = True
                    log.warning("%s", error.message)
                    yield sse({"error": {**error.body()["error"], "code": "replica_failed"}})
                    yield SSE_DONE
                    return
                moves += 1
                log.warning("replica %s of %s %s; the stream goes on at %s", dead.url, self.name, why, leg.replica.url)
                event = leg.first
        finally:
            await leg.close()
            if ended and settle:
                settle(ok)
