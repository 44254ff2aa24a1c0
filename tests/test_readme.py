"""The README's code runs as written.

Every ```python block runs in a fresh interpreter (cwd: a temp dir, so files it writes land there),
and must exit 0 within TIMEOUT_S. Every `headwise ...` command line in a ```bash block must parse
with the real CLI parser (`headwise.cli.build_parser().parse_args`, nothing is run). A block right
after an HTML comment `<!-- needs a server -->` talks to a running `headwise serve`: a python one
is only compiled, and its command lines still must parse.

Blocks are found generically, so blocks added to the README later are checked too.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 600  # the slowest block loads two real models; a loaded 2-core machine is slow
NEEDS_SERVER = "<!-- needs a server -->"


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    section: str  # the heading above it
    code: str
    needs_server: bool

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:40]
        return f"{self.lang}-L{self.line}-{slug}"


def readme_blocks(text: str) -> list[Block]:
    blocks, section, lines, i = [], "top", text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        m = re.match(r"^```(\w+)\s*$", line)
        if m:
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            blocks.append(Block(m.group(1), start + 1, section, "\n".join(body) + "\n", prev == NEEDS_SERVER))
        i += 1
    return blocks


def headwise_commands(code: str) -> list[list[str]]:
    """The `headwise ...` command lines of a shell block as argv lists (continuations joined,
    comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "headwise":
            out.append(argv[1:])
    return out


BLOCKS = readme_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell", "console")]


def test_readme_has_the_blocks_we_expect():
    # a guard against the parser above silently finding nothing
    assert len(PYTHON) >= 5 and any(headwise_commands(b.code) for b in SHELL)
    assert {b.lang for b in BLOCKS} <= {"python", "bash", "sh", "shell", "console", "toml", "json", "text"}, (
        "a README block in a language this test does not check"
    )


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block, tmp_path):
    if block.needs_server:
        compile(block.code, f"README.md:{block.line}", "exec")
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(README.parent)  # the checkout's headwise, from any cwd
    proc = subprocess.run(
        [sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"README.md line {block.line} ({block.section}) failed:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_commands_parse(block, capsys):
    from headwise.cli import build_parser

    for argv in headwise_commands(block.code):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 0, f"README.md line {block.line}: `headwise {shlex.join(argv)}` does not parse:\n{err}"
            continue
        assert getattr(args, "func", None), f"`headwise {shlex.join(argv)}` names no subcommand"
