"""The one-token decode step of a Llama-family model on CPU, in as few calls as it takes.

Decoding one token at batch 1 reads every weight once (~540 MB for SmolLM2-135M in fp32) and
does little else, so the step is as fast as the weights stream, plus the cost of every
PyTorch call around the matmuls (~1,000 per token in the general forward: module calls,
norms, RoPE, cache bookkeeping, residual adds). This path computes the same function as
`Llama.forward` for that case with ~10 calls per layer:

    qkv = rmsnorm_linear(x)             one kernel call (norm folded into the matmul)
    q|k = qkv[q|k] @ R                  RoPE of every head as one matmul with the rotation
                                        matrix of this position (built once per step)
    cache[L] = k, v                     two copies into the preallocated cache
    o   = sdpa(q as (B, Hkv, G, D), K, V)   the G queries sharing a KV head as G rows:
                                        no causal mask is needed at the newest position
    x   = linear(o) + x                 residual folded into the kernel
    x   = swiglu_linear(rmsnorm_linear(x)) + x

The matmuls go through `headwise.kernels.small_linear` (a PackedLinear's blocked weight,
prologue and residual folded in) where it runs and B <= its row limit, else through the
modules (oneDNN, or plain nn.Linear with pack=False) with the norm, SwiGLU and residual as
PyTorch ops.

It runs only where it is exactly the general forward: inference (no grad), fp32 on CPU,
one new token per sequence with no padding mask, a ContiguousKVCache that is not static,
not int8, with every sequence at the same length, standard RMSNorm/SwiGLU/RoPE blocks, no
analysis hook, no uneven GQA map after pruning, and no forward hooks on the modules it
bypasses. Everything else takes the general path. Tests: tests/models/test_fast_decode.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..attention import RotaryEmbedding
from ..attention.kv import fold_heads
from ..cache import ContiguousKVCache
from .blocks import DecoderBlock, GatedMLP, RMSNorm
from .packing import PackedLinear

_ATTR = "_headwise_fast_decode"


def fast_decode_applies(model, input_ids: Tensor, cache, attention_mask) -> bool:
    """Whether `decode_step` computes exactly what the general forward would, for this call."""
    if (cache is None or type(cache) is not ContiguousKVCache or cache.static or cache.kv_dtype is not None
            or attention_mask is not None or input_ids.shape[1] != 1 or torch.is_grad_enabled()
            or model.training or torch.compiler.is_compiling() or cache.dtype != torch.float32):
        return False
    first, w = cache.layers[0], model.embed.weight
    if (not first._uniform or first._host[0] != cache.layers[-1]._host[0] or input_ids.device.type != "cpu"
            or w.dtype != torch.float32 or w.device.type != "cpu"):     # after model.to(...): checked per call
        return False
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return False
    modules = _checked_modules(model)
    if modules is None:
        return False
    for module in modules:                      # hooks come and go: checked every call (~20 us)
        if module._forward_hooks or module._forward_pre_hooks:
            return False
    return all(layer.attn.hook is None and layer.attn.kv_map is None for layer in model.layers)


def _checked_modules(model) -> list | None:
    """The modules this path bypasses (their hooks would not run), if the model's structure
    suits it, else None. Checked again when the model's top modules or any layer's attention
    projection is replaced (pruning does that)."""
    key = (model.layers, len(model.layers), model.norm, model.lm_head, model.embed,
           *(layer.attn.qkv_proj for layer in model.layers))
    cached = model.__dict__.get(_ATTR)
    if cached is not None and cached[0] == key:
        return cached[1]
    model.__dict__[_ATTR] = (key, _structure_ok(model) and [*model.layers.modules(), *key[2:5]] or None)
    return model.__dict__[_ATTR][1]


def _structure_ok(model) -> bool:
    D, rope = model.config.head_dim, model.rope
    if type(model.norm) is not RMSNorm or not isinstance(rope, RotaryEmbedding) or rope.interleaved or rope.dim != D:
        return False
    for layer in model.layers:
        attn = layer.attn
        if (type(layer) is not DecoderBlock or attn.kv_map is not None or not attn.fused or attn.rope is not rope
                or attn.head_dim != D or attn.alibi_slopes is not None or type(layer.attn_norm) is not RMSNorm
                or type(layer.mlp_norm) is not RMSNorm or type(layer.mlp) is not GatedMLP
                or attn.num_heads % attn.num_kv_heads):
            return False
    return True


def _rotation(rope: RotaryEmbedding, position: int, D: int) -> Tensor:
    """(D, D) R with x @ R == rope(x) at `position` (half-split layout, HF's rotate_half):
    out[i] = x[i] cos - x[i + D/2] sin, out[i + D/2] = x[i + D/2] cos + x[i] sin."""
    cos, sin = rope.cos_sin(torch.tensor([position]))              # (1, 1, 1, D/2) each
    c, s = torch.cat((cos, cos), -1).reshape(D), torch.cat((sin, sin), -1).reshape(D)
    h = D // 2
    R = torch.diag(c)
    idx = torch.arange(h)
    R[idx + h, idx] = -s[:h]
    R[idx, idx + h] = s[h:]
    return R


def _linear(module, x: Tensor, *, residual: Tensor | None = None, norm: RMSNorm | None = None,
            swiglu: bool = False) -> Tensor:
    """module(prologue(x)) + residual: one small-row kernel call where the module is a
    PackedLinear that takes x, else the module and PyTorch ops."""
    if type(module) is PackedLinear and module.small_rows_ok(x):
        prologue = kernels.PRO_RMSNORM if norm is not None else kernels.PRO_SWIGLU if swiglu else kernels.PRO_NONE
        return kernels.small_linear(x, module.blocked_weight(), module.out_features, module.bias, residual=residual,
                                    prologue=prologue, norm_weight=None if norm is None else norm.weight,
                                    eps=0.0 if norm is None else norm.eps)
    if norm is not None:
        x = norm(x)
    elif swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = module(x)
    return y if residual is None else y + residual


def decode_step(model, input_ids: Tensor, cache: ContiguousKVCache) -> Tensor:
    """input_ids (B, 1) -> logits (B, 1, V) fp32, appending to `cache`; only where
    `fast_decode_applies` (the caller checks)."""
    B = input_ids.shape[0]
    D = model.config.head_dim
    L = cache.layers[0]._host[0]
    for layer_cache in cache.layers:                   # checks room in every layer before writing any
        layer_cache._book(1, None)
    R = _rotation(model.rope, L, D)
    x = F.embedding(input_ids.reshape(B), model.embed.weight)         # (B, C)
    for layer, lc in zip(model.layers, cache.layers):
        attn, mlp = layer.attn, layer.mlp
        H, Hkv = attn.num_heads, attn.num_kv_heads            # per layer: pruning may change them
        silu = mlp.activation == "silu"
        qkv = _linear(attn.qkv_proj, x, norm=layer.attn_norm)           # (B, (H + 2 Hkv) D)
        qk = torch.matmul(qkv[:, :(H + Hkv) * D].view(B, H + Hkv, D), R)           # (B, H + Hkv, D) rotated
        k_buf, v_buf = lc.store.k[0], lc.store.v[0]                                # (B, Hkv, N, D)
        k_buf[:, :, L].copy_(qk[:, H:])
        v_buf[:, :, L].copy_(qkv[:, (H + Hkv) * D:].view(B, Hkv, D))
        q = fold_heads(qk[:, :H, None], Hkv)                                      # (B, Hkv, G, D)
        o = F.scaled_dot_product_attention(q, k_buf[:, :, :L + 1], v_buf[:, :, :L + 1])   # (B, Hkv, G, D)
        x = _linear(attn.out_proj, o.reshape(B, H * D), residual=x)     # (B, C)
        if silu:
            gu = _linear(mlp.gate_up, x, norm=layer.mlp_norm)           # (B, 2F)
            x = _linear(mlp.down, gu, residual=x, swiglu=True)
        else:
            x = x + mlp(layer.mlp_norm(x))
    for layer_cache in cache.layers:
        layer_cache._len += 1
    logits = _linear(model.lm_head, x, norm=model.norm)                # (B, V)
    return logits.view(B, 1, -1)
