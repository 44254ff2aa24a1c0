"""A GGUF file -> (HF-style config, HF-named float tensors, Tokenizer).

    config, tensors, tokenizer = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")

The file is parsed with the `gguf` package, tensors are dequantized by
`headwise.models.quants`, and llama.cpp's conversion is undone per architecture
(gguf_arch.py: names, llama's Q/K row order, Gemma's 1 + w norms, GPT-2's
transposes; llama, qwen2, qwen3, phi3, gemma2, gemma3, gpt2, bert) so the result
equals the checkpoint the file was converted from, as transformers loads it.
The weights are read from the file where it lies (a private map), never copied to
disk. Parsing the metadata is slow in pure Python (the reader walks a 49k-token
vocabulary and its merges one string at a time), so `read_gguf` keeps what it
found (config, tokenizer, tensor table: a few MB) in a cache (`gguf_cache.py`).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from . import gguf_cache
from .chat_template import TemplateText
from .gguf_cache import cache_entry, default_cache_dir  # noqa: F401 -- part of this module's API
from .linear import FORMAT_OF_GGML, quantize, row_bytes
from .quants import AS_FORMAT, FLOATS, UnsupportedQuantType, dequantize, supported_types, type_name
from .gguf_arch import ARCHS, Meta, check_layers, check_sizes, expected_shape, hf_name, is_norm
from .gguf_meta import GGUFError, gguf_tokenizer, read_metadata
from .tokenizer import Tokenizer


def read_gguf(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    *,
    use_cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    keep_quantized: bool = False,
) -> tuple[dict, dict[str, Tensor], Tokenizer]:
    """Read a GGUF: (HF config dict, {HF name: tensor}, Tokenizer).

    dtype: tensors come back fp32 (exact dequantized values) unless given.
    use_cache: read/write the parsed metadata (config, tokenizer, tensor table; gguf_cache.py)
    under `cache_dir` (default $HEADWISE_CACHE or ~/.cache/headwise), so a later load skips the
    parse (~2 s for SmolLM2); False always parses the file. Either way the weights come from the
    file where it lies (a private map), never from a copy on disk.
    keep_quantized: tensors in a format headwise computes from (q4_0, q4_1, q5_0, q5_1, q8_0,
    q4_k, q5_k, q6_k; models/linear.py) come back as QuantTensor blocks, Q3_K / IQ4_NL as Q6_K / Q8_0 blocks
    of exactly their values, the rest fp32 (weights="auto").
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if use_cache:
        config, tensors, tokenizer = _read_cached(path, cache_dir, keep_quantized)
    else:
        config, tensors, tokenizer = convert_gguf(path, keep_quantized=keep_quantized)
    held = config.get("gguf", {}).get("held_as_q8_0")
    if keep_quantized and held:
        warnings.warn(
            f"{path.name}: {sum(held.values())} tensors stored as {', '.join(sorted(held))} have no kernel in "
            "headwise; they are held as Q8_0 blocks requantized from their exact values (8.5 bits a weight, an "
            "error ~1/250 of each 32 values' largest, far under their own rounding) instead of fp32. "
            "weights='fp32' keeps their exact values",
            stacklevel=4,  # headwise.load's caller
        )
    if dtype is not None:
        tensors = {name: t.to(dtype) if isinstance(t, Tensor) else t for name, t in tensors.items()}
    _name_templates(tokenizer, path.name)
    return config, tensors, tokenizer


