"""Prune heads across a whole model for real, save the smaller model and load it back.

`MultiHeadAttention.prune_heads` removes a layer's Q rows and O columns, and a KV
head when its whole query group goes (GQA-aware; groups left uneven are served
through `kv_map`). With MQA (one KV head for every query head: Gemma 3 270M) only
query heads go: the one KV head stays, so a plan must keep a query head per layer. This walks a model's attention layers with a plan
{layer: [head, ...]} in each layer's *original* head numbering, so plans from
importance scores, saved configs and reloads all agree.

Saved form (a directory): `model.safetensors` (the pruned state dict, tied weights
stored once), `headwise_pruned.json` (the ModelConfig, the per-layer kept head ids
and head / KV-head counts) and the tokenizer files. `load_pruned(dir)` builds the
full-size model, prunes it by the saved plan (so every shape matches) and loads the
weights with safetensors' `load_model`, which restores tied weights. `record_quality`
adds what `headwise analyze` measured on the saved model (perplexity or cosine), which
`headwise serve` lists in /v1/models.

KV caches (contiguous and paged) hold one KV-head count Hkv for every layer, taken from
model.config. A plan that removes a whole KV group in some layers only leaves layers with
different counts; `load_pruned(dir, uniform_kv=True)` (what `headwise serve` loads) pads
each layer to the largest count with zero K/V rows that no query head reads (kv_map), and
sets model.config's Hkv to it. So the pool shrinks only where every layer lost a group:
Hkv = max over layers (benchmarks/pruned_capacity.py measures both cases).
A quantized model (GGUF blocks: QuantizedLinear / QuantizedEmbedding, the default SmolLM2 load)
keeps its blocks through pruning, saving and loading (prune_quant.py); `float_twin` gives its
dequantized float copy.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from ..core.config import ModelConfig, RopeScaling
from ..models.linear import QuantizedEmbedding, QuantizedLinear
from . import prune_quant
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
        m = layers[int(l)]
        left = set(m.head_ids) - {int(h) for h in heads}
        if not left and m.num_kv_heads == 1 and m.num_heads > 1:  # MQA (Gemma 3 270M, Falcon)
            raise ValueError(
                f"the plan removes every head of layer {l}: its {m.num_heads} query heads share one KV head "
                f"(MQA), and pruning removes query heads only, never that KV head; keep at least one query head"
            )
        if not left:
            raise ValueError(f"the plan removes every head of layer {l}; keep at least one")
    from ..models.packing import PackedLinear, pack_linears

    packed = any(isinstance(m, PackedLinear) for m in model.modules())
    for l, heads in plan.items():
        if heads:
            prune_quant.prune_layer(layers[int(l)], heads)  # blocks stay blocks
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
    """Parameters, tied ones once; a quantized weight counts its values (its blocks are a buffer)."""
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    quant = {id(m.blocks): m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    return params + sum(m.in_features * m.out_features for m in quant.values())


def kv_bytes_per_token(model: nn.Module) -> int:
    """K and V bytes one token takes over all layers at each layer's own KV-head count (what a
    cache with per-layer counts would hold), in the weights' float dtype."""
    size = next(model.parameters()).element_size()
    return sum(2 * m.num_kv_heads * m.head_dim * size for m in attention_layers(model))


