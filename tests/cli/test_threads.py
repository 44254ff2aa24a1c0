"""`--threads N` pins the torch thread count of `headwise generate | chat | embed`: the steps run N
threads whatever the machine is doing (as HEADWISE_THREADS=N), as torch reports it in the step."""

import threading

import pytest
import torch

from headwise.cli import main
from headwise.runtime import core
from headwise.runtime.threads import GOVERNOR, pin_threads


@pytest.fixture
def unpinned():
    before = torch.get_num_threads()
    yield
    pin_threads(None)
    torch.set_num_threads(before)


def test_generate_threads_pins_the_steps(monkeypatch, unpinned, capsys):
    seen = []
    step = core.Core.step

    def recording_step(self, *a, **kw):  # what torch runs in the stepping thread, after the fit
        out = step(self, *a, **kw)
        seen.append((threading.get_ident(), torch.get_num_threads(), self.threads))
        return out

    monkeypatch.setattr(core.Core, "step", recording_step)
    for n in (1, 2):
        seen.clear()
        assert main(["generate", "--threads", str(n), "--max-new-tokens", "3", "--prompt", "Hi"]) == 0
        assert GOVERNOR.pinned == n
        assert seen and {(c, t) for _, c, t in seen} == {(n, n)}


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--threads", "0", "--prompt", "Hi"])
    assert e.value.code == 2
    assert "--threads" in capsys.readouterr().err


def test_a_bad_headwise_threads_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("HEADWISE_THREADS", "0")
    assert main(["generate", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HEADWISE_THREADS='0' is not a thread count" in err[0]
