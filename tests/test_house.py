"""Small files (issue 39): no file of the package, Python or C, over 400 lines. The import graph's
rules and the one against run-time class changes are in test_layering.py."""

from __future__ import annotations

from pathlib import Path

import headwise

ROOT = Path(headwise.__file__).parent
MAX_LINES = 400  # STYLE.md: "a file over ~400 lines is usually two ideas"


def sources(*suffixes: str) -> list[Path]:
    return sorted(p for p in ROOT.rglob("*") if p.suffix in suffixes and "__pycache__" not in p.parts)


def test_no_file_over_400_lines():
    files = sources(".py", ".c", ".h")
    assert len(files) > 100  # the walk found the package, C sources included
    assert any(p.suffix == ".c" for p in files)
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by idea): {long}"
