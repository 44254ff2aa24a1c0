"""`headwise chat` driven through a pseudo-terminal, as a user types: Ctrl-C (SIGINT) stops the
reply and keeps the conversation; Ctrl-C or Ctrl-D at the prompt quits with status 0."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Terminal:
    def __init__(self, *args, sigint_ignored: bool = False):
        master, slave = pty.openpty()
        # sigint_ignored: started as by nohup or a runner that ignores SIGINT (inherited across exec)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headwise.cli", "chat", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=ROOT,
            close_fds=True,
            preexec_fn=_ignore_sigint if sigint_ignored else None,
        )
        os.close(slave)
        self.fd, self.seen = master, ""

    def expect(self, pattern: str, timeout: float = 240) -> str:
        """Everything read until `pattern` (a regex) appears in the output after what was already matched."""
        deadline, start = time.monotonic() + timeout, len(self.seen)
        while not re.search(pattern, self.seen[start:]):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in:\n{self.seen[start:]}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    assert False, f"exited before {pattern!r}:\n{self.seen[start:]}"
        m = re.search(pattern, self.seen[start:])
        out, self.seen = self.seen[start : start + m.end()], self.seen[: start + m.end()]
        return out

    def type(self, text: str):
        os.write(self.fd, text.encode())

    def interrupt(self):
        self.proc.send_signal(signal.SIGINT)

    def wait(self) -> int:
        rc = self.proc.wait(timeout=60)
        try:
            while select.select([self.fd], [], [], 0.1)[0]:
                self.seen += os.read(self.fd, 4096).decode(errors="replace")
        except OSError:
            pass
        os.close(self.fd)
        return rc


def _prompt_tokens(reply: str) -> int:
    return int(re.search(r"\[finish_reason: interrupted \(Ctrl-C\); prompt (\d+) tokens", reply).group(1))


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["plain", "started-with-sigint-ignored"])
def test_ctrl_c_stops_the_reply_and_the_conversation_goes_on(sigint_ignored):
    t = Terminal("--max-new-tokens", "500", sigint_ignored=sigint_ignored)
    try:
        t.expect(r"you> ")
        t.type("Tell me a very long story about a dragon who learns to read, with many chapters.\n")
        t.expect(r"bot> \S+ \S+ \S+")  # a few words of the reply have streamed
        t.interrupt()
        first = t.expect(r"you> ")  # back at the prompt, the process alive
        assert t.proc.poll() is None and "Traceback" not in first
        t.type("Go on.\n")  # a shorter message than the first
        t.expect(r"bot> \S+")
        t.interrupt()
        second = t.expect(r"you> ")
        # the second prompt holds the first question and the interrupted reply: longer than the first
        # prompt although "Go on." is shorter; without history it would be shorter
        assert _prompt_tokens(second) > _prompt_tokens(first) + 3, (first, second)
        time.sleep(1)  # as a person would: input() is reading by then
        t.interrupt()  # Ctrl-C at an empty prompt quits
        assert t.wait() == 0, t.seen
        assert "Traceback" not in t.seen, t.seen
    finally:
        if t.proc.poll() is None:
            t.proc.kill()


def test_ctrl_d_at_the_prompt_quits_cleanly():
    t = Terminal()
    try:
        t.expect(r"you> ")
        time.sleep(1)
        t.type("\x04")  # Ctrl-D: end of input on a terminal
        assert t.wait() == 0, t.seen
        assert "Traceback" not in t.seen, t.seen
    finally:
        if t.proc.poll() is None:
            t.proc.kill()
