"""`headwise.load`: a checkpoint directory, a .gguf file or a builtin model name -> a model.

It finds the files (sources.py, checkpoint_files.py, gguf.py), then hands the HF-named dict to
loading.py's build, the path every checkpoint ends in.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from .loading import _build, _finish, _weights_dtype, family_of
from .quantized_load import SAVED_FILE
from .sources import find


def _return_freed_memory() -> None:
    """Hand the heap pages the loading's temporaries freed back to the OS (glibc's malloc_trim):
    glibc keeps freed blocks below its mmap threshold, which grows to the size of the largest
    freed block, so after a load the process would otherwise keep ~60 MB (SmolLM2) it no longer
    uses. Elsewhere, nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load(
    path_or_name: str | os.PathLike, *, weights: str = "auto", dtype=None, backend: str = "auto", pack: bool = True
) -> nn.Module:
    """A checkpoint directory, a .gguf file, or a builtin model name -> model (eval mode).

    The model carries `.config` (ModelConfig) and `.tokenizer` (None when the checkpoint
    has none). weights: "auto" keeps a GGUF's quantized tensors as stored (QuantizedLinear,
    models/linear.py), "fp32" / "bf16" dequantize, "q8_0" / "q4_0" / "q4_1" / ... / "q6_k" (or
    "int8" / "int4") requantize the linears and token embedding, "q4_k_m" / "q4_k_s" / "q5_k_m" /
    "q5_k_s" to llama-quantize's mixes (quantized_load.py). dtype: None
    keeps the checkpoint's float dtype; backend: the attention backend. pack: gradient-free
    CPU forwards of float linears use oneDNN-prepacked weights (see packing.py; ~1.5x faster
    decoding, one more copy of each weight once used), and quantized blocks are re-laid in
    the kernel's 8-row groups (the same bytes: no copy); False for plain nn.Linear and the
    blocks in the file's row order.
    """
    model = _load(path_or_name, weights=weights, dtype=dtype, backend=backend, pack=pack)
    _return_freed_memory()  # the reader's and the conversion's temporaries are gone by now
    return model


def _load(path_or_name, *, weights: str, dtype, backend: str, pack: bool) -> nn.Module:
    dtype, weights = _weights_dtype(weights, dtype)
    source = find(path_or_name)  # FileNotFoundError / ValueError naming the fix; BuiltinNotInstalled
    path, name = source.path, source.name
    # config.name (what errors and reports say) is the name as typed, not the GGUF's general.name
    # ("SmolLM2 135M Instruct") or the config.json's _name_or_path
    if source.is_gguf:
        from .gguf import read_gguf

        hf_config, tensors, tokenizer = read_gguf(path, keep_quantized=weights == "auto")
        model = _build(
            {**hf_config, "_name_or_path": name},
            tensors,
            dtype=dtype,
            backend=backend,
            source=name if name == str(path) else f"{name} ({path})",
            pack=pack,
            weights=weights,
        )
        model.tokenizer = tokenizer
        return model
    from .checkpoint_files import read_checkpoint, tokenizer_for

    if (path / SAVED_FILE).is_file():
        return _load_saved(path, weights=weights, dtype=dtype, backend=backend, pack=pack)
    hf_config, tensors, source = read_checkpoint(path)
    model = _build(
        {**hf_config, "_name_or_path": name},
        tensors,
        dtype=dtype,
        backend=backend,
        source=source,
        pack=pack,
        weights=weights,
    )
    model.tokenizer = tokenizer_for(path)
    st_config = path / "sentence_bert_config.json"  # sentence-transformers truncates to this length
    if st_config.is_file():
        model.max_seq_length = json.loads(st_config.read_text()).get("max_seq_length")
    return model


def _load_saved(path: Path, *, weights: str, dtype, backend: str, pack: bool) -> nn.Module:
    """A directory written by quantized_load.save -> the same model."""
    from .quantized_load import read_saved

    cfg, state, meta = read_saved(path)
    if dtype is not None:
        state = {n: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for n, t in state.items()}
    family = family_of({"model_type": cfg.arch})
    with torch.device("meta"):
        model = family.Model(cfg, backend=backend)
    model = _finish(model, state, weights=weights, pack=pack, what=f"{path / SAVED_FILE}")
    from .checkpoint_files import tokenizer_for

    model.tokenizer = tokenizer_for(path)
    if meta.get("max_seq_length"):
        model.max_seq_length = meta["max_seq_length"]
    return model