@torch.no_grad()
def float_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` whose QuantizedLinear / QuantizedEmbedding modules are float ones holding
    their dequantized weights (ties made again), as a float checkpoint of the same model has."""
    twin = clone(model)
    for name, m in list(twin.named_modules()):
        if isinstance(m, QuantizedLinear):
            new = _linear(m.weight, None if m.bias is None else m.bias.detach().clone())
        elif isinstance(m, QuantizedEmbedding):
            new = nn.Embedding(m.num_embeddings, m.embedding_dim, device="meta")
            new.weight = nn.Parameter(m.weight, requires_grad=False)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(twin.get_submodule(parent) if parent else twin, attr, new)
    twin.tie_weights()
    return twin


def is_pruned_dir(path: str | Path) -> bool:
    """A directory written by `save_pruned`."""
    return (Path(path) / CONFIG_FILE).is_file()


def save_pruned(model: nn.Module, path: str | Path) -> Path:
    from safetensors.torch import save_model

    path = Path(path)
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(
            f"save_pruned needs a headwise model with a ModelConfig in .config, got {type(model).__name__}"
        )
    fmts = prune_quant.formats(model)
    path.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "headwise-pruned-1",
        "config": dataclasses.asdict(cfg),
        "layers": head_counts(model),
        "max_seq_length": getattr(model, "max_seq_length", None),
        "parameters": param_count(model),
        "kv_bytes_per_token": kv_bytes_per_token(model) if cfg.causal else 0,
        "quantized": fmts,  # module name -> GGUF format of its blocks; {} for a float model
    }
    if fmts:
        from safetensors.torch import save_file

        save_file(prune_quant.state_dict(model), str(path / WEIGHTS_FILE))
    else:
        save_model(model, str(path / WEIGHTS_FILE))  # writes tied tensors once
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    if getattr(model, "tokenizer", None) is not None:
        model.tokenizer.save(path)
    return path


def record_quality(path: str | Path, quality: dict) -> None:
    """Store what was measured on the saved model (`headwise analyze`: the metric, its value
    before and after pruning, the drop) in its headwise_pruned.json, read by `load_pruned`."""
    meta_file = Path(path) / CONFIG_FILE
    meta = json.loads(meta_file.read_text())
    meta["quality"] = quality
    meta_file.write_text(json.dumps(meta, indent=1))


@torch.no_grad()
def pad_kv_heads(model: nn.Module) -> int:
    """Give every attention layer the largest KV-head count Hkv of any layer (zero K/V rows
    for heads no query reads, kv_map set), and model.config that Hkv, so one cache fits all
    layers. Outputs do not change: a query head reads only the KV head kv_map names. -> Hkv."""
    layers = attention_layers(model)
    Hkv = max(m.num_kv_heads for m in layers)
    for m in layers:
        n, H, D = m.num_kv_heads, m.num_heads, m.head_dim
        if n == Hkv:
            continue
        kv_of = m.kv_map.tolist() if m.kv_map is not None else [h // (H // n) for h in range(H)]
        m.kv_map = torch.tensor(kv_of)  # on the weights' device below
        if m.fused and isinstance(m.qkv_proj, QuantizedLinear):  # rows [Q | K | 0 | V | 0], blocks kept
            r = torch.arange
            parts = [r(H * D), r(H * D, (H + n) * D), (Hkv - n) * D, r((H + n) * D, (H + 2 * n) * D), (Hkv - n) * D]
            m.qkv_proj, m.num_kv_heads = prune_quant.rows_and_zeros(m.qkv_proj, parts), Hkv
            m.kv_map = m.kv_map.to(m.qkv_proj.blocks.device)
            continue
        if not m.fused and all(isinstance(lin, QuantizedLinear) for lin in (m.k_proj, m.v_proj)):  # [K | 0], [V | 0]
            parts = [torch.arange(n * D), (Hkv - n) * D]
            m.k_proj, m.v_proj = (prune_quant.rows_and_zeros(lin, parts) for lin in (m.k_proj, m.v_proj))
            m.num_kv_heads, m.kv_map = Hkv, m.kv_map.to(m.k_proj.blocks.device)
            continue
        w_q, w_k, w_v, _ = m.projection_weights()
        b_q, b_k, b_v, _ = m.projection_biases()

        def pad(t):  # (n*D, ...) -> (Hkv*D, ...): the extra heads' rows are zero
            return torch.cat([t, t.new_zeros(((Hkv - n) * D, *t.shape[1:]))])

        ws, bs = [w_q, pad(w_k), pad(w_v)], [b_q, pad(b_k), pad(b_v)] if m.bias else None
        if m.fused:
            m.qkv_proj = _linear(torch.cat(ws), torch.cat(bs) if bs else None)
        else:
            m.q_proj, m.k_proj, m.v_proj = (_linear(w, bs and b) for w, b in zip(ws, bs or (None,) * 3))
        m.num_kv_heads = Hkv
        m.kv_map = m.kv_map.to(w_q.device)
    cfg = model.config
    if cfg.num_kv_heads != Hkv:
        H = max(m.num_heads for m in layers)
        H = -(-H // Hkv) * Hkv  # the config must divide; the layers keep their own H
        model.config = dataclasses.replace(cfg, num_heads=H, num_kv_heads=Hkv, head_dim=cfg.head_dim)
    return Hkv


def _linear(weight, bias) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def load_pruned(path: str | Path, *, backend: str = "auto", pack: bool = True, uniform_kv: bool = False) -> nn.Module:
    """A directory written by `save_pruned` -> the pruned model (eval mode). pack: prepacked
    CPU linears, as `headwise.load` does by default. uniform_kv: pad the layers to one KV-head
    count (`pad_kv_heads`), which headwise.generate and the engine's caches need once a plan
    removed whole KV groups in some layers only. model.pruned holds the saved numbers
    (parameters, kv_bytes_per_token, quality when measured)."""
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
    _unfuse_as_saved(model, path / WEIGHTS_FILE)
    fmts = meta.get("quantized") or {}
    if fmts:
        _load_blocks(model, path / WEIGHTS_FILE, fmts)
    else:
        load_model(model, str(path / WEIGHTS_FILE), strict=True)
    model.tie_weights()
    model.init_buffers()
    if (path / "tokenizer.json").is_file():
        from ..models.tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_dir(path)
    if meta.get("max_seq_length"):
        model.max_seq_length = meta["max_seq_length"]
    model.pruned = {k: meta[k] for k in ("parameters", "kv_bytes_per_token", "quality") if k in meta}
    model.pruned["kv_heads"] = [info["kv_heads"] for info in meta["layers"]]
    if uniform_kv and cfg.causal:
        pad_kv_heads(model)
    if pack:
        from ..models.linear import pack_quantized
        from ..models.packing import pack_linears

        pack_linears(model)
        pack_quantized(model)
    return model.eval()


def _unfuse_as_saved(model: nn.Module, file: Path) -> None:
    """Unfuse the skeleton's attentions that the saved model held as three linears (q_proj, k_proj,
    v_proj: a q|k|v whose parts were in formats that cannot share a matrix: MultiHeadAttention.unfuse)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        prefixes = {k.rsplit(".q_proj.", 1)[0] for k in f.keys() if ".q_proj." in k}
    for name, m in model.named_modules():
        if name in prefixes and getattr(m, "fused", False):
            m.unfuse()


def _load_blocks(model: nn.Module, file: Path, fmts: dict[str, str]) -> None:
    """Quantized modules in place of the skeleton's named ones, then every tensor from `file`;
    only a tied head's blocks (the embedding's) may be missing."""
    from safetensors.torch import load_file

    prune_quant.make_quantized(model, fmts)
    missing, unexpected = model.load_state_dict(load_file(str(file)), strict=False)
    tied = {"lm_head.blocks", "lm_head.weight"} if model.config.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{file}: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