def _read_cached(path: Path, cache_dir, keep_quantized: bool) -> tuple[dict, dict[str, Tensor], Tokenizer]:
    """The weights from the file in place, the metadata from the cache entry (parsed and stored
    on a miss): the same tensors either way, by the same gguf_tensors over the same bytes."""
    entry = cache_entry(path, cache_dir)
    cached = gguf_cache.read(entry)
    if cached is not None:
        config, table, tokenizer = cached
        try:
            stored = gguf_cache.mapped_tensors(path, table)
        except (ValueError, KeyError, TypeError) as e:  # a table that does not fit the file: reparse
            gguf_cache.unusable(entry, e)
            cached = None
    if cached is None:
        reader = open_gguf(path)
        config, meta = _parse_config(reader, path)
        tokenizer = gguf_tokenizer(reader, meta, path)
        gguf_cache.write(entry, config, gguf_cache.tensor_table(reader, path.stat().st_size), tokenizer)
        stored = reader.tensors
    config["gguf"]["file"] = path.name  # one entry serves every copy of the file, under any name
    tensors = gguf_tensors(
        _Tensors(stored), config, path, config["gguf"]["architecture"], keep_quantized=keep_quantized
    )
    return config, tensors, tokenizer


class _Tensors:
    """What gguf_tensors reads of a reader: its tensors."""

    def __init__(self, tensors: list):
        self.tensors = tensors


def _name_templates(tokenizer: Tokenizer, source: str) -> None:
    """The file's chat templates as TemplateText naming it: a template is untrusted code, and its
    errors should say whose (the name only: a server's 400 should not show its paths)."""
    if tokenizer.chat_template is not None:
        tokenizer.chat_template = TemplateText(tokenizer.chat_template, source)
    if named := tokenizer.config.get("chat_templates"):
        tokenizer.config["chat_templates"] = {k: TemplateText(v, source) for k, v in named.items()}


# ---- parsing ------------------------------------------------------------------------


def _reader_class():
    import gguf

    class FastReader(gguf.GGUFReader):
        """GGUFReader whose field views are plain ndarrays instead of np.memmap slices.

        The reader makes ~250k tiny views while walking the metadata; each memmap
        view runs memmap.__array_finalize__, which is 2/3 of its parse time on
        this vocabulary (2.0 s -> 0.8 s). The bytes are the same mapped pages.
        """

        # self.data as a plain ndarray, made at the first read: GGUFReader.__init__ sets data and
        # parses in one call, so this cannot be made before; the file's bytes never change after.
        _plain: np.ndarray | None = None

        def _get(self, offset, dtype, count=1, override_order=None):
            raw = self._plain
            if raw is None:
                raw = self._plain = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            count = int(count)
            arr = raw[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    return FastReader


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over the file, with corrupt or foreign files reported by name."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    import gguf

    try:
        try:
            # "c": a private (copy-on-write) map, so tensors viewing it are writable
            with np.errstate(over="ignore"):  # its offset sums wrap silently; _check_spans redoes them
                reader = _reader_class()(path, "c")
        except TypeError:  # a future gguf changed `_get`'s signature: the stock reader is slower but fine
            reader = gguf.GGUFReader(path, "c")
    except Exception as e:  # noqa: BLE001 -- numpy/struct/unicode errors all mean the same here
        # A short file fails inside the reader: an index past the end of the map, or a
        # reshape of a tensor whose bytes are missing.
        raise GGUFError(
            f"{path} ({path.stat().st_size} bytes) cannot be read as GGUF "
            f"({type(e).__name__}: {e}); the file is truncated or corrupt"
        ) from None
    _check_spans(reader, path)
    return reader


def _check_spans(reader, path: Path) -> None:
    """Every tensor's bytes inside the file, aligned, and apart from the others, in Python ints: the
    reader adds the stored offset to the data start in uint64, so an offset of 2**64 - 32 wraps to a
    span inside the file (into the metadata), and the product of its dims may wrap alike."""
    import gguf

    size, start, align = path.stat().st_size, int(reader.data_offset), int(reader.alignment)
    spans = []
    for t in reader.tensors:
        offset = int(t.field.parts[-1][0])  # as stored
        dims = [int(d) for d in t.field.parts[3]]
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t.tensor_type))]
        n_bytes = math.prod(dims) * type_bytes // block
        end = start + offset + n_bytes
        if offset % align:
            raise GGUFError(
                f"{path}: tensor {t.name} is stored at offset {offset}, not a multiple of the file's "
                f"alignment {align}; the file is corrupt"
            )
        if end > size:
            raise GGUFError(
                f"{path}: tensor {t.name} ({n_bytes} bytes at offset {offset} of the data, which starts at "
                f"byte {start}) needs bytes up to {end} but the file has {size}; it is truncated or corrupt"
            )
        spans.append((start + offset, end, t.name))
    spans.sort()
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise GGUFError(f"{path}: tensors {name} and {other} share bytes of the file; it is corrupt")


