"""A streamed answer's chunks written by the engine's stepping thread, straight to the client.

One client streaming from `headwise serve` used to pay, per token, for a trip through the event
loop: the engine thread wakes the loop, the piece climbs four async generators, SSE is formatted,
uvicorn frames and writes it, and the engine waits for all of that (it holds the GIL) before its
next step: ~0.4 ms of a ~4 ms token on a 2-core machine, and two thread wake-ups. Here the
stepping thread formats the chunk and writes it to the socket itself (~0.05 ms), and the loop
wakes only for the stream's first and last pieces.

    direct = DirectWriter.of(request.scope)          # None: this connection cannot (see below)
    gen = engine.stream(ids, sampling, direct=direct)  # the engine offers it pieces in order
    direct.start(fmt)                                # once the response has started: piece -> bytes
    ...
    direct.close()                                   # before the loop writes again (last piece)

The engine offers a piece only when the reader has passed every earlier piece through its
consumer (engine/frontends.py), so chunks stay in order; the loop writes the last ones (usage,
[DONE]) itself. A write that would block (a client that does not read) sends the rest through the
loop and hands every later piece back to it; a client that is gone (EPIPE) raises, and the
engine aborts the request as for any sink that fails.

Only where the framing is ours to write: HTTP/1.1 (chunked) over plain TCP, through the server's
protocol class (timeouts.py), which puts its transport in the scope's extensions. The socket is
dup()ed while armed, so a connection that uvicorn closes cannot hand its descriptor number to
another client under a write in flight.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Callable

SCOPE_KEY = "headwise.transport"  # scope["extensions"][SCOPE_KEY]: the connection's asyncio transport


class DirectWriter:
    def __init__(self, transport, loop: asyncio.AbstractEventLoop):
        self.transport, self.loop = transport, loop
        self.format: Callable | None = None  # piece -> bytes to send, or None (nothing to send)
        self.fd: int | None = None  # our duplicate of the socket, while armed
        self.lock = threading.Lock()  # a write in flight vs close()
        self.written = 0  # pieces written here (tests, stats)

    @classmethod
    def of(cls, scope: dict) -> "DirectWriter | None":
        transport = (scope.get("extensions") or {}).get(SCOPE_KEY)
        if sys.platform == "win32" or transport is None or scope.get("http_version") != "1.1" or transport.is_closing():
            return None
        if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("socket") is None:
            return None
        return cls(transport, asyncio.get_running_loop())

    def start(self, format: Callable) -> None:
        """Arm (loop thread): format(piece) -> the SSE bytes of a piece, or None when the piece
        sends nothing (text held back); it runs in the stepping thread."""
        with self.lock:
            if self.fd is None and not self.transport.is_closing():
                self.format, self.fd = format, os.dup(self.transport.get_extra_info("socket").fileno())

    def close(self) -> None:
        """Disarm: later pieces go through the loop (which may write at once after this)."""
        with self.lock:
            self._disarm()

    def _disarm(self) -> None:  # under self.lock
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __call__(self, piece) -> bool:
        """Write one piece's chunk (stepping thread); False: not taken, the loop must send it."""
        with self.lock:
            if self.fd is None or self.transport.get_write_buffer_size():
                return False
            body = self.format(piece)
            if body is None:
                return True
            data = b"%x\r\n%b\r\n" % (len(body), body)  # one HTTP/1.1 chunk
            try:
                n = os.write(self.fd, data)
            except BlockingIOError:
                n = 0
            except OSError:  # the client is gone: the engine aborts the request
                self._disarm()
                raise
            self.written += 1
            if n < len(data):  # the socket's buffer is full: the rest, and all that follows, via the loop
                self.loop.call_soon_threadsafe(self.transport.write, data[n:])
                self._disarm()
            return True
