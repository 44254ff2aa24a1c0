"""The converted-GGUF cache: one directory per source file's content.

    <cache>/gguf/<file stem>-<key>/  config.json model.safetensors
                                     tokenizer.json tokenizer_config.json manifest.json

<cache> is $HEADWISE_CACHE or ~/.cache/headwise; <key> hashes CACHE_VERSION and the
file's bytes (SHA-256), never its path, so the same model installed in several
virtualenvs or clones shares one entry, and a changed file gets a fresh one. The hash
is remembered per (path, size, mtime, inode) under <cache>/gguf-sources/, so only a
new or changed file is read through. An entry is written to a temp dir and renamed
into place, so a reader never sees half of one; manifest.json (written last) records
every file's size. An entry that fails those checks or fails to parse is reported and
rebuilt. Weights are stored fp32 (the exact dequantized values) and come back
memory-mapped by safetensors. `headwise cache` lists the entries; --clean removes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from torch import Tensor

from ..core.paths import default_cache_dir
from .tokenizer import Tokenizer

CACHE_VERSION = 2  # bump when the conversion changes, so old entries are not reused (2: untrusted-file checks)
_MANIFEST = "manifest.json"


def content_key(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file's bytes (hex), memoized under cache_dir/gguf-sources by path, size, mtime and inode."""
    st = path.stat()
    memo = (
        cache_dir
        / "gguf-sources"
        / hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}".encode()).hexdigest()[:32]
    )
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    key = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(key)
        os.replace(tmp, memo)  # atomic: a reader sees the whole key or none
    except OSError:
        pass  # an unwritable cache only costs a re-hash next time
    return key


def cache_entry(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted copy of `path` lives: named by the file's content, not its location."""
    path = Path(path).resolve()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(f"{CACHE_VERSION}|{content_key(path, root)}".encode()).hexdigest()[:16]
    return root / "gguf" / f"{path.stem}-{key}"


def read(entry: Path) -> tuple[dict, dict[str, Tensor], Tokenizer] | None:
    """The cached (config, tensors, tokenizer), or None when absent or unusable (with a warning)."""
    if not entry.exists():
        return None
    try:
        manifest = json.loads((entry / _MANIFEST).read_text())
        if manifest.get("version") != CACHE_VERSION:
            raise ValueError(f"cache version {manifest.get('version')}, expected {CACHE_VERSION}")
        for name, size in manifest["files"].items():
            actual = (entry / name).stat().st_size
            if actual != size:
                raise ValueError(f"{name} has {actual} bytes, manifest says {size}")
        from safetensors.torch import load_file

        tensors = load_file(entry / "model.safetensors")
        config = json.loads((entry / "config.json").read_text())
        tokenizer = Tokenizer.from_dir(entry)
    except Exception as e:  # noqa: BLE001 -- any failure means the same: rebuild from the GGUF
        warnings.warn(f"GGUF cache entry {entry} is unusable ({type(e).__name__}: {e}); rebuilding it", stacklevel=3)
        return None
    return config, tensors, tokenizer


def write(entry: Path, config: dict, tensors: dict[str, Tensor], tokenizer: Tokenizer) -> None:
    """Store a conversion; failure to write is a warning, never an error (the load itself worked)."""
    from safetensors.torch import save_file

    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shared cache should not be
        files = {f.name: f.stat().st_size for f in tmp.iterdir()}
        (tmp / _MANIFEST).write_text(json.dumps({"version": CACHE_VERSION, "files": files}))
        if entry.exists():  # the unusable entry `read` reported
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)  # atomic: readers see all of it or none
        except OSError:
            if not (entry / _MANIFEST).is_file():  # not a concurrent writer winning the race
                raise
    except OSError as e:
        warnings.warn(
            f"could not write the GGUF cache at {entry} ({e}); the model loaded, but the next load converts again",
            stacklevel=3,
        )
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
