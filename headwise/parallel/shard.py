"""Split a model's heads over the ranks of a process group: `shard(model, comm)`, in place.

Rank r of N keeps Hkv/N consecutive KV heads and every query head that reads them (a GQA
group is never split: its queries and its K/V live on one rank, so attention needs no
communication), the matching rows of the fused QKV projection and columns of out_proj, and
1/N of the MLP's hidden units (rows of up / gate_up, columns of down). Two all-reduces a
layer put the partial sums together (layers.RowParallelLinear); embeddings, norms and, by
default, the output head are replicated, so every rank ends a step with the same logits.

    comm = headwise.parallel.init()          # one process per rank (torchrun, or spawn)
    model = headwise.load("smollm2-135m-instruct", weights="fp32")
    shard(model, comm)                       # SmolLM2: 3 KV heads, so N = 1 or 3
    headwise.generate(model, "Hello")        # every rank runs it; each gets the same text

After sharding, `model.config` describes this rank's share (num_heads H/N, num_kv_heads
Hkv/N, d_ff F/N), so a cache built from it holds only this rank's heads, (B, Hkv/N, S, D);
`model.parallel` keeps the whole model's config and the Comm.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..core.config import ModelConfig
from ..models.blocks import MLP, GatedMLP
from ..models.executors import invalidate
from ..models.linear import FORMATS, QuantizedLinear
from .comm import Comm
from .layers import RowParallelLinear, VocabParallelHead, take_columns, take_rows

LM_HEADS = ("replicated", "vocab")


@dataclass
class ShardInfo:
    rank: int
    world_size: int
    full_config: ModelConfig  # the whole model's; model.config is now this rank's share
    lm_head: str  # "replicated" or "vocab" (split over the vocabulary, one all-gather a step)
    comm: Comm
    dequantized: list[str]  # quantized linears whose slice cut through blocks, now fp32


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: modules with a MultiHeadAttention `attn` and an MLP `mlp`."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "attn", None), MultiHeadAttention)
        and isinstance(getattr(m, "mlp", None), MLP | GatedMLP)
    ]


def legal_world_sizes(model: nn.Module) -> list[int]:
    """The N this model can be split over: the divisors of every layer's KV-head count."""
    return legal_sizes([b.attn.num_kv_heads for b in blocks_of(model)])


def legal_sizes(kv_heads: Sequence[int]) -> list[int]:
    """The N that layers with these KV-head counts can be split over: the divisors of them all."""
    g = 0
    for h in kv_heads:
        g = math.gcd(g, h)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_kv_heads(kv_heads: Sequence[int], world_size: int) -> None:
    """check_world_size on the layers' KV-head counts alone: e.g. read from a checkpoint's config
    before loading it (`headwise serve --tensor-parallel N` checks N before it starts)."""
    legal = legal_sizes(kv_heads)
    if world_size not in legal:
        kv_text = " / ".join(map(str, sorted(set(kv_heads))))
        raise ValueError(
            f"cannot split {kv_text} KV heads over {world_size} ranks: each rank holds whole GQA groups "
            f"(a KV head with all its query heads; for MHA every head is its own group), so the number "
            f"of ranks must divide the KV heads. Legal tensor-parallel sizes for this model: "
            f"{', '.join(map(str, legal))}"
        )


def check_world_size(model: nn.Module, world_size: int) -> None:
    """Raise ValueError naming the legal N when `world_size` ranks cannot share the model's heads."""
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no attention blocks (attn + mlp) to split over ranks")
    check_kv_heads([b.attn.num_kv_heads for b in blocks], world_size)


@torch.no_grad()
def shard(model: nn.Module, comm: Comm | None = None, *, lm_head: str = "replicated") -> nn.Module:
    """Keep this rank's heads and MLP units of `model`, in place; returns it (see the module doc).

    comm: the process group (default: torch.distributed's default group, already initialized).
    lm_head: "replicated" (every rank computes all logits) or "vocab" (each 1/N, then an
    all-gather). Also seeds torch's default generator alike on every rank (Comm.sync_rng), so
    sampling without a seed draws the same tokens everywhere."""
    if getattr(model, "parallel", None) is not None:
        raise ValueError(f"this model is already sharded (rank {model.parallel.rank} of {model.parallel.world_size})")
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head={lm_head!r} is not one of {', '.join(LM_HEADS)}")
    comm = comm or Comm()
    N, r = comm.world_size, comm.rank
    check_world_size(model, N)
    cfg = model.config
    for i, block in enumerate(blocks_of(model)):
        if block.mlp.down.in_features < N:
            raise ValueError(f"layer {i}'s MLP has {block.mlp.down.in_features} hidden units, fewer than {N} ranks")
    dequantized: list[str] = []
    local_ff = None
    for i, block in enumerate(blocks_of(model)):
        _shard_attention(block.attn, comm, f"layer {i} attention", dequantized)
        local_ff = _shard_mlp(block.mlp, comm, f"layer {i} MLP", dequantized)
    invalidate(model)  # the attentions' head counts changed too, which torch's counters do not see
    if lm_head == "vocab":
        head = getattr(model, "lm_head", None)
        if head is None:
            raise ValueError(f"lm_head='vocab': {type(model).__name__} has no output head; use 'replicated'")
        sizes = _split_sizes(head.out_features, N, 1)
        lo = sum(sizes[:r])
        model.lm_head = VocabParallelHead(take_rows(head, torch.arange(lo, lo + sizes[r])), sizes, comm)
    model.config = dataclasses.replace(
        cfg, num_heads=cfg.num_heads // N, num_kv_heads=cfg.num_kv_heads // N, head_dim=cfg.head_dim, d_ff=local_ff
    )
    model.parallel = ShardInfo(r, N, cfg, lm_head, comm, dequantized)
    comm.sync_rng()
    return model


