"""Checkpoints -> models. The HF-named state dict is the interchange format.

    headwise.load("path/to/dir")        config.json + model.safetensors (or sharded with
                                         model.safetensors.index.json, or pytorch_model.bin)
    headwise.load("model.gguf")         via headwise.models.gguf.read_gguf
    headwise.load("smollm2")            a builtin name, via headwise.models.builtin.resolve
    headwise.load(p, weights="int8")    quantized weights: quantized_load.py (a GGUF keeps its own by
                                         default); a directory written by quantized_load.save loads too
    from_hf(hf_config, tensors)         the dict-level entry every path above ends in

`headwise.load` (finding the files) is from_path.py; this file is the build they all reach.

Each family file holds one visible table, HF name -> `To(headwise name, HF shape)`.
`from_hf` checks the checkpoint against it (missing, mis-shaped and unused tensors are
all listed in one error), transposes and fuses, builds the model on the meta device
and loads with `assign=True`, so the weights exist once, never twice.
Reading a checkpoint directory's files (safetensors, shards, .bin, its tokenizer) is
checkpoint_files.py.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections import Counter
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .linear import pack_quantized
from .packing import pack_linears
from .quantized_load import QKV_WEIGHT, check_weights, fuse_rows, install, mixed, requantize, warn_mixed

# model_type -> family module (under headwise.models); architectures[0] is the fallback key.
# A decoder family is one module of families/ (its config_from_hf and weight table; the model is
# families/decoder.py's, built from the ModelConfig), so adding one is a file and a line here.
FAMILIES = {
    "llama": "families.llama",
    "mistral": "families.mistral",
    "qwen2": "families.qwen2",
    "qwen3": "families.qwen3",
    "phi3": "families.phi3",
    "gemma2": "families.gemma2",
    "gemma3_text": "families.gemma3",
    "gemma3": "families.gemma3",  # Gemma3ForConditionalGeneration: its text_config, text-only weights
    "gpt2": "gpt2",
    "bert": "bert",
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "BertForPreTraining": "bert",
}

_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "relu": "relu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}


class To(NamedTuple):
    """Where one HF tensor goes.

    name: headwise state-dict name; `name[k]` is the k-th row block of a tensor fused
        along dim 0 from several HF tensors (e.g. q, k, v -> qkv_proj rows [Q | K | V]).
    shape: the HF tensor's shape, asserted before anything is converted.
    transpose: HF stores it (in, out) (GPT-2's Conv1D); nn.Linear wants (out, in).
    add: added to every element, in fp32 before any cast. Gemma's RMSNorm scales by (1 + w) and HF
        stores w; add=1.0 makes headwise's RMSNorm weight 1 + w, so one norm (x / rms * weight)
        serves every family. The HF convention (w) is the interchange: a GGUF reader hands w over.
    """

    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    add: float = 0.0


class CheckpointError(ValueError):
    """A checkpoint that does not match what its config says (names every tensor at fault)."""


# ---------------------------------------------------------------------------- small helpers for families


def need(hf: dict, key: str):
    if hf.get(key) is None:
        raise CheckpointError(
            f"config has no {key!r} (model_type={hf.get('model_type')!r}); it is required to build the model"
        )
    return hf[key]


def hf_activation(name: str) -> str:
    if name not in _HF_ACTIVATIONS:
        raise CheckpointError(f"activation {name!r} is not supported; supported: {', '.join(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[name]


def hf_eos(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def family_of(hf_config: dict):
    """The family module for an HF config, by model_type, else by architectures."""
    kind = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if kind not in FAMILIES:
        kind = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if kind is None:
        raise CheckpointError(
            f"unknown architecture: model_type={hf_config.get('model_type')!r}, architectures={archs}; "
            f"supported model_type: {', '.join(FAMILIES)}"
        )
    return importlib.import_module(f"{__package__}.{FAMILIES[kind]}")


# ---------------------------------------------------------------------------- the table, applied


_PART = re.compile(r"^(.*)\[(\d+)\]$")


def _expand(table: dict[str, To], num_layers: int) -> dict[str, To]:
    out = {}
    for hf, to in table.items():
        if "{i}" in hf:
            for i in range(num_layers):
                out[hf.replace("{i}", str(i))] = to._replace(name=to.name.replace("{i}", str(i)))
        else:
            out[hf] = to
    return out


def _listing(title: str, items: list[str], limit: int = 12) -> str:
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {x}" for x in items[:limit]) + more


def convert(
    table: dict[str, To],
    tensors: dict[str, Tensor],
    *,
    num_layers: int,
    ignored: tuple[str, ...] = (),
    dtype: torch.dtype | None = None,
    what: str = "checkpoint",
) -> dict:
    """Apply a family table to HF-named tensors: check, transpose, fuse, cast.

    Returns the headwise state dict. Raises CheckpointError listing every missing,
    mis-shaped and unused tensor (fnmatch patterns in `ignored` are not weights).
    Entries are popped from `tensors` as they are converted, so an HF tensor can be
    freed as soon as its fused copy exists.
    """
    expanded = _expand(table, num_layers)
    missing = [n for n in expanded if n not in tensors]
    bad = [
        f"{n}: {tuple(tensors[n].shape)}, expected {tuple(to.shape)}"
        for n, to in expanded.items()
        if n in tensors and tuple(tensors[n].shape) != tuple(to.shape)
    ]
    unused = [n for n in tensors if n not in expanded and not any(fnmatch.fnmatchcase(n, p) for p in ignored)]
    if missing or bad or unused:
        parts = [_listing("missing", missing)] if missing else []
        parts += [_listing("wrong shape", bad)] if bad else []
        parts += (
            [_listing("unused (not in the table; a different architecture or a head we do not build?)", unused)]
            if unused
            else []
        )
        raise CheckpointError(f"{what} does not match its config:\n" + "\n".join(parts))

    group_size = Counter(_PART.match(to.name).group(1) for to in expanded.values() if _PART.match(to.name))
    groups: dict[str, dict[int, Tensor]] = {}
    fp32_fused: list[str] = []  # fused from parts in different quantized formats
    out: dict[str, Tensor] = {}
    for hf, to in expanded.items():
        t = tensors.pop(hf)
        t = t.t() if to.transpose else t
        if to.add:
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise CheckpointError(f"{hf} is {type(t).__name__}; its table entry adds {to.add} (a float tensor)")
            t = (t.float() + to.add).to(t.dtype)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        m = _PART.match(to.name)
        if m is None:
            out[to.name] = t.contiguous()
            continue
        name, k = m.group(1), int(m.group(2))
        groups.setdefault(name, {})[k] = t
        if len(groups[name]) == group_size[name]:  # fuse as soon as a group is whole
            blocks = groups.pop(name)
            if sorted(blocks) != list(range(len(blocks))):
                raise AssertionError(f"table bug: {name} has row blocks {sorted(blocks)}")
            parts = [blocks[j] for j in range(len(blocks))]
            kinds = mixed(parts)
            if kinds and name.endswith(QKV_WEIGHT):  # each keeps its format: the attention is unfused at load
                out |= {name.removesuffix("qkv_proj.weight") + f"{p}_proj.weight": t for p, t in zip("qkv", parts)}
                continue
            if kinds:
                fp32_fused.append(f"{name} [{kinds}]")
            out[name] = fuse_rows(parts)  # torch.cat, or rows of blocks stacked
    _split_qkv_biases(out)
    warn_mixed(fp32_fused, what)
    return out


def _split_qkv_biases(out: dict) -> None:
    """The fused q|k|v bias of an attention whose weights convert left as three (mixed formats)
    -> q_proj / k_proj / v_proj biases."""
    for name in [n for n in out if n.endswith("attn.q_proj.weight")]:
        prefix = name.removesuffix("q_proj.weight")
        bias = out.pop(prefix + "qkv_proj.bias", None)
        if bias is not None:
            sizes = [out[prefix + f"{p}_proj.weight"].shape[0] for p in "qkv"]
            out |= {prefix + f"{p}_proj.bias": b for p, b in zip("qkv", bias.split(sizes))}


def unfuse_attentions(model: nn.Module, state: dict) -> None:
    """Unfuse (MultiHeadAttention.unfuse) every meta-built attention whose Q, K and V arrive in
    `state` as three weights (convert left them apart: formats that cannot share one matrix)."""
    for name, m in model.named_modules():
        if getattr(m, "fused", False) and f"{name}.q_proj.weight" in state:
            m.unfuse()


# ---------------------------------------------------------------------------- dict -> model


def _default_dtype(tensors: dict[str, Tensor]) -> torch.dtype:
    """The checkpoint's own float dtype: the one most of its float elements have."""
    count = Counter()
    for t in tensors.values():
        if t.is_floating_point():
            count[t.dtype] += t.numel()
    return count.most_common(1)[0][0] if count else torch.float32


def as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if str(dtype).lower() not in names:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(names)} (or a torch.dtype)")
    return names[str(dtype).lower()]


