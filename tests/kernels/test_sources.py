"""The C sources' layout (headwise/kernels/csrc/generic/kernels.h): ggml-cpu's, generic/ plus one folder
per ISA, each file short, the ISA chosen by which files a variant compiles, not by #if."""

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "headwise" / "kernels" / "csrc"
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".c", ".h"))


def test_the_tree_has_generic_and_one_folder_per_isa():
    assert {p.parent.relative_to(CSRC).as_posix() for p in SOURCES} == {"generic", "x86/avx2", "x86/avx512"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(CSRC).as_posix())
def test_a_source_is_short_and_has_no_isa_conditionals(path):
    text = path.read_text()
    assert text.count("\n") <= 400, f"{path.name}: {text.count(chr(10))} lines (at most 400: split it)"
    conditionals = [line for line in text.splitlines() if re.match(r"\s*#\s*(if|ifdef|elif|else)\b", line)]
    guard = [line for line in conditionals if re.match(r"\s*#\s*ifndef HW_\w+_H\b", line)]
    assert conditionals == guard, f"{path.name}: {conditionals} (per-ISA code goes in x86/<isa>/ files)"