# ---- config and weights, per architecture (gguf_arch.py) ---------------------------


def gguf_config(reader, meta: dict, path: Path) -> dict:
    """The HF config dict that `general.architecture`'s metadata describes (gguf_arch.ARCHS)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in reader.tensors}
    m = Meta(meta, path, set(shapes), shapes)
    check_sizes(m)
    config = ARCHS[arch].config(m)
    config["_name_or_path"] = meta.get("general.name", path.stem)
    return config


def unpermute_qk(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's Q/K row order (convert_hf_to_gguf.py LlamaModel.permute).

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)... (GPT-J style); HF
    rotates halves (x_i, x_{i+D/2}) (GPT-NeoX style). The converter interleaves
    each head's two halves; this puts them back. w: (n_head * D, C) or (n_head * D,).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@contextlib.contextmanager
def _one_thread():
    """Dequantizing is memory-bound elementwise work on mid-sized tensors. On this 2-core box
    under load, torch's intra-op threads made it ~18x slower (9 s vs 0.5 s for SmolLM2)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def gguf_tensors(reader, cfg: dict, path: Path, arch_name: str, *, keep_quantized: bool = False) -> dict[str, Tensor]:
    """{HF name: fp32 tensor}, llama.cpp's conversion undone (gguf_arch.Arch); keep_quantized: tensors
    in a format models/linear.py computes from (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k) come as
    QuantTensor blocks, copied out of the file, and Q3_K / IQ4_NL ones as the Q6_K / Q8_0 blocks of
    exactly their values (quants.AS_FORMAT). GPT-2's transposed weights are always dequantized."""
    arch = ARCHS[arch_name]
    H, Hkv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    out = {}
    with _one_thread():
        for t in reader.tensors:
            hf = hf_name(arch, t.name)
            if hf is None:
                raise GGUFError(
                    f"{path}: tensor {t.name} has no Hugging Face name in the {arch_name} table "
                    "(headwise/models/gguf_arch.py)"
                )
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
            want = expected_shape(hf, cfg)
            if want is not None and shape != want:
                raise GGUFError(f"{path}: tensor {t.name} has shape {shape}, but the config implies {want} for {hf}")
            rows = None  # the Q/K row order to undo: llama.cpp's per-head interleave
            if arch.permute_qk and ".attn_q." in t.name:
                rows = H
            elif arch.permute_qk and ".attn_k." in t.name:
                rows = Hkv
            ggml = int(t.tensor_type)
            kept = ggml in FORMAT_OF_GGML or ggml in AS_FORMAT
            if keep_quantized and kept and len(shape) == 2 and not arch.transposed:
                w = _stored_blocks(t, shape, copy=not hf.endswith(_FUSED))
                if rows is not None:  # a row permutation: it applies to rows of blocks alike
                    w = w._replace(blocks=unpermute_qk(w.blocks, rows).contiguous())
                out[hf] = w
                continue
            try:
                w = dequantize(t.data, t.tensor_type, shape)
            except (UnsupportedQuantType, ValueError) as e:
                raise GGUFError(
                    f"{path}: tensor {t.name} is stored as {type_name(t.tensor_type)}, which "
                    f"headwise cannot dequantize ({e}). Supported: {', '.join(supported_types())} "
                    "and what gguf.quants.dequantize handles"
                ) from None
            if rows is not None:
                w = unpermute_qk(w, rows)
            if arch.norm_shift and is_norm(t.name):
                w = w - arch.norm_shift  # the converter stored 1 + w (Gemma's x * (1 + w))
            if arch.transposed and len(shape) == 2 and t.name.startswith("blk."):
                w = w.t()  # HF's Conv1D keeps (in, out)
            w = w.contiguous()
            if keep_quantized and ggml not in FLOATS and len(shape) == 2 and shape[1] % 32 == 0 and not arch.transposed:
                # a type with no kernel (Q2_K, IQ4_XS, ...): Q8_0 blocks of its exact values, not fp32
                from .quantized_load import QuantTensor

                w = QuantTensor(quantize(w, "q8_0"), "q8_0", shape)
                held = cfg.setdefault("gguf", {}).setdefault("held_as_q8_0", {})  # read_gguf warns of them
                held[type_name(ggml)] = held.get(type_name(ggml), 0) + 1
            out[hf] = w
    if cfg.get("tie_word_embeddings"):
        out.pop("lm_head.weight", None)
    return out


