"""The parsed-GGUF cache: what reading a GGUF's metadata found, so a later load skips the parse.
The weights are never copied here: every load maps the GGUF where it lies (`mapped_tensors`) and
takes each tensor's bytes from the file, converting in memory only what must be (gguf.gguf_tensors).

    <cache>/gguf/<file stem>-<key>/  config.json tensors.json tokenizer.json
                                     tokenizer_config.json manifest.json

Parsing is the slow part (the reader walks a 49k-token vocabulary one string at a time: ~2 s for
SmolLM2), so an entry keeps its result: the config, the tokenizer and the tensor table (name, type,
dims, byte offset), ~2 MB for SmolLM2's 100 MB file. <cache> is $HEADWISE_CACHE or
~/.cache/headwise; <key> hashes CACHE_VERSION and the file's bytes (SHA-256), never its path, so
the same model installed in several virtualenvs or clones shares one entry, and an edited or
replaced file gets a fresh one. The hash is remembered per (path, size, mtime, inode) under
<cache>/gguf-sources/, so only a new or changed file is read through. An entry is written to a
temp dir and renamed into place, so a reader never sees half of one; manifest.json (written last)
records every file's size. An entry that fails those checks or fails to parse is reported and
rebuilt. `headwise cache` lists the entries; --clean removes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ..core.paths import default_cache_dir
from .tokenizer import Tokenizer

# bump when what an entry holds changes, so old entries are not reused (2: untrusted-file checks;
# 3: metadata only, the weights read from the GGUF in place)
CACHE_VERSION = 3
_MANIFEST = "manifest.json"
_TABLE = "tensors.json"


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
    """Where the parsed metadata of `path` lives: named by the file's content, not its location."""
    path = Path(path).resolve()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(f"{CACHE_VERSION}|{content_key(path, root)}".encode()).hexdigest()[:16]
    return root / "gguf" / f"{path.stem}-{key}"


# ---- the tensor table, and the tensors it finds in the mapped file ----------------------------


def tensor_table(reader, size: int) -> dict:
    """What `mapped_tensors` needs to find every tensor again without parsing: the file's size and
    byte order, and per tensor its name, GGML type, dims (ggml order) and absolute byte offset."""
    return {
        "size": size,
        "byte_order": reader.byte_order,
        "tensors": [
            [t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset)] for t in reader.tensors
        ],
    }


# GGML types the gguf reader hands out as typed arrays; every other type is bytes (rows, row bytes)
_ITEM_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}
_ITEM_TYPES |= {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def mapped_tensors(path: Path, table: dict) -> list:
    """The file's tensors as the gguf reader builds them (gguf.ReaderTensor: the same dtypes and
    shapes), each viewing a private copy-on-write map of the file where it lies: nothing is read
    until used, and the map closes when the last view goes. ValueError when the table does not fit
    the file (its size, or a span past the end): the caller reparses."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    size = path.stat().st_size
    if size != table["size"]:
        raise ValueError(f"the table is for a file of {table['size']} bytes, {path} has {size}")
    raw = np.memmap(path, dtype=np.uint8, mode="c").view(np.ndarray)  # plain views: no memmap per tensor
    order = table["byte_order"]
    out = []
    for name, ggml, dims, offset in table["tensors"]:
        kind = GGMLQuantizationType(ggml)
        block, type_bytes = GGML_QUANT_SIZES[kind]
        n_elems = int(np.prod(dims, dtype=object))
        n_bytes = n_elems * type_bytes // block
        if not 0 <= offset <= offset + n_bytes <= size:
            raise ValueError(f"tensor {name}: bytes {offset}..{offset + n_bytes} are not inside the file ({size})")
        shape = tuple(reversed(dims))
        item = _ITEM_TYPES.get(kind.name, np.uint8)
        if item is np.uint8:
            shape = quant_shape_to_byte_shape(shape, kind)
        data = raw[offset : offset + n_bytes].view(item)
        if order != "I":
            data = data.view(data.dtype.newbyteorder(order))
        out.append(
            ReaderTensor(
                name=name,
                tensor_type=kind,
                shape=np.array(dims, dtype=np.uint64),
                n_elements=n_elems,
                n_bytes=n_bytes,
                data_offset=offset,
                data=data.reshape(shape),
                field=None,
            )
        )
    return out


# ---- entries ----------------------------------------------------------------------------------


def read(entry: Path) -> tuple[dict, dict, Tokenizer] | None:
    """The cached (config, tensor table, tokenizer), or None when absent or unusable (with a warning)."""
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
        table = json.loads((entry / _TABLE).read_text())
        if not isinstance(table.get("size"), int) or not isinstance(table.get("tensors"), list):
            raise ValueError(f"{_TABLE} has no size or tensors")
        config = json.loads((entry / "config.json").read_text())
        tokenizer = Tokenizer.from_dir(entry)
    except Exception as e:  # noqa: BLE001 -- any failure means the same: rebuild from the GGUF
        unusable(entry, e)
        return None
    return config, table, tokenizer


def unusable(entry: Path, e: Exception) -> None:
    warnings.warn(f"GGUF cache entry {entry} is unusable ({type(e).__name__}: {e}); rebuilding it", stacklevel=4)


def write(entry: Path, config: dict, table: dict, tokenizer: Tokenizer) -> None:
    """Store a parse; failure to write is a warning, never an error (the load itself worked)."""
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        (tmp / _TABLE).write_text(json.dumps(table, separators=(",", ":")))
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
            f"could not write the GGUF cache at {entry} ({e}); the model loaded, but the next load parses again",
            stacklevel=3,
        )
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
