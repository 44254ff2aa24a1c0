"""The ModelConfig a .gguf file or a checkpoint folder describes, from its metadata alone (what
`headwise plan FILE.gguf` / `plan DIR` prices): no tensor's data is read.

    describe("SmolLM2-135M-Instruct.Q4_1.gguf")   # Described(config=ModelConfig(...), weights="q4_1")
    describe("path/to/hf-checkpoint")              # config.json (+ the weight files' tensor names)

A GGUF goes the way loading goes -- its metadata and tensor shapes -> an HF config dict (gguf_arch) ->
the family's config_from_hf -- so the plan and the load agree on every size. A folder's config.json
goes to the same config_from_hf; the tensor names (the safetensors headers, or the shard index)
tell what the config leaves out, such as BERT's pooler.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.config import ModelConfig

# llama.cpp's general.file_type (gguf.LlamaFileType) -> the `weights=` headwise.plan prices it as:
# a dtype, one GGML block format, or one of llama-quantize's mixes (core/formats.py). Others (Q2_K,
# the IQ types, ...) have no price of their own: the plan says so and prices --dtype.
FILE_TYPES = {
    0: "fp32",
    1: "fp16",
    2: "q4_0",
    3: "q4_1",
    7: "q8_0",
    8: "q5_0",
    9: "q5_1",
    14: "q4_k_s",
    15: "q4_k_m",
    16: "q5_k_s",
    17: "q5_k_m",
    18: "q6_k",
    32: "bf16",
}


@dataclass(frozen=True)
class Described:
    config: ModelConfig  # named after the file or folder
    weights: str | None = None  # the format the file stores its matrices in (FILE_TYPES), if it says
    note: str | None = None  # what the plan cannot price as stored


def describe(path: str | os.PathLike) -> Described:
    """A .gguf file or a checkpoint folder -> its ModelConfig (and a GGUF's stored format). Raises
    ValueError (GGUFError, CheckpointError, FileNotFoundError's text) naming the file and the fix."""
    path = Path(path).expanduser()
    if path.is_dir():
        return Described(_folder_config(path))
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf; plan a .gguf file, a checkpoint folder or a preset")
    return _gguf(path)


def _gguf(path: Path) -> Described:
    from .gguf import gguf_config, open_gguf
    from .gguf_arch import ARCHS, check_layers, hf_name
    from .gguf_meta import read_metadata
    from .loading import family_of

    reader = open_gguf(path)  # a map of the file: the header and the tensor table are what is read
    meta = read_metadata(reader)
    check_layers(meta, [t.name for t in reader.tensors], path)
    hf = gguf_config(reader, meta, path)
    arch = ARCHS[meta["general.architecture"]]
    names = {n for t in reader.tensors if (n := hf_name(arch, t.name)) is not None}
    config = family_of(hf).config_from_hf(hf, names)
    ftype = meta.get("general.file_type")
    weights = FILE_TYPES.get(ftype)
    note = None
    if ftype is not None and weights is None:
        import gguf

        label = gguf.LlamaFileType(ftype).name if ftype in gguf.LlamaFileType._value2member_map_ else str(ftype)
        note = f"the file's type {label} has no price here; weights priced as --dtype (or give --weights)"
    return Described(replace(config, name=path.name), weights, note)


def _folder_config(d: Path) -> ModelConfig:
    from .loading import CheckpointError, family_of

    file = d / "config.json"
    if not file.is_file():
        found = ", ".join(sorted(p.name for p in d.iterdir())[:10]) or "nothing"
        raise ValueError(f"{d} has no config.json (found: {found}); a checkpoint folder holds the HF config.json")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} holds {type(hf).__name__}, not a JSON object")
    family = family_of(hf)
    names = _tensor_names(d)
    rename = getattr(family, "hf_name", None)  # BERT: "bert." prefixes off, as loading does
    if rename is not None:
        names = {rename(n) for n in names}
    return replace(family.config_from_hf(hf, names), name=d.resolve().name)


def _tensor_names(d: Path) -> set[str]:
    """The checkpoint's tensor names without reading a tensor: the shard index's weight_map, else
    model.safetensors' header (8 bytes of length, then JSON). A .bin alone: none (pickles must load)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (d / index).is_file():
            try:
                return set(json.loads((d / index).read_text(encoding="utf-8"))["weight_map"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                return set()
    file = d / "model.safetensors"
    if not file.is_file():
        return set()
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return set()
        (size,) = struct.unpack("<Q", head)
        if size > min(100 * 2**20, file.stat().st_size):  # safetensors caps its header at 100 MB
            return set()
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError):
            return set()
    return {k for k in header if k != "__metadata__"} if isinstance(header, dict) else set()