# HF names whose rows loading.convert stacks into one fused matrix (qkv_proj, gate_up)
_FUSED = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value"))


def _stored_blocks(t, shape: tuple[int, int], *, copy: bool):
    """A tensor's blocks as (O, row_bytes) uint8. Parts of a fused projection stay views of the
    mapped file (the fusing copies them once); the rest are copied out now, so that each weight
    is copied once, with no temporaries, and the map can close after loading."""
    from .quantized_load import QuantTensor

    ggml = int(t.tensor_type)
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    if ggml in AS_FORMAT:  # held as a kernel format with exactly its values (Q3_K as Q6_K): converted
        target, block, nbytes, convert = AS_FORMAT[ggml]
        if shape[1] % block or raw.size != shape[0] * shape[1] // block * nbytes:
            raise GGUFError(f"tensor {t.name} ({type_name(ggml)}, shape {shape}): {raw.size} bytes, not whole blocks")
        fmt = FORMAT_OF_GGML[target]
        blocks = convert(torch.from_numpy(raw).view(-1, nbytes)).reshape(shape[0], -1)
        return QuantTensor(blocks, fmt, shape)
    fmt = FORMAT_OF_GGML[ggml]
    if copy:
        raw = raw.copy()
    need = shape[0] * row_bytes(fmt, shape[1])
    if raw.size != need:
        raise GGUFError(f"tensor {t.name} ({fmt}, shape {shape}) needs {need} bytes, the file has {raw.size}")
    return QuantTensor(torch.from_numpy(raw).view(shape[0], -1), fmt, shape)


def convert_gguf(path: str | os.PathLike, *, keep_quantized: bool = False) -> tuple[dict, dict[str, Tensor], Tokenizer]:
    """Convert straight from the file (no cache). keep_quantized: see gguf_tensors."""
    path = Path(path)
    config, tensors, reader, meta = gguf_model(path, keep_quantized=keep_quantized)
    return config, tensors, gguf_tokenizer(reader, meta, path)


def gguf_model(
    path: str | os.PathLike, *, keep_quantized: bool = False
) -> tuple[dict, dict[str, Tensor], object, dict]:
    """(HF config, {HF name: tensor}, reader, metadata): the weights without the tokenizer."""
    path = Path(path)
    reader = open_gguf(path)
    config, meta = _parse_config(reader, path)
    tensors = gguf_tensors(reader, config, path, meta["general.architecture"], keep_quantized=keep_quantized)
    return config, tensors, reader, meta


def _parse_config(reader, path: Path) -> tuple[dict, dict]:
    """(HF config, metadata) of an open file, its layers checked against the tensors present."""
    meta = read_metadata(reader)
    check_layers(meta, [t.name for t in reader.tensors], path)
    config = gguf_config(reader, meta, path)
    config["gguf"] = {
        "file": path.name,
        "architecture": meta["general.architecture"],
        "tensor_types": _type_counts(reader),
    }
    return config, meta


def _type_counts(reader) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[type_name(t.tensor_type)] = counts.get(type_name(t.tensor_type), 0) + 1
    return counts
