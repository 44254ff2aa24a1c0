"""A served process gives its freed C heap back to the OS while its engines are idle.

torch frees a step's activations (and the loader its read buffers) with free(), and glibc keeps
what it can in its heaps for reuse: `headwise serve smollm2` stayed ~40 MiB above its start-up
size after 16 clients had gone, every byte of it free. `malloc_trim(0)` returns those pages;
once all engines are idle (never while one steps, so decoding never pays for it) and resident
memory has grown by `slack` bytes since the last trim, `IdleTrim` calls it (benchmarks/serving.py
--llama shows the effect; docs/serving.md "Memory"). No glibc (musl, macOS): nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger("headwise.serve")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _libc_trim()


def resident_bytes() -> int | None:
    """This process's resident set (VmRSS), or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def malloc_trim() -> bool:
    """Return the C heaps' free pages to the OS; False where there is no glibc to ask."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class IdleTrim:
    """A daemon thread: every `interval` s, if no engine has work and resident memory grew by
    `slack` bytes since the last trim, trim. `busy()` says whether any engine has work."""

    def __init__(self, busy, interval: float = 1.0, slack: int = 8 << 20):
        self.busy, self.interval, self.slack = busy, interval, slack
        self.trims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._after: int | None = None  # resident bytes after the last trim

    def start(self) -> "IdleTrim":
        if _TRIM is not None and resident_bytes() is not None:
            self._thread = threading.Thread(target=self._run, name="headwise-idle-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def trim_now(self) -> None:
        """Trim at once (a model has just loaded: the loader's buffers are free) and note the size."""
        before = resident_bytes()
        if malloc_trim():
            self.trims += 1
            self._after = resident_bytes()
            if before is not None and self._after is not None:
                log.debug("malloc_trim: resident %d -> %d MiB", before >> 20, self._after >> 20)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                now = resident_bytes()
                if now is None or (self._after is not None and now < self._after + self.slack) or self.busy():
                    continue
                self.trim_now()
            except Exception:  # never let housekeeping take the server down
                log.exception("idle trim failed; stopping it")
                return
