"""Pruning a model whose linears hold GGUF blocks (QuantizedLinear: the default SmolLM2 load),
keeping the blocks, and saving / loading them as blocks.

Rows of a quantized weight are independent, so Q/K/V rows of the kept heads are a row slice of
the blocks (headwise.parallel.layers.take_rows, which tensor parallelism uses the same way). The
O projection keeps the kept heads' *input* columns: head h owns columns [h*D, (h+1)*D), whole
blocks when D is a multiple of the format's block (32 values: SmolLM2's D = 64), so each row
keeps a byte slice per head. Where D cuts through blocks the O projection stays the float
copy that MultiHeadAttention.prune_heads makes (its weights dequantized, exact).

On disk: the blocks in the file's (O, row_bytes) layout (unpacked from the kernel's 8-row
groups), the format of each quantized module in headwise_pruned.json; a tied output head
shares the embedding's blocks and is stored once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..models.linear import FORMATS, QuantizedEmbedding, QuantizedLinear
from ..parallel.layers import take_rows

PROJECTIONS = ("qkv_proj", "q_proj", "k_proj", "v_proj", "out_proj")


def _head_rows(heads, D: int, offset: int = 0) -> torch.Tensor:
    return torch.cat([torch.arange(offset + h * D, offset + (h + 1) * D) for h in heads])


@torch.no_grad()
def prune_layer(m: MultiHeadAttention, heads) -> None:
    """m.prune_heads(heads), then the projections that held blocks get block slices of the
    originals instead of the float copies it made."""
    old = {n: getattr(m, n) for n in PROJECTIONS if isinstance(getattr(m, n, None), QuantizedLinear)}
    H, Hkv, D, old_ids = m.num_heads, m.num_kv_heads, m.head_dim, list(m.head_ids)
    kv_of = m.kv_map.tolist() if m.kv_map is not None else [h // (H // Hkv) for h in range(H)]
    m.prune_heads(heads)  # the bookkeeping (head_ids, counts, kv_map) and float copies
    if not old:
        return
    kept = set(m.head_ids)
    keep = [i for i, h in enumerate(old_ids) if h in kept]  # old positions of kept query heads
    keep_kv = sorted({kv_of[i] for i in keep})
    q_rows, kv_rows = _head_rows(keep, D), _head_rows(keep_kv, D)
    if "qkv_proj" in old:  # rows [Q | K | V]
        m.qkv_proj = take_rows(old["qkv_proj"], torch.cat([q_rows, H * D + kv_rows, (H + Hkv) * D + kv_rows]))
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        if name in old:
            setattr(m, name, take_rows(old[name], rows))
    if "out_proj" in old:
        m.out_proj = head_columns(old["out_proj"], keep, D) or m.out_proj


@torch.no_grad()
def head_columns(lin: QuantizedLinear, heads, D: int) -> QuantizedLinear | None:
    """lin restricted to input columns of `heads` (each D wide), its blocks kept; None when D
    is not a whole number of blocks."""
    _, block, nbytes = FORMATS[lin.fmt]
    if D % block:
        return None
    O, per = lin.out_features, D // block
    rows = lin.file_blocks().view(O, lin.in_features // block, nbytes)  # (O, blocks, bytes)
    idx = _head_rows(heads, per).to(rows.device)
    blocks = rows.index_select(1, idx).reshape(O, -1).contiguous()
    new = QuantizedLinear(len(heads) * D, O, lin.fmt, lin.bias is not None, blocks=blocks, device=blocks.device)
    if lin.bias is not None:
        new.bias.data = lin.bias.detach().clone()
    if lin.packed:
        new.pack()
    return new


def formats(model: nn.Module) -> dict[str, str]:
    """{module name: GGUF format} of every quantized module (a tied head included)."""
    return {n: m.fmt for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors to save: quantized blocks in the file layout, shared tensors once."""
    out, seen = {}, {}
    quant = {n: m for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    for key, t in model.state_dict().items():
        owner, _, attr = key.rpartition(".")
        if owner in quant and attr == "blocks":
            ptr = t.data_ptr()
            if ptr in seen:  # a tied head: the embedding's blocks, stored once
                continue
            seen[ptr] = key
            t = quant[owner].file_blocks()
        out[key] = t.contiguous()
    return out


def make_quantized(model: nn.Module, fmts: dict[str, str]) -> None:
    """Replace the float modules named in `fmts` (a freshly built, pruned skeleton) with empty
    quantized ones of the same shape, ready for load_state_dict."""
    for name, fmt in fmts.items():
        m = model.get_submodule(name)
        if isinstance(m, nn.Embedding):
            new = QuantizedEmbedding(m.num_embeddings, m.embedding_dim, fmt)
        else:
            new = QuantizedLinear(m.in_features, m.out_features, fmt, m.bias is not None)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)


@torch.no_grad()
def rows_and_zeros(lin: QuantizedLinear, parts) -> QuantizedLinear:
    """A linear whose rows are, in order, each part of `parts`: an index tensor (those rows of
    lin) or an int (that many zero rows: all-zero bytes are zero scales and mins, and decode to
    0.0 in every format here). pad_kv_heads' K/V rows for heads no query reads."""
    src = lin.file_blocks()
    pieces = [
        src.index_select(0, p.to(src.device)) if torch.is_tensor(p) else src.new_zeros(p, src.shape[1]) for p in parts
    ]
    blocks = torch.cat(pieces).contiguous()
    bias = None
    if lin.bias is not None:
        b = lin.bias.detach()
        bias = torch.cat([b[p] if torch.is_tensor(p) else b.new_zeros(p) for p in parts])
    new = QuantizedLinear(lin.in_features, len(blocks), lin.fmt, bias is not None, blocks=blocks, device=blocks.device)
    if bias is not None:
        new.bias.data = bias
    if lin.packed:
        new.pack()
    return new
