"""`headwise.load(..., weights=...)`: which weights stay or become GGML blocks, and the saved form.

    weights="auto"   a GGUF's tensors as stored where a quantized kernel format exists
                     (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k), Q3_K / IQ4_NL as the Q6_K / Q8_0
                     blocks of exactly their values, other quantized types (Q2_K, IQ4_XS, ...) as Q8_0
                     requantized from their values (models/gguf.py); float tensors and safetensors stay float
    weights="fp32"   everything dequantized to fp32 (the loader as it was before issue 14)
    weights="bf16"   everything dequantized, then cast to bf16
    weights="q8_0" | "q4_0" | "q4_1" | "q5_0" | "q5_1" | "q4_k" | "q5_k" | "q6_k" (aliases "int8" =
                     q8_0, "int4" = q4_1): linear weights and the token embedding requantized to
                     that format; a K-quant's rows that are not whole 256-value super-blocks take
                     llama-quantize's fallback instead (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0):
                     every weight in one format, as `llama-quantize --pure` makes them
    weights="q4_k_m" | "q4_k_s" | "q5_k_m" | "q5_k_s"   llama-quantize's mixes of those names
                     (formats.mix_format): the head or tied embedding in Q6_K / Q8_0, V and down
                     projections in more bits in some layers, the base K-quant elsewhere; a
                     q|k|v whose parts get formats that cannot share one matrix is held as
                     three linears (MultiHeadAttention.unfuse), as a llama.cpp file of the mix is

Norms, biases and position embeddings always stay float. In transit (reader -> loading.convert
-> model) a quantized weight is a `QuantTensor`; `install` then swaps the meta-built model's
nn.Linear / nn.Embedding for QuantizedLinear / QuantizedEmbedding holding the blocks.

Saved form (`save(model, dir)`): model.safetensors (the state dict: blocks as uint8 tensors,
a tied output head's blocks once), headwise_model.json (the ModelConfig and each quantized
module's format) and the tokenizer files; `headwise.load(dir)` reads it back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..core.formats import MIXES, big_gqa, mix_format, target_format
from ..core.formats import fused_format as formats_fused_format
from .linear import FORMATS, QUANTIZED, QuantizedEmbedding, QuantizedLinear, dequantize, kernel_unavailable, quantize

ALIASES = {"int8": "q8_0", "int4": "q4_1"}
TARGETS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")  # weights= formats (kernels.quant)
WEIGHTS = ("auto", "fp32", "bf16", *TARGETS, *MIXES, *ALIASES)
SAVED_FILE = "headwise_model.json"
SAVED_FORMAT = "headwise-model-1"


def check_weights(weights: str) -> str:
    """The canonical weights= value (aliases resolved), or a ValueError listing the valid ones."""
    key = str(weights).lower()
    if key not in WEIGHTS:
        raise ValueError(
            f"weights={weights!r} is not one of {', '.join(WEIGHTS)} "
            "(auto: a GGUF as stored; fp32/bf16: dequantized; a format: requantized to it; "
            "q4_k_m / q4_k_s / q5_k_m / q5_k_s: llama-quantize's mixes)"
        )
    return ALIASES.get(key, key)


class QuantTensor(NamedTuple):
    """A weight as GGML blocks, between the reader and the module that will hold it.

    Duck-types the few Tensor methods loading.convert calls (shape, is_floating_point,
    contiguous), so the family tables apply unchanged."""

    blocks: Tensor  # (O, row_bytes) uint8
    fmt: str
    shape: tuple[int, int]  # (O, I): the logical weight's

    def is_floating_point(self) -> bool:
        return False

    def contiguous(self) -> "QuantTensor":
        return self

    def t(self):
        raise ValueError(f"a {self.fmt} weight cannot be transposed; load this checkpoint with weights='fp32'")

    def dequantize(self) -> Tensor:
        return dequantize(self.blocks, self.fmt, *self.shape)


def fused_format(parts: list) -> str | None:
    """The format q | k | v or gate | up fuse into as blocks: their one format, or Q8_0 when they
    differ but each part is Q8_0 or holds exactly what a Q8_0 block can (Q4_0, Q5_0: llama.cpp's
    Q4_K_M keeps some V projections in Q8_0 beside Q5_0 Q and K where the width is not a multiple
    of 256); None when some part is float or the formats cannot meet (then fp32)."""
    if not all(isinstance(p, QuantTensor) for p in parts):
        return None
    return formats_fused_format(p.fmt for p in parts)


def fuse_rows(parts: list) -> Tensor | QuantTensor:
    """Stack row blocks (q | k | v, gate | up): blocks in fused_format(parts) where there is one,
    else fp32 (the caller warns: the projection then has no quantized copy)."""
    if not any(isinstance(p, QuantTensor) for p in parts):
        return torch.cat(parts, dim=0)
    fmt = fused_format(parts)
    if fmt is None:
        return torch.cat([p.dequantize() if isinstance(p, QuantTensor) else p.float() for p in parts], dim=0)
    if fmt == "q8_0":
        parts = [as_q8_0(p) for p in parts]
    O = sum(p.shape[0] for p in parts)
    return QuantTensor(torch.cat([p.blocks for p in parts], dim=0), fmt, (O, parts[0].shape[1]))


def mixed(parts: list) -> str | None:
    """When fuse_rows(parts) falls back to fp32 although some parts are blocks: the parts'
    formats in row order ("q4_k|q4_k|q6_k"), else None."""
    if not any(isinstance(p, QuantTensor) for p in parts) or fused_format(parts) is not None:
        return None
    return "|".join(p.fmt if isinstance(p, QuantTensor) else str(p.dtype).removeprefix("torch.") for p in parts)


# Formats whose blocks are Q8_0 blocks in other clothes: w = d (q - offset), one f16 d per 32
# values, q - offset within int8. name -> (bytes of fifth bits after d, offset); q8_0 as is.
_AS_Q8_0 = {"q4_0": (0, 8), "q5_0": (4, 16), "q8_0": None}


def as_q8_0(p: QuantTensor) -> QuantTensor:
    """A Q4_0 / Q5_0 weight as Q8_0 blocks of exactly its values (the same d, q - offset)."""
    if p.fmt == "q8_0":
        return p
    high, offset = _AS_Q8_0[p.fmt]
    O, I = p.shape
    b = p.blocks.view(O, I // 32, FORMATS[p.fmt][2])
    qs = b[..., 2 + high :]  # 16 bytes: values j (low nibbles) and 16 + j (high)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int16)
    if high:  # value j's fifth bit: bit j of the little-endian u32 after d
        bits = b[..., 2:6].to(torch.int64)
        word = bits[..., 0] | bits[..., 1] << 8 | bits[..., 2] << 16 | bits[..., 3] << 24
        q |= (((word[..., None] >> torch.arange(32)) & 1) << 4).to(torch.int16)
    q8 = (q - offset).to(torch.int8).view(torch.uint8)
    return QuantTensor(torch.cat([b[..., :2], q8], dim=-1).reshape(O, -1).contiguous(), "q8_0", p.shape)


def warn_mixed(names: list[str], what: str) -> None:
    if names:
        warnings.warn(
            f"{what}: {len(names)} fused projections mix storage formats and are kept as fp32 "
            f"(no quantized kernel for them): {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}",
            stacklevel=4,
        )


def _quantizable(model: nn.Module, vocab_size: int) -> dict[str, nn.Module]:
    """state name -> module for the weights weights=<format> requantizes: every nn.Linear and the
    token embedding (vocab rows), not position / segment tables. A tied output head follows its
    embedding; where the family cannot tie a quantized head (tie_weights assigns a Parameter),
    the embedding stays float."""
    ties = bool(getattr(model.config, "tie_embeddings", False)) and getattr(model.config, "lm_head", False)
    can_tie = ties and hasattr(type(model), "ties_quantized")
    out = {}
    for name, m in model.named_modules():
        if type(m) is nn.Linear or (
            isinstance(m, nn.Embedding) and m.num_embeddings == vocab_size and (can_tie or not ties)
        ):
            out[f"{name}.weight"] = m
    return out


def requantize(state: dict, model: nn.Module, weights: str) -> None:
    """Apply weights= to a converted state dict in place, before `install`: dequantize
    (fp32/bf16) or requantize (a format) its weights; "auto" leaves it as it is."""
    if weights == "auto":
        return
    if weights in ("fp32", "bf16"):
        dtype = torch.float32 if weights == "fp32" else torch.bfloat16
        for name, t in state.items():
            if isinstance(t, QuantTensor):
                state[name] = t.dequantize().to(dtype)
        return
    fp32_fused: list[str] = []
    for name, m in _quantizable(model, model.config.vocab_size).items():
        t = state.get(name)
        if t is None:
            continue
        if weights in MIXES:
            rows = _mix_formats(model, name, m, weights, t.shape[1])
        else:
            rows = [(t.shape[0], target_format(weights, t.shape[1]))]
        if len({fmt for _, fmt in rows}) == 1:
            state[name] = _to_format(t, rows[0][1])
            continue
        # parts of one fused matrix in different formats: each part quantized on its own, then
        # held as convert holds a file's parts (Q8_0 blocks of exactly their values, or q, k, v apart)
        whole = t.dequantize() if isinstance(t, QuantTensor) else t
        parts = [_to_format(p, fmt) for p, (_, fmt) in zip(whole.split([n for n, _ in rows]), rows)]
        kinds = mixed(parts)
        if kinds and name.endswith(QKV_WEIGHT):
            del state[name]
            state |= {name.removesuffix("qkv_proj.weight") + f"{p}_proj.weight": t for p, t in zip("qkv", parts)}
            continue
        if kinds:
            fp32_fused.append(f"{name} [{kinds}]")
        state[name] = fuse_rows(parts)
    warn_mixed(fp32_fused, f"weights={weights!r}")


QKV_WEIGHT = "attn.qkv_proj.weight"  # q | k | v fused by loading.convert from a checkpoint's three


def _to_format(t, fmt: str | None):
    """`t` (a float tensor or a QuantTensor) as blocks of `fmt`; unchanged where it already is one,
    float where fmt is None (rows that are not whole blocks of any: llama.cpp keeps those float)."""
    if isinstance(t, QuantTensor):
        if t.fmt == fmt:
            return t
        t = t.dequantize()
    if fmt is None:
        return t
    return QuantTensor(quantize(t.contiguous(), fmt), fmt, tuple(t.shape))


_ROLES = {  # headwise state name suffix -> llama.cpp tensor category (formats.ROLES)
    "attn.q_proj.weight": "attn_q",
    "attn.k_proj.weight": "attn_k",
    "attn.v_proj.weight": "attn_v",
    "attn.out_proj.weight": "attn_output",
    "mlp.gate_up.weight": "ffn_up",  # gate and up: the same format in every mix
    "mlp.up.weight": "ffn_up",
    "mlp.down.weight": "ffn_down",
    "lm_head.weight": "output",
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _mix_formats(model: nn.Module, name: str, module: nn.Module, mix: str, in_features: int) -> list:
    """[(rows, format)] for one weight under llama-quantize's `mix`: one entry, or three for q|k|v
    fused here from a checkpoint's separate q, k and v (llama.cpp sees three tensors)."""
    cfg = model.config
    match = _LAYER.search(name)
    layer = int(match.group(1)) if match else 0
    big = big_gqa(cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    fmt = functools.partial(
        mix_format, mix, layer=layer, num_layers=cfg.num_layers, in_features=in_features, big_gqa=big
    )
    if isinstance(module, nn.Embedding):  # the token table: the head's rule where it is the head too
        head_apart = getattr(cfg, "lm_head", False) and not getattr(cfg, "tie_embeddings", False)
        return [(module.num_embeddings, fmt(role="token_embd" if head_apart else "output"))]
    if name.endswith(QKV_WEIGHT):
        if cfg.arch == "gpt2":  # a checkpoint's own fused q|k|v (c_attn): llama.cpp's attn_qkv
            return [(module.out_features, fmt(role="attn_qkv"))]
        attn = model.get_submodule(name.removesuffix(".qkv_proj.weight"))
        q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        return [(n, fmt(role=r)) for n, r in ((q_rows, "attn_q"), (kv_rows, "attn_k"), (kv_rows, "attn_v"))]
    role = next((r for suffix, r in _ROLES.items() if name.endswith(suffix)), None)
    base = MIXES[mix]
    return [(module.out_features, fmt(role=role) if role else target_format(base, in_features))]


def install(model: nn.Module, state: dict) -> None:
    """Swap the meta-built modules whose weight arrives quantized for Quantized* modules,
    renaming `<module>.weight` to `<module>.blocks` in `state`."""
    for name in [n for n, t in state.items() if isinstance(t, QuantTensor)]:
        module_name = name.removesuffix(".weight")
        qt = state.pop(name)
        old = model.get_submodule(module_name)
        device = old.weight.device
        if isinstance(old, nn.Linear):
            new = QuantizedLinear(old.in_features, old.out_features, qt.fmt, bias=old.bias is not None, device=device)
        elif isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, qt.fmt, device=device)
        else:
            raise AssertionError(f"{name} is quantized but {module_name} is a {type(old).__name__}")
        parent, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
        state[f"{module_name}.blocks"] = qt.blocks
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    _say_without_kernel(model)