def from_hf(
    hf_config: dict,
    tensors: dict[str, Tensor],
    *,
    dtype=None,
    backend: str = "auto",
    source: str | None = None,
    pack: bool = True,
    weights: str = "auto",
) -> nn.Module:
    """HF config dict + HF-named tensors -> a headwise model (eval mode). `tensors` is not modified.

    dtype: None keeps the checkpoint's float dtype; or a torch.dtype / "bf16" / "fp16" / "fp32".
    backend: the attention backend every layer uses. source: named in error messages.
    pack: CPU inference runs its linears on oneDNN-prepacked weights (packing.py), made on
    first use; False keeps plain nn.Linear (no second copy of the weights).
    weights: as in `load` (quantized_load.py); tensors may hold QuantTensor blocks.
    """
    dtype, weights = _weights_dtype(weights, dtype)
    return _build(hf_config, dict(tensors), dtype=dtype, backend=backend, source=source, pack=pack, weights=weights)


def _weights_dtype(weights: str, dtype) -> tuple[torch.dtype | None, str]:
    """Check weights= against dtype=: weights="bf16" means dtype bf16; other dtypes conflict with it."""
    weights = check_weights(weights)
    dtype = as_dtype(dtype)
    if weights == "bf16":
        if dtype not in (None, torch.bfloat16):
            raise ValueError(f"weights='bf16' and dtype={dtype} disagree; pass one of them")
        dtype = torch.bfloat16
    return dtype, weights


