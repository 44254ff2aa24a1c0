"""A GGUF file -> (HF-style config, HF-named float tensors, Tokenizer).

    config, tensors, tokenizer = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")

The file is parsed with the `gguf` package, tensors are dequantized by
`headwise.models.quants`, and llama.cpp's conversion is undone (names, Q/K row
order) so the result equals what transformers loads from the same file.
Parsing is slow in pure Python (the reader walks a 49k-token vocabulary and its
merges one string at a time), so `read_gguf` keeps the converted model in a
cache (`gguf_cache.py`) and reads that on later loads.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from . import gguf_cache
from .gguf_cache import cache_entry, default_cache_dir  # noqa: F401 -- part of this module's API
from .linear import FORMAT_OF_GGML, quantize, row_bytes
from .quantized_load import flatten, unflatten
from .quants import AS_FORMAT, FLOATS, UnsupportedQuantType, dequantize, supported_types, type_name
from .gguf_meta import GGUFError, gguf_tokenizer, read_metadata
from .tokenizer import Tokenizer

# The formats a weights="auto" load keeps as blocks, in its cache entry's name: an entry written
# when fewer were kept (their tensors converted to fp32) would hold fp32 where blocks now stay.
# "r8": other quantized types held as Q8_0 requantized from their values (an older entry held fp32).
_KEPT = "".join(f"{ggml:x}" for ggml in sorted({*FORMAT_OF_GGML, *AS_FORMAT})) + "r8"


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
    use_cache: read/write the converted copy under `cache_dir` (default
    $HEADWISE_CACHE or ~/.cache/headwise); False always converts from the file.
    keep_quantized: tensors in a format headwise computes from (q4_0, q4_1, q5_0, q5_1, q8_0,
    q4_k, q5_k, q6_k; models/linear.py) come back as QuantTensor blocks, Q3_K / IQ4_NL as Q6_K / Q8_0 blocks
    of exactly their values, the rest fp32 (weights="auto"),
    cached in an entry of their own (<entry>-stored-<formats kept>: the blocks as uint8 tensors;
    an entry made when headwise kept fewer formats is not reused), since parsing the file's
    metadata takes ~2 s for SmolLM2 and reading the entry ~0.3 s.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if keep_quantized and not use_cache:
        config, tensors, tokenizer = convert_gguf(path, keep_quantized=True)
    elif keep_quantized:
        entry = cache_entry(path, cache_dir)
        entry = entry.with_name(f"{entry.name}-stored-{_KEPT}")
        cached = gguf_cache.read(entry)
        if cached is not None:
            (config, tensors), tokenizer = unflatten(*cached[:2]), cached[2]
        else:
            config, tensors, tokenizer = convert_gguf(path, keep_quantized=True)
            gguf_cache.write(entry, *flatten(config, tensors), tokenizer)
    elif not use_cache:
        config, tensors, tokenizer = convert_gguf(path)
    else:
        entry = cache_entry(path, cache_dir)
        cached = gguf_cache.read(entry)
        if cached is not None:
            config, tensors, tokenizer = cached
        else:
            config, tensors, tokenizer = convert_gguf(path)
            gguf_cache.write(entry, config, tensors, tokenizer)
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
    return config, tensors, tokenizer


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
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"{path}: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes} but the "
                f"file has {size}; it is truncated"
            )
    return reader


# ---- llama: config and weights --------------------------------------------------------

# llama.cpp name -> HF name (gguf-py's tensor_mapping.py, read backwards).
_LLAMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCK = {  # blk.{i}.<key>.weight -> model.layers.{i}.<value>.weight
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _f32(x) -> float:
    """GGUF stores floats as f32: 1e-5 arrives as 9.99999974e-06. Give back the short decimal it came from."""
    return float(str(np.float32(x)))


def llama_config(meta: dict, tensor_names: set[str], tokenizer: Tokenizer, path: Path) -> dict:
    a = meta["general.architecture"]

    def need(key):
        if f"{a}.{key}" not in meta:
            raise GGUFError(f"{path}: metadata {a}.{key} is missing")
        return meta[f"{a}.{key}"]

    C, H = need("embedding_length"), need("attention.head_count")
    Hkv = meta.get(f"{a}.attention.head_count_kv", H)  # absent means MHA
    D = meta.get(f"{a}.attention.key_length", C // H)
    if meta.get(f"{a}.rope.dimension_count", D) != D:
        raise GGUFError(
            f"{path}: rope.dimension_count={meta[f'{a}.rope.dimension_count']} != head_dim={D}; "
            "partial rotary is not a llama layout"
        )
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            f"{path} has rope_freqs.weight (Llama-3.1-style per-frequency RoPE factors), "
            "which headwise does not apply yet"
        )
    rope_scaling = None
    kind = meta.get(f"{a}.rope.scaling.type")
    if kind not in (None, "none"):
        rope_scaling = {"rope_type": kind, "factor": _f32(meta.get(f"{a}.rope.scaling.factor", 1.0))}
        if f"{a}.rope.scaling.original_context_length" in meta:
            rope_scaling["original_max_position_embeddings"] = meta[f"{a}.rope.scaling.original_context_length"]
    tied = "output.weight" not in tensor_names
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": C,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": H,
        "num_key_value_heads": Hkv,
        "head_dim": D,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{a}.rope.freq_base", 10000.0)),  # llama.cpp's default
        "rope_scaling": rope_scaling,
        "max_position_embeddings": need("context_length"),
        "vocab_size": meta.get(f"{a}.vocab_size", tokenizer.vocab_size),
        "tie_word_embeddings": tied,  # llama.cpp drops output.weight when it equals the embedding
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensor_names),
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "_name_or_path": meta.get("general.name", path.stem),
    }


def _hf_name(name: str) -> str | None:
    if name in _LLAMA_GLOBAL:
        return _LLAMA_GLOBAL[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LLAMA_BLOCK:
        return f"model.layers.{parts[1]}.{_LLAMA_BLOCK[parts[2]]}.{parts[3]}"
    return None


def _expected_shape(hf: str, cfg: dict) -> tuple[int, ...]:
    C, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    kind = hf.rsplit(".", 2)[-2] if hf.startswith("model.layers.") else hf
    table = {
        "model.embed_tokens.weight": (V, C),
        "lm_head.weight": (V, C),
        "model.norm.weight": (C,),
        "input_layernorm": (C,),
        "post_attention_layernorm": (C,),
        "q_proj": (q, C),
        "k_proj": (kv, C),
        "v_proj": (kv, C),
        "o_proj": (C, q),
        "gate_proj": (I, C),
        "up_proj": (I, C),
        "down_proj": (C, I),
    }
    shape = table[kind]
    return shape[:1] if hf.endswith(".bias") else shape


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


def llama_tensors(reader, cfg: dict, path: Path, *, keep_quantized: bool = False) -> dict[str, Tensor]:
    """{HF name: fp32 tensor}; keep_quantized: tensors in a format models/linear.py computes
    from (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k) come as QuantTensor blocks, copied out of the file,
    and Q3_K / IQ4_NL ones as the Q6_K / Q8_0 blocks of exactly their values (quants.AS_FORMAT)."""
    out = {}
    with _one_thread():
        for t in reader.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                raise GGUFError(
                    f"{path}: tensor {t.name} has no Hugging Face name in the llama table "
                    "(headwise/models/gguf.py _LLAMA_BLOCK)"
                )
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
            want = _expected_shape(hf, cfg)
            if shape != want:
                raise GGUFError(f"{path}: tensor {t.name} has shape {shape}, but the config implies {want} for {hf}")
            ggml = int(t.tensor_type)
            kept = ggml in FORMAT_OF_GGML or ggml in AS_FORMAT
            if keep_quantized and kept and len(shape) == 2:
                w = _stored_blocks(t, shape)
                if ".attn_q." in t.name:  # a row permutation: it applies to rows of blocks alike
                    w = w._replace(blocks=unpermute_qk(w.blocks, cfg["num_attention_heads"]).contiguous())
                elif ".attn_k." in t.name:
                    w = w._replace(blocks=unpermute_qk(w.blocks, cfg["num_key_value_heads"]).contiguous())
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
            if ".attn_q." in t.name:
                w = unpermute_qk(w, cfg["num_attention_heads"])
            elif ".attn_k." in t.name:
                w = unpermute_qk(w, cfg["num_key_value_heads"])
            w = w.contiguous()
            if keep_quantized and ggml not in FLOATS and len(shape) == 2 and shape[1] % 32 == 0:
                # a type with no kernel (Q2_K, IQ4_XS, ...): Q8_0 blocks of its exact values, not fp32
                from .quantized_load import QuantTensor

                w = QuantTensor(quantize(w, "q8_0"), "q8_0", shape)
                held = cfg.setdefault("gguf", {}).setdefault("held_as_q8_0", {})  # read_gguf warns of them
                held[type_name(ggml)] = held.get(type_name(ggml), 0) + 1
            out[hf] = w
    if cfg["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out


_FUSED = (".attn_q.", ".attn_k.", ".attn_v.", ".ffn_gate.", ".ffn_up.")  # rows stacked by loading.convert


def _stored_blocks(t, shape: tuple[int, int]):
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
    if not any(part in t.name for part in _FUSED):
        raw = raw.copy()
    need = shape[0] * row_bytes(fmt, shape[1])
    if raw.size != need:
        raise GGUFError(f"tensor {t.name} ({fmt}, shape {shape}) needs {need} bytes, the file has {raw.size}")
    return QuantTensor(torch.from_numpy(raw).view(shape[0], -1), fmt, shape)


_ARCHS = ("llama",)


def convert_gguf(path: str | os.PathLike, *, keep_quantized: bool = False) -> tuple[dict, dict[str, Tensor], Tokenizer]:
    """Convert straight from the file (no cache). keep_quantized: see llama_tensors."""
    path = Path(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(_ARCHS)}")
    tokenizer = gguf_tokenizer(reader, meta, path)
    names = {t.name for t in reader.tensors}
    config = llama_config(meta, names, tokenizer, path)
    config["gguf"] = {"file": path.name, "tensor_types": _type_counts(reader)}
    return config, llama_tensors(reader, config, path, keep_quantized=keep_quantized), tokenizer


def _type_counts(reader) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[type_name(t.tensor_type)] = counts.get(type_name(t.tensor_type), 0) + 1
    return counts
