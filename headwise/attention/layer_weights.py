"""The weights of a `MultiHeadAttention` in and out: load four textbook projections, copy an
`nn.MultiheadAttention` in (`from_torch`) or out (`to_torch`), and prune query heads for real
(`prune_heads`). The layer's methods of the same names call these; the layer itself
(projections, forward) is in layer.py.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

# `layer` is a MultiHeadAttention (layer.py), typed as the nn.Module it is: layer.py imports this
# file, so this one names it without importing it (no cycle, not even a type-checking one).


@torch.no_grad()
def load_projections(layer: nn.Module, w_q, w_k, w_v, w_o, b_q=None, b_k=None, b_v=None, b_o=None) -> nn.Module:
    """Copy four textbook projections (tensors in nn.Linear's (out, in) layout, or
    nn.Linear modules, whose biases are taken too) into this layer."""
    ws, bs = [], [b_q, b_k, b_v, b_o]
    for i, w in enumerate((w_q, w_k, w_v, w_o)):
        if isinstance(w, nn.Linear):
            bs[i] = w.bias if bs[i] is None else bs[i]
            w = w.weight
        ws.append(w)
    names = ("w_q", "w_k", "w_v", "w_o")
    for name, src, dst in zip(names, ws, layer.projection_weights()):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"{name} has shape {tuple(src.shape)} but this layer needs {tuple(dst.shape)} "
                f"(H={layer.num_heads}, Hkv={layer.num_kv_heads}, D={layer.head_dim}, "
                f"C={layer.d_model})"
            )
        dst.copy_(src)
    for name, src, dst in zip(("b_q", "b_k", "b_v", "b_o"), bs, layer.projection_biases()):
        if (src is None) != (dst is None):
            raise ValueError(
                f"{name}: the layer has bias={layer.bias} but {name} is {'missing' if src is None else 'given'}"
            )
        if src is not None:
            if src.shape != dst.shape:
                raise ValueError(f"{name} has shape {tuple(src.shape)} but this layer needs {tuple(dst.shape)}")
            dst.copy_(src)
    return layer


def from_torch(cls: type[nn.Module], mha: nn.MultiheadAttention, backend: str = "auto") -> nn.Module:
    """Exact copy of an `nn.MultiheadAttention`'s weights. The new layer is batch-first
    and uses headwise mask conventions (bool attn_mask True = may attend)."""
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("nn.MultiheadAttention with add_bias_kv or add_zero_attn has no headwise equivalent")
    ref = mha.out_proj.weight
    layer = cls(
        mha.embed_dim,
        mha.num_heads,
        bias=mha.in_proj_bias is not None,
        dropout=mha.dropout,
        backend=backend,
        kdim=mha.kdim,
        vdim=mha.vdim,
        device=ref.device,
        dtype=ref.dtype,
    )
    if mha._qkv_same_embed_dim:
        w_q, w_k, w_v = mha.in_proj_weight.chunk(3, dim=0)
    else:
        w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    b = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None,) * 3
    return load_projections(layer, w_q, w_k, w_v, mha.out_proj.weight, *b, mha.out_proj.bias)


@torch.no_grad()
def to_torch(layer: nn.Module) -> nn.MultiheadAttention:
    """An `nn.MultiheadAttention(batch_first=True)` with these exact weights (MHA only)."""
    why = []
    if layer.num_kv_heads != layer.num_heads or layer.kv_map is not None:
        why.append(f"it has {layer.num_kv_heads} KV heads for {layer.num_heads} query heads (GQA/MQA)")
    if layer.num_heads * layer.head_dim != layer.d_model:
        why.append(f"num_heads*head_dim={layer.num_heads * layer.head_dim} != d_model={layer.d_model}")
    if layer.rope is not None or layer.alibi_slopes is not None:
        why.append("it uses RoPE/ALiBi")
    if (layer.out_proj.bias is not None) != layer.bias:
        why.append("its O projection and Q/K/V projections differ in having a bias")
    if why:
        raise ValueError("nn.MultiheadAttention cannot represent this layer: " + "; ".join(why))
    w_q, w_k, w_v, w_o = layer.projection_weights()
    b_q, b_k, b_v, b_o = layer.projection_biases()
    mha = nn.MultiheadAttention(
        layer.d_model,
        layer.num_heads,
        dropout=layer.dropout,
        bias=layer.bias,
        kdim=layer.kdim,
        vdim=layer.vdim,
        batch_first=True,
        device=w_o.device,
        dtype=w_o.dtype,
    )
    if mha._qkv_same_embed_dim:
        mha.in_proj_weight.copy_(torch.cat([w_q, w_k, w_v]))
    else:
        mha.q_proj_weight.copy_(w_q), mha.k_proj_weight.copy_(w_k), mha.v_proj_weight.copy_(w_v)
    if layer.bias:
        mha.in_proj_bias.copy_(torch.cat([b_q, b_k, b_v]))
        mha.out_proj.bias.copy_(b_o)
    mha.out_proj.weight.copy_(w_o)
    return mha


@torch.no_grad()
def prune_heads(layer: nn.Module, heads: Iterable[int]) -> nn.Module:
    """Remove query heads for real: Q rows and O columns go; a KV head goes when its
    whole group does. `heads` are original head indices (see `head_ids`); ones
    already pruned are ignored. Groups left uneven are served through `kv_map`."""
    heads = set(int(h) for h in heads)
    out_of_range = sorted(h for h in heads if not 0 <= h < layer.original_num_heads)
    if out_of_range:
        raise ValueError(
            f"head indices {out_of_range} are out of range: this layer was built with {layer.original_num_heads} heads"
        )
    keep = [i for i, h in enumerate(layer.head_ids) if h not in heads]  # positions of kept query heads
    if not keep:
        raise ValueError(f"pruning {sorted(heads)} would remove every head of this layer")
    if len(keep) == layer.num_heads:
        return layer
    H, D, G = layer.num_heads, layer.head_dim, layer.num_heads // layer.num_kv_heads
    kv_of = layer.kv_map.tolist() if layer.kv_map is not None else [h // G for h in range(H)]
    keep_kv = sorted({kv_of[i] for i in keep})
    new_kv = {kv: j for j, kv in enumerate(keep_kv)}
    kv_map = [new_kv[kv_of[i]] for i in keep]

    def rows(idx):  # weight rows of heads `idx`
        return torch.cat([torch.arange(h * D, (h + 1) * D) for h in idx])

    q_rows, kv_rows = rows(keep), rows(keep_kv)
    w_q, w_k, w_v, w_o = layer.projection_weights()
    b_q, b_k, b_v, b_o = layer.projection_biases()
    dev = w_o.device
    q_rows, kv_rows = q_rows.to(dev), kv_rows.to(dev)
    nH, nHkv = len(keep), len(keep_kv)
    new_w = [w_q[q_rows], w_k[kv_rows], w_v[kv_rows]]
    new_b = [b_q[q_rows], b_k[kv_rows], b_v[kv_rows]] if layer.bias else None
    if layer.fused:
        layer.qkv_proj = _linear(torch.cat(new_w), torch.cat(new_b) if new_b else None)
    else:
        layer.q_proj = _linear(new_w[0], new_b and new_b[0])
        layer.k_proj = _linear(new_w[1], new_b and new_b[1])
        layer.v_proj = _linear(new_w[2], new_b and new_b[2])
    layer.out_proj = _linear(w_o[:, q_rows], b_o)
    if layer.alibi_slopes is not None:
        layer.alibi_slopes = layer.alibi_slopes[torch.tensor(keep, device=layer.alibi_slopes.device)]
    layer.head_ids = [layer.head_ids[i] for i in keep]
    layer.num_heads, layer.num_kv_heads = nH, nHkv
    uniform = nH % nHkv == 0 and kv_map == [h // (nH // nHkv) for h in range(nH)]
    layer.kv_map = None if uniform else torch.tensor(kv_map, device=dev)
    return layer


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.clone())
    if bias is not None:
        lin.bias = nn.Parameter(bias.clone())
    return lin