def _say_without_kernel(model: nn.Module) -> None:
    """One warning when quantized layers will run on the PyTorch fallback (dequantize per call)."""
    why = {m.fmt: kernel_unavailable(m.fmt) for m in model.modules() if isinstance(m, QUANTIZED)}
    why = {fmt: reason for fmt, reason in why.items() if reason is not None}
    if why:
        warnings.warn(
            f"the quantized layers ({', '.join(sorted(why))}) have no kernel here ({next(iter(why.values()))}); "
            "they dequantize their weight on every call, which is slow for decoding. "
            "Reinstall headwise on x86-64 with AVX2, or load with weights='fp32'",
            stacklevel=4,
        )


def formats(model: nn.Module) -> dict[str, str]:
    """module name -> format of every quantized module (a tied head included)."""
    return {n: m.fmt for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, QUANTIZED)}


# ---------------------------------------------------------------------------- cached and saved forms

_FUSED_HF = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")  # rows loading.convert stacks


def flatten(config: dict, tensors: dict) -> tuple[dict, dict[str, Tensor]]:
    """For the GGUF cache's stored entry (gguf.read_gguf): QuantTensors -> their blocks, with
    {name: [fmt, O, I]} under config["stored_blocks"]."""
    stored = {n: [t.fmt, *t.shape] for n, t in tensors.items() if not isinstance(t, Tensor)}
    flat = {n: t if isinstance(t, Tensor) else t.blocks for n, t in tensors.items()}
    return {**config, "stored_blocks": stored}, flat


