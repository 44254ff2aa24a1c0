"""The README's and the docs' code runs as written, and their links lead somewhere.

Every ```python block in README.md and docs/**/*.md runs in a fresh interpreter (cwd: a temp dir, so files
it writes land there), and must exit 0 within TIMEOUT_S. Every `headwise ...` command line in a ```bash
block must parse with the real CLI parser (`build_parser().parse_args`, nothing is run). A block right
after an HTML comment `<!-- needs a server -->` talks to a running `headwise serve`: a python one is only
compiled, and its command lines still must parse. A python block right after `<!-- continues the block
above -->` goes on from the page's previous python block (its model, its names): the two run as one program. Every relative link (and its #anchor, for a page) must
resolve, and the benchmark tables in docs/benchmarks/ must match benchmarks/results/.

Blocks and pages are found generically, so blocks and pages added later are checked too. A python block
costs a fresh interpreter and, most often, a model load: continue an existing block rather than load again.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 600  # the slowest block loads two real models; a loaded 2-core machine is slow
NEEDS_SERVER = "<!-- needs a server -->"
CONTINUES = "<!-- continues the block above -->"


@dataclass
class Block:
    page: str  # the file, relative to the checkout: "README.md", "docs/analysis.md"
    lang: str
    line: int  # 1-based line of the opening fence
    section: str  # the heading above it
    code: str
    needs_server: bool
    continues: bool = False
    also: tuple[int, ...] = ()  # lines of the blocks that continue this one

    @property
    def where(self) -> str:
        return f"{self.page}:" + ", ".join(map(str, (self.line, *self.also)))

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:40]
        page = Path(self.page).with_suffix("").as_posix().replace("/", "-")
        return f"{page}-{self.lang}-L{self.line}-{slug}"


def page_blocks(text: str, page: str) -> list[Block]:
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
            code = "\n".join(body) + "\n"
            blocks.append(Block(page, m.group(1), start + 1, section, code, prev == NEEDS_SERVER, prev == CONTINUES))
        i += 1
    return blocks


def headwise_commands(code: str) -> list[list[str]]:
    """The `headwise ...` command lines of a shell block as argv lists (continuations joined,
    comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        if not line.lstrip().startswith("headwise"):  # curl with a JSON body over lines, cd, pip...
            continue
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "headwise":
            out.append(argv[1:])
    return out


def build_parser():
    # the CLI's home may move (a module or a package); `headwise.cli` re-exports its parser either way
    from headwise.cli import build_parser

    return build_parser()


def programs(blocks: list[Block]) -> list[Block]:
    """Python blocks as they run: each one that continues the block above joined onto it."""
    out: list[Block] = []
    for b in blocks:
        if b.lang != "python":
            continue
        if b.continues:
            assert out and out[-1].page == b.page, f"{b.where}: continues no python block of its page"
            first = out[-1]
            out[-1] = replace(first, code=first.code + "\n" + b.code, also=(*first.also, b.line))
        else:
            out.append(b)
    return out


BLOCKS = [b for p in PAGES for b in page_blocks(p.read_text(), p.relative_to(ROOT).as_posix())]
PYTHON = programs(BLOCKS)
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell", "console")]


def test_pages_have_the_blocks_we_expect():
    # a guard against the parser above silently finding nothing
    readme = [b for b in PYTHON if b.page == "README.md"]
    assert len(readme) >= 2 and len(PYTHON) >= 5 and any(headwise_commands(b.code) for b in SHELL)
    assert len(PAGES) >= 5, "docs/ has gone missing"
    assert {b.lang for b in BLOCKS} <= {"python", "bash", "sh", "shell", "console", "toml", "json", "text"}, (
        "a block in a language this test does not check"
    )


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block, tmp_path):
    if block.needs_server:
        compile(block.code, block.where, "exec")
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the checkout's headwise, from any cwd
    proc = subprocess.run(
        [sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{block.where} ({block.section}) failed:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_commands_parse(block, capsys):
    for argv in headwise_commands(block.code):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 0, f"{block.where}: `headwise {shlex.join(argv)}` does not parse:\n{err}"
            continue
        assert getattr(args, "func", None), f"{block.where}: `headwise {shlex.join(argv)}` names no subcommand"


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code, where a link is a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    out, seen = set(), {}
    for line in re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_benchmark_tables_match_results():
    # the docs' benchmark tables are generated: a result added or changed without a rerun shows here
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
