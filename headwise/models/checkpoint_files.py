"""Checkpoint directory -> (HF config, HF-named tensors): config.json next to model.safetensors,
sharded safetensors or .bin (with their index), or pytorch_model.bin; and the directory's tokenizer.

`from_path.load` calls these and hands the dict to `from_hf`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from .loading import CheckpointError

_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")  # what Tokenizer.from_dir reads


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, Tensor], str]:
    """A checkpoint directory -> (hf_config, HF-named tensors, description of the weight files)."""
    d = Path(path)
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        found = ", ".join(sorted(p.name for p in d.iterdir())) or "nothing"
        raise FileNotFoundError(
            f"no config.json in {d} (found: {found}); a checkpoint directory needs the "
            f"HF config.json next to its weights"
        )
    try:
        hf_config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None

    if (d / "model.safetensors").is_file():
        return hf_config, _read_safetensors(d / "model.safetensors"), str(d / "model.safetensors")
    for index_name, reader in (
        ("model.safetensors.index.json", _read_safetensors),
        ("pytorch_model.bin.index.json", _read_bin),
    ):
        index = d / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index} is not a shard index with a weight_map: {e}") from None
            tensors = {}
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    names = [n for n, s in weight_map.items() if s == shard]
                    raise FileNotFoundError(
                        f"{index} lists shard {shard} (for {len(names)} tensors, e.g. "
                        f"{names[0]}) but {d / shard} does not exist"
                    )
                part = reader(d / shard)
                absent = [n for n, s in weight_map.items() if s == shard and n not in part]
                if absent:
                    raise CheckpointError(f"{index} places {absent[:5]} in {shard}, which lacks them")
                tensors.update(part)
            return hf_config, tensors, f"{index} ({len(set(weight_map.values()))} shards)"
    if (d / "pytorch_model.bin").is_file():
        return hf_config, _read_bin(d / "pytorch_model.bin"), str(d / "pytorch_model.bin")
    found = ", ".join(sorted(p.name for p in d.iterdir()))
    raise FileNotFoundError(
        f"no weights in {d} (found: {found}); expected model.safetensors, "
        f"model.safetensors.index.json + shards, or pytorch_model.bin"
    )


def _read_safetensors(file: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None


def _read_bin(file: Path) -> dict[str, Tensor]:
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True)  # no pickle code execution
    except Exception as e:  # torch raises several types for corrupt or unsafe pickles
        raise CheckpointError(f"{file} is not a readable PyTorch state dict (weights_only=True): {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise CheckpointError(f"{file} does not hold a flat name -> tensor state dict")
    return sd


def tokenizer_for(d: Path):
    """The directory's Tokenizer, or None when it has no tokenizer files."""
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        from .tokenizer import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_dir(d)