def unflatten(config: dict, flat: dict[str, Tensor]) -> tuple[dict, dict]:
    """flatten undone: the blocks back as QuantTensors."""
    config = dict(config)
    stored = config.pop("stored_blocks")
    for name, t in flat.items():
        # as gguf._stored_blocks: parts of fused projections stay views of the mapped entry (the fusing
        # copies them), the rest are copied now, so the map closes once loading is done
        t = t if any(part in name for part in _FUSED_HF) else t.clone()
        flat[name] = QuantTensor(t, stored[name][0], tuple(stored[name][1:])) if name in stored else t
    return config, flat


def save(model: nn.Module, path) -> Path:
    """Write a headwise model (quantized or not) to a directory `headwise.load` reads back."""
    from safetensors.torch import save_file

    from ..core.config import ModelConfig

    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"save needs a headwise model with a ModelConfig in .config, got {type(model).__name__}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    modules = dict(model.named_modules())
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # a tied head: tie_weights restores it
            continue
        seen.add(t.data_ptr())
        owner = modules.get(name.removesuffix(".blocks"))
        if name.endswith(".blocks") and isinstance(owner, QUANTIZED):
            t = owner.file_blocks()  # the file's layout, whatever the kernel reads
        state[name] = t.detach().contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": SAVED_FORMAT})
    meta = {
        "format": SAVED_FORMAT,
        "config": dataclasses.asdict(cfg),
        "quantized": formats(model),
        "max_seq_length": getattr(model, "max_seq_length", None),
    }
    (path / SAVED_FILE).write_text(json.dumps(meta, indent=1))
    if getattr(model, "tokenizer", None) is not None:
        model.tokenizer.save(path)
    return path


