"""Without the `serve` extra, every form of `headwise serve` is one line naming the install, not
argparse's "unrecognized arguments" for the flags the missing parser would have known."""

import re
import sys

import pytest

from headwise import cli


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["serve", "--port", "8123"],
        ["serve", "smollm2", "--host", "0.0.0.0", "--port", "9000"],
        ["serve", "model.gguf", "--tensor-parallel", "2", "--self-check"],
        ["serve", "--config", "examples/gateway.toml"],
        ["serve", "--help"],
    ],
    ids=["bare", "port", "model-host-port", "file-flags", "config", "help"],
)
def test_serve_without_its_extra_says_what_to_install(argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails as if not installed
    monkeypatch.setattr(cli, "_UNAVAILABLE", {})
    monkeypatch.setattr("headwise.core.threads.configure_wait_policy", lambda threaded=False: None)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "headwise serve: cannot import 'uvicorn'; install the extra: pip install \"headwise[serve]\""
    ]


def test_serve_is_still_listed_in_help_without_its_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    monkeypatch.setattr(cli, "_UNAVAILABLE", {})
    monkeypatch.setattr("headwise.core.threads.configure_wait_policy", lambda threaded=False: None)
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert re.search(
        r"serve\s+serve models behind the OpenAI API.*\[unavailable\s+here\]", capsys.readouterr().out, re.S
    )
