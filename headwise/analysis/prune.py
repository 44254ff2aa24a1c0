"""Prune heads across a whole model for real, save the smaller model and load it back.

`MultiHeadAttention.prune_heads` removes a layer's Q rows and O columns, and a KV
head when its whole query group goes (GQA-aware; groups left uneven are served
through `kv_map`). This walks a model's attention layers with a plan
{layer: [head, ...]} in each layer's *original* head numbering, so plans from
importance scores, saved configs and reloads all agree.

Saved form (a directory): `model.safetensors` (the pruned state dict, tied weights
stored once), `headwise_pruned.json` (the ModelConfig, the per-layer kept head ids
and head / KV-head counts) and the tokenizer files. `load_pruned(dir)` builds the
full-size model, prunes it by the saved plan (so every shape matches) and loads the
weights with safetensors' `load_model`, which restores tied weights.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Mapping, Sequence

from torch import nn

from ..config import ModelConfig, RopeScaling
from .hooks import attention_layers

CONFIG_FILE = "headwise_pruned.json"
WEIGHTS_FILE = "model.safetensors"


def clone(model: nn.Module) -> nn.Module:
    """A deep copy. Prepacked linears (models/packing.py) hold oneDNN tensors that cannot be
    copied, so they are unpacked first; both models pack again on their next forward."""
    from ..models.packing import pack_linears, unpack_linears

    packed = unpack_linears(model)
    twin = copy.deepcopy(model)
    if packed:
        pack_linears(model)
        pack_linears(twin)
    return twin


def prune_heads(model: nn.Module, plan: Mapping[int, Sequence[int]]) -> nn.Module:
    """Remove heads {layer: [original head ids]} from `model`, in place; returns it.
    Refuses (before touching anything) a plan that would empty a layer. Linears of a
    prepacked model (models/packing.py) that pruning replaces are packed again."""
    layers = attention_layers(model)
    for l, heads in plan.items():
        if not 0 <= int(l) < len(layers):
            raise ValueError(f"layer {l} is out of range: the model has {len(layers)} attention layers")
        left = set(layers[int(l)].head_ids) - {int(h) for h in heads}
        if not left:
            raise ValueError(f"the plan removes every head of layer {l}; keep at least one")
    from ..models.packing import PackedLinear, pack_linears

    packed = any(isinstance(m, PackedLinear) for m in model.modules())
    for l, heads in plan.items():
        if heads:
            layers[int(l)].prune_heads(heads)
    if packed:
        pack_linears(model)
    return model


def plan_from(removed: set[tuple[int, int]], model: nn.Module) -> dict[int, list[int]]:
    """Ablation's (layer, current head index) pairs -> a prune plan in original head ids."""
    layers = attention_layers(model)
    plan: dict[int, list[int]] = {}
    for l, h in sorted(removed):
        plan.setdefault(l, []).append(layers[l].head_ids[h])
    return plan


def head_counts(model: nn.Module) -> list[dict]:
    return [
        {
            "heads": m.num_heads,
            "kv_heads": m.num_kv_heads,
            "head_ids": list(m.head_ids),
            "original_heads": m.original_num_heads,
        }
        for m in attention_layers(model)
    ]


def param_count(model: nn.Module) -> int:
    """Parameters, tied ones once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_pruned(model: nn.Module, path: str | Path) -> Path:
    from safetensors.torch import save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(
            f"save_pruned needs a headwise model with a ModelConfig in .config, got {type(model).__name__}"
        )
    meta = {
        "format": "headwise-pruned-1",
        "config": dataclasses.asdict(cfg),
        "layers": head_counts(model),
        "max_seq_length": getattr(model, "max_seq_length", None),
    }
    save_model(model, str(path / WEIGHTS_FILE))  # writes tied tensors once
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    if getattr(model, "tokenizer", None) is not None:
        model.tokenizer.save(path)
    return path


def load_pruned(path: str | Path, *, backend: str = "auto", pack: bool = True) -> nn.Module:
    """A directory written by `save_pruned` -> the pruned model (eval mode). pack: prepacked
    CPU linears, as `headwise.load` does by default."""
    from safetensors.torch import load_model
    from ..models import Bert, GPT2, Llama

    path = Path(path)
    meta_file = path / CONFIG_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}: not a directory written by save_pruned")
    meta = json.loads(meta_file.read_text())
    c = dict(meta["config"])
    if c.get("rope_scaling"):
        c["rope_scaling"] = RopeScaling(**c["rope_scaling"])
    c["eos_token_ids"] = tuple(c.get("eos_token_ids") or ())
    cfg = ModelConfig(**c)
    family = {"llama": Llama, "bert": Bert, "gpt2": GPT2}.get(cfg.arch)
    if family is None:
        raise ValueError(f"{meta_file}: arch {cfg.arch!r} has no headwise model class")
    model = family(cfg, backend=backend)
    plan = {
        l: sorted(set(range(info["original_heads"])) - set(info["head_ids"])) for l, info in enumerate(meta["layers"])
    }
    prune_heads(model, plan)
    for l, (m, info) in enumerate(zip(attention_layers(model), meta["layers"])):
        if m.head_ids != info["head_ids"]:
            raise ValueError(f"{meta_file}: layer {l} keeps heads {info['head_ids']} in an order pruning cannot make")
    load_model(model, str(path / WEIGHTS_FILE), strict=True)
    model.tie_weights()
    model.init_buffers()
    if (path / "tokenizer.json").is_file():
        from ..models.tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_dir(path)
    if meta.get("max_seq_length"):
        model.max_seq_length = meta["max_seq_length"]
    if pack:
        from ..models.packing import pack_linears

        pack_linears(model)
    return model.eval()
