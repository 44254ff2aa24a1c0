"""`headwise serve` before it serves: signals while it starts, and its port.

Ctrl-C or SIGTERM while the models loaded used to end in `terminate called without an active
exception` (exit 134): the interpreter finalized while the loader, a daemon thread, was inside
torch; CPython ends such a thread with pthread_exit, whose unwinding through C++ frames calls
std::terminate. A loader cannot be interrupted (it is in C++ for seconds to minutes), so until
the models have loaded a signal ends the process at once: one line, stdio flushed, os._exit,
which never finalizes the interpreter. Exit 0 for SIGTERM (a stop asked for, as an orchestrator
asks), 130 for SIGINT (as a shell reports Ctrl-C).

    guard()                  # SIGINT / SIGTERM -> stop_now(..., "starting") until uvicorn's handlers
    sock = bind(host, port)  # before anything loads: a busy port is one line (PortError), exit 2
    server_class()(uvicorn_config, app.state.serve).run(sockets=[sock])  # the signals while loading
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
from typing import Callable, NoReturn

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 0}
_before_exit: list[Callable[[], None]] = []  # what must not outlive the process (tensor-parallel followers)


def guard(stage: str = "starting") -> None:
    """From now until another handler replaces these (uvicorn's, once it runs): SIGINT and SIGTERM
    end the process with one line naming `stage` (stop_now). A signal ignored on entry (nohup, a
    shell's background job) stays ignored."""
    for sig in EXIT_CODES:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda s, _frame: stop_now(s, stage))


def before_exit(fn: Callable[[], None]) -> None:
    """Run fn (best effort) before stop_now / exit_now end the process: os._exit runs no atexit hook."""
    _before_exit.append(fn)


def stop_now(sig: int, stage: str) -> NoReturn:
    """One line, "headwise serve: stopped while loading (SIGTERM)", then exit_now(0 or 130)."""
    line = f"headwise serve: stopped while {stage} ({signal.Signals(sig).name})\n"
    exit_now(EXIT_CODES.get(sig, 128 + sig), "\n" + line if sys.stderr.isatty() else line)  # past the "^C"


def exit_now(code: int, line: str = "") -> NoReturn:
    """Flush stdio, write `line` to stderr, os._exit(code): for when threads that may be inside
    torch still run (a loader, an engine step), whose end at interpreter exit would abort."""
    for fn in _before_exit:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the process ends either way
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # closed, or a write this signal interrupted
            pass
    if line:
        try:
            os.write(2, line.encode())  # not print: the handler may have interrupted a print
        except OSError:
            pass
    os._exit(code)


def server_class():
    """uvicorn's Server, plus: a signal before the models have loaded ends the process (stop_now,
    "while loading") unless requests are in flight (an upstream model's: they drain first and
    `stopped_loading` says the rest to `headwise serve`); once loaded, a signal first marks the app
    as draining (/health and new requests on kept-alive connections get 503), and a drained
    shutdown exits 0 instead of re-raising the signal."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config, state):
            super().__init__(config)
            self.state = state  # serve.app.ServeState
            self.stopped_loading: int | None = None  # the signal that came while the models loaded

        def handle_exit(self, sig, frame):
            if not self.state.load_done.is_set():
                if not self.started or not self.server_state.tasks:
                    stop_now(sig, "loading")  # nothing to drain: the loader is abandoned (module docstring)
                self.stopped_loading = sig
            self.state.begin_drain()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return Server


class PortError(OSError):
    """The address cannot be bound; str() is the one line to print."""


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port (SO_REUSEADDR, as uvicorn binds), or PortError saying what
    to change. Listening at once: a second server binding the same port now fails here, not later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise PortError(_why(host, port, e)) from None
    sock.set_inheritable(False)
    return sock


def _why(host: str, port: int, e: OSError) -> str:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    alt = port + 1 if port < 65535 else 8000
    if e.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another server?): pick a free one, "
            f"e.g. --port {alt} (make run PORT={alt})"
        )
    if e.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied (ports below 1024 need root); use --port 8000 or above"
    if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
        return (
            f"cannot listen on {where}: --host {host} is not an address of this machine; use --host 127.0.0.1 "
            "(this machine only) or --host 0.0.0.0 (every interface)"
        )
    return f"cannot listen on {where}: {e.strerror or e}; check --host and --port"