def _build(
    hf_config: dict,
    tensors: dict[str, Tensor],
    *,
    dtype,
    backend: str,
    source: str | None,
    pack: bool = True,
    weights: str = "auto",
) -> nn.Module:
    """from_hf on a dict it owns: entries are popped as they are used, so peak memory stays
    near one copy of the weights (plus one layer's fused tensors)."""
    family = family_of(hf_config)
    rename = getattr(family, "hf_name", None)
    if rename is not None:  # normalize prefixes, emptying the old dict
        tensors = {rename(k): tensors.pop(k) for k in list(tensors)}
    cfg = family.config_from_hf(hf_config, set(tensors))
    dtype = as_dtype(dtype) or _default_dtype(tensors)
    what = (
        f"{source or 'checkpoint'} ({hf_config.get('model_type') or cfg.arch}, {cfg.num_layers} layers, "
        f"C={cfg.d_model}, H={cfg.num_heads}, Hkv={cfg.num_kv_heads}, D={cfg.head_dim})"
    )
    state = convert(
        family.weight_table(cfg),
        tensors,
        num_layers=cfg.num_layers,
        ignored=family.ignored(cfg),
        dtype=dtype,
        what=what,
    )
    del tensors

    with torch.device("meta"):
        model = family.Model(cfg, backend=backend)
    return _finish(model, state, weights=weights, pack=pack, what=family.__name__ + " table")


def _finish(model: nn.Module, state: dict, *, weights: str, pack: bool, what: str) -> nn.Module:
    """A meta-built model + its headwise state dict (QuantTensors where quantized) -> the model.
    `state` is consumed: emptied once the model holds its tensors, so packing frees each old copy."""
    unfuse_attentions(model, state)
    requantize(state, model, weights)
    _split_qkv_biases(state)  # a mix may have put q, k and v apart (formats that cannot share a matrix)
    unfuse_attentions(model, state)
    install(model, state)
    expected = dict(model.named_parameters())  # tied aliases appear once
    expected |= {n: b for n, b in model.named_buffers() if n.endswith(".blocks")}
    wrong = sorted(n for n, t in state.items() if n in expected and t.shape != expected[n].shape)
    if set(state) != set(expected) or wrong:  # the table and the model disagree: a bug here
        raise AssertionError(
            f"{what} does not build the model: not produced "
            f"{sorted(set(expected) - set(state))}, unknown {sorted(set(state) - set(expected))}, "
            f"wrong shape {wrong}"
        )
    model.load_state_dict(state, assign=True, strict=False)
    state.clear()  # the model holds every tensor now: packing below frees each old copy as it goes
    model.tie_weights()
    model.init_buffers()
    still_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if still_meta:
        raise AssertionError(f"not loaded (still on the meta device): {still_meta}")
    if pack:
        pack_linears(model)
        # q4_0 / q4_1 / q8_0 blocks re-laid in groups of 8 rows (the same bytes, one copy): the
        # kernel reads 8 rows per load, ~1.3-2.3x the row layout's speed (kernels/quant.py)
        pack_quantized(model)
    return model.eval()