def _head_rows(heads, D: int, offset: int = 0) -> torch.Tensor:
    """Weight rows of heads `heads` (each D rows), shifted by `offset`."""
    return torch.cat([torch.arange(offset + h * D, offset + (h + 1) * D) for h in heads])


def _shard_attention(attn: MultiHeadAttention, comm: Comm, what: str, dequantized: list[str]) -> None:
    N, r = comm.world_size, comm.rank
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    kv_map = attn._buffers.get("kv_map")
    # after uneven pruning query head h reads KV head kv_map[h] (non-decreasing); else groups of G
    kv_of = kv_map.tolist() if kv_map is not None else [h // (H // Hkv) for h in range(H)]
    per = Hkv // N
    kv_lo, kv_hi = r * per, (r + 1) * per
    q_keep = [h for h in range(H) if kv_lo <= kv_of[h] < kv_hi]  # consecutive: groups are contiguous
    if q_keep != list(range(q_keep[0], q_keep[-1] + 1)):
        raise ValueError(f"{what}: the query heads of KV heads {kv_lo}..{kv_hi - 1} are not contiguous")
    first = attn.qkv_proj if attn.fused else attn.q_proj
    device = first.blocks.device if isinstance(first, QuantizedLinear) else first.weight.device
    kv_heads = range(kv_lo, kv_hi)
    q_rows, kv_rows = _head_rows(q_keep, D), _head_rows(kv_heads, D)
    if attn.fused:  # rows [Q | K | V]
        rows = torch.cat([q_rows, H * D + kv_rows, (H + Hkv) * D + kv_rows])
        attn.qkv_proj = take_rows(attn.qkv_proj, rows)
    else:
        attn.q_proj = take_rows(attn.q_proj, q_rows)
        attn.k_proj = take_rows(attn.k_proj, kv_rows)
        attn.v_proj = take_rows(attn.v_proj, kv_rows)
    out = attn.out_proj
    local, deq = take_columns(out, q_keep[0] * D, (q_keep[-1] + 1) * D)
    if deq:
        dequantized.append(f"{what} out_proj")
    attn.out_proj = RowParallelLinear(local, out.bias, comm, what)
    if attn.alibi_slopes is not None:
        attn.alibi_slopes = attn.alibi_slopes[q_keep[0] : q_keep[-1] + 1].clone()
    nH = len(q_keep)
    local_map = [kv_of[h] - kv_lo for h in q_keep]
    uniform = nH % per == 0 and local_map == [h // (nH // per) for h in range(nH)]
    attn.kv_map = None if uniform else torch.tensor(local_map, device=device)
    attn.head_ids = [attn.head_ids[h] for h in q_keep]
    attn.num_heads, attn.num_kv_heads = nH, per


def _shard_mlp(mlp: nn.Module, comm: Comm, what: str, dequantized: list[str]) -> int:
    """Keep this rank's hidden units; returns how many."""
    N, r = comm.world_size, comm.rank
    down = mlp.down
    F = down.in_features
    unit = 1
    if isinstance(down, QuantizedLinear) and F % FORMATS[down.fmt][1] == 0:
        unit = FORMATS[down.fmt][1]  # slices on block boundaries keep down's blocks as they are
    sizes = _split_sizes(F, N, unit)
    lo = sum(sizes[:r])
    hi = lo + sizes[r]
    units = torch.arange(lo, hi)
    if isinstance(mlp, GatedMLP):  # rows [gate | up]: the same units of both halves
        mlp.gate_up = take_rows(mlp.gate_up, torch.cat([units, F + units]))
    else:
        mlp.up = take_rows(mlp.up, units)
    local, deq = take_columns(down, lo, hi)
    if deq:
        dequantized.append(f"{what} down")
    mlp.down = RowParallelLinear(local, down.bias, comm, what)
    return hi - lo


def _split_sizes(n: int, parts: int, unit: int) -> list[int]:
    """n split into `parts` sizes, multiples of `unit` where n allows, differing by at most one unit."""
    units = n // unit
    if units < parts:
        units, unit = n, 1
    base, extra = divmod(units, parts)
    sizes = [(base + (i < extra)) * unit for i in range(parts)]
    sizes[-1] += n - sum(sizes)
    return sizes