def read_saved(path: Path) -> tuple:
    """A directory written by `save` -> (ModelConfig, state with QuantTensors, meta dict)."""
    from safetensors.torch import load_file

    from ..core.config import ModelConfig, RopeScaling

    meta = json.loads((path / SAVED_FILE).read_text())
    if meta.get("format") != SAVED_FORMAT:
        raise ValueError(f"{path / SAVED_FILE}: format {meta.get('format')!r}, expected {SAVED_FORMAT!r}")
    c = dict(meta["config"])
    if c.get("rope_scaling"):
        c["rope_scaling"] = RopeScaling(**c["rope_scaling"])
    c["eos_token_ids"] = tuple(c.get("eos_token_ids") or ())
    cfg = ModelConfig(**c)
    state = load_file(str(path / "model.safetensors"))
    for module_name, fmt in meta["quantized"].items():
        blocks = state.pop(f"{module_name}.blocks", None)
        if blocks is None:
            continue  # a tied head: its embedding carries the blocks
        I = _in_features(fmt, blocks.shape[1])
        state[f"{module_name}.weight"] = QuantTensor(blocks, fmt, (blocks.shape[0], I))
    return cfg, state, meta


def _in_features(fmt: str, nbytes: int) -> int:
    _, block, block_bytes = FORMATS[fmt]
    return nbytes // block_bytes * block
