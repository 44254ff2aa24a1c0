"""Read timeouts for request headers and bodies, which uvicorn does not have.

uvicorn times out only an idle kept-alive connection between requests: a client that opens a
connection and sends nothing, or sends part of the headers or of the body and then goes
silent (slowloris), holds its connection, socket and task forever. `timed_h11(header_s,
body_s)` is uvicorn's h11 protocol plus two clocks:

- headers: from the connection's start, or from the first byte of the next request on a
  kept-alive connection, until the request's headers are complete;
- body: from the end of the headers until the end of the body (the whole body, not the
  gap between two reads, so a trickle of one byte a minute still ends).

When a clock runs out and no answer has started, the client gets 408 with the OpenAI error
envelope and the connection is closed. Every connection is also counted against the open
connection caps (connections.py): one over a cap is answered 503 before anything is read, or an
idle one is closed to make room. Pass the class to uvicorn.Config(http=...); its `caps` is a
Prometheus collector for /metrics.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .connections import ConnectionCaps
from .direct import SCOPE_KEY

CONNECTION_KEY = "headwise.connection"  # scope["extensions"][CONNECTION_KEY]: the transport (streams.py)


def _408(what: str, seconds: float) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the request's {what} did not arrive within {seconds:g} s "
                f"([server] {what}_timeout); the connection is closed",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    return head + body


def timed_h11(
    header_timeout: float, body_timeout: float, direct: bool = True, caps: ConnectionCaps | None = None
) -> type[H11Protocol]:
    """direct: put the connection's transport in each request's scope (False: `[server] direct_streams
    = false`, every stream's chunks go through the event loop). caps: the open connection caps
    (`ConnectionCaps.of(config.server)`); None: the defaults the open-files limit allows."""
    caps = caps if caps is not None else ConnectionCaps.of()

    class TimedH11Protocol(H11Protocol):
        _header_clock = _body_clock = None
        _scope = None  # the request's scope, behind the `scope` property
        _counted = False  # admitted by `caps` and not yet closed to make room
        _answered = False  # a response has been completed on this connection

        # Each request's scope carries the connection's transport (direct.py writes a stream's
        # chunks to it from the engine's thread): uvicorn assigns self.scope per request.
        @property
        def scope(self):
            return self._scope

        @scope.setter
        def scope(self, scope) -> None:
            if scope is not None:
                extensions = scope.setdefault("extensions", {})
                extensions[CONNECTION_KEY] = self.transport  # a stream whose client stops reading is reset
                if direct:
                    extensions[SCOPE_KEY] = self.transport
            self._scope = scope

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            refused, victim, notice = caps.admit(self, self.client[0] if self.client else "local")
            if refused is not None:  # over a cap, nothing idle to close: the whole answer, unread request
                transport.write(refused)
                transport.close()
                return
            self._counted = True
            if victim is not None:
                victim._make_room(notice)
            self._header_clock = self.loop.call_later(header_timeout, self._expired, "header", header_timeout)

        def _should_upgrade(self) -> bool:
            """No WebSockets here: uvicorn would hand an `Upgrade: websocket` connection to a protocol of
            its own, whose close this one never sees (a flooder would fill the caps for good); the
            request is answered as plain HTTP instead."""
            return False

        def _make_room(self, notice: bytes) -> None:
            """Closed for a new connection at a cap (`caps` has uncounted it): one with a request begun (or
            never answered) gets the 503 that says why; a silent kept-alive one is closed as its keep-alive
            end would close it."""
            self._counted = False
            if not self.transport.is_closing():
                if not self._answered or self.conn.trailing_data[0]:
                    self.transport.write(notice)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._update_clocks()

        def on_response_complete(self) -> None:
            self._answered = True
            super().on_response_complete()  # may start the next pipelined request
            self._update_clocks()

        def connection_lost(self, exc) -> None:
            self._stop("_header_clock")
            self._stop("_body_clock")
            if self._counted:
                self._counted = False
                caps.closed(self)
            super().connection_lost(exc)

        def _update_clocks(self) -> None:
            if self.transport.is_closing():
                return
            theirs = self.conn.their_state
            if self._counted and theirs is h11.IDLE:  # no request in progress: may be closed to make room
                caps.idle(self)
            elif self._counted:
                caps.busy(self)
            if theirs is h11.IDLE:
                # between requests: uvicorn's keep-alive timer covers silence; a started request is ours
                if self._header_clock is None and self.conn.trailing_data[0]:
                    self._header_clock = self.loop.call_later(header_timeout, self._expired, "header", header_timeout)
                return
            self._stop("_header_clock")
            if theirs is h11.SEND_BODY:
                if self._body_clock is None:
                    self._body_clock = self.loop.call_later(body_timeout, self._expired, "body", body_timeout)
            else:  # DONE (or closed/error): the request is in
                self._stop("_body_clock")

        def _stop(self, name: str) -> None:
            clock = getattr(self, name)
            if clock is not None:
                clock.cancel()
                setattr(self, name, None)

        def _expired(self, what: str, seconds: float) -> None:
            setattr(self, f"_{what}_clock", None)
            if self.transport.is_closing():
                return
            self.logger.info(
                "closing a connection from %s: its request %s took over %g s",
                "%s:%d" % self.client if self.client else "a client",
                what,
                seconds,
            )
            cycle = self.cycle if what == "body" else None
            if cycle is None or not cycle.response_started:
                self.transport.write(_408(what, seconds))
            if cycle is not None:  # the app sees http.disconnect and stops reading
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

    TimedH11Protocol.caps = caps
    return TimedH11Protocol
