"""`MultiHeadAttention`: project, split into heads, attend, concatenate, project back.

One module for MHA (Hkv == H), GQA (1 < Hkv < H) and MQA (Hkv == 1). Self
attention runs one fused QKV matmul; cross attention projects Q from the query
and K/V from the memory. The attention itself is `attend()`, so every backend,
mask kind and cache works here unchanged.

Parameters (no bias): C*H*D (Q) + 2*C*Hkv*D (K, V) + H*D*C (O). For MHA with
H*D = C that is the seed's 4*C^2; for GQA it is 2*C^2 + 2*C^2*Hkv/H.

Weights in and out (`load_projections`, `from_torch`, `to_torch`) and head pruning
(`prune_heads`) are methods here whose work is in layer_weights.py.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import layer_weights
from .functional import attend, attend_kv
from .kv import LayerKV, LayerKVCache
from .masks import alibi_slopes as make_alibi_slopes
from .rope import RotaryEmbedding
from .spec import check_softcap
from .step import right_padding_lengths


class MultiHeadAttention(nn.Module):
    """Multi-head attention over batch-first inputs (B, T, C).

    Args:
        d_model: model width C.
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (default H); H % Hkv == 0.
        head_dim: D (default C // H).
        bias: biases on the projections (Q, K, V and, unless out_bias says otherwise, O).
        out_bias: bias on the O projection; None = `bias`. Qwen2 biases Q, K, V but not O.
        dropout: dropout on attention weights, applied in training mode only.
        rope: None, True (RoPE over the whole head, base 10000) or a `RotaryEmbedding`.
        backend: attention backend name, or "auto" (see `headwise.attention.backends()`).
        kdim, vdim: widths of key/value inputs for cross attention (default C).
        alibi: add ALiBi biases with the paper's slopes.
        window: sliding window W: each query sees the W keys ending at its own position
            (Mistral's and Gemma's sliding_window: key j visible from query p iff p - W < j <= p).
        softcap: c > 0 caps the scaled scores at c * tanh(s / c) before masks (Gemma 2's
            attn_logit_softcapping).
        scale: the scores' scale; None = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar**-0.5).
        q_norm, k_norm: modules over the last dim D of each query / key head (RMSNorm(D) in Qwen3
            and Gemma 3), applied after the projection and before RoPE.

    Masks follow `attend`: a bool attn_mask is True where attention is *allowed*
    (the opposite of `nn.MultiheadAttention`); key_padding_mask is True at padding.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        rope: RotaryEmbedding | bool | None = None,
        backend: str = "auto",
        kdim: int | None = None,
        vdim: int | None = None,
        alibi: bool = False,
        out_bias: bool | None = None,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1:
            raise ValueError(f"num_heads={num_heads} and num_kv_heads={num_kv_heads} must be >= 1")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = d_model // num_heads
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.dropout, self.backend, self.bias = dropout, backend, bias
        kw = {"device": device, "dtype": dtype}
        H, Hkv, D = num_heads, num_kv_heads, head_dim
        self.fused = self.kdim == d_model and self.vdim == d_model
        if self.fused:
            self.qkv_proj = nn.Linear(d_model, (H + 2 * Hkv) * D, bias=bias, **kw)  # rows: [Q | K | V]
        else:
            self.q_proj = nn.Linear(d_model, H * D, bias=bias, **kw)
            self.k_proj = nn.Linear(self.kdim, Hkv * D, bias=bias, **kw)
            self.v_proj = nn.Linear(self.vdim, Hkv * D, bias=bias, **kw)
        self.out_proj = nn.Linear(H * D, d_model, bias=bias if out_bias is None else out_bias, **kw)
        self.rope = RotaryEmbedding(D) if rope is True else (rope or None)
        if alibi:
            self.register_buffer("alibi_slopes", make_alibi_slopes(H), persistent=False)
        else:
            self.alibi_slopes = None
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an int >= 1 (keys each query sees, its own included), got {window!r}")
        if scale is not None and not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
            raise ValueError(f"scale must be a finite number > 0 (None = 1/sqrt(head_dim)), got {scale!r}")
        self.window, self.softcap = window, check_softcap(softcap)
        self.scale = None if scale is None else float(scale)
        # Per-head norms of q and k before RoPE; registered only when given, so a state dict
        # holds attn.q_norm.weight exactly where a model has them.
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
            if norm is not None:
                setattr(self, name, norm)
        # After uneven GQA pruning, query head h reads KV head kv_map[h]; None = uniform groups.
        self.register_buffer("kv_map", None, persistent=False)
        self.head_ids = list(range(H))  # original index of each remaining query head
        self.original_num_heads = H
        # Analysis capture point (headwise.analysis.hooks installs it for one run, then removes
        # it): sees q, k, v, the LSE and the per-head outputs, may replace the latter. None = no cost.
        self.hook = None

    # Counts every setting of any attention's `hook` slot or `backend`: a model's fused executor,
    # planned from them, looks at them again only when it moved (models/executors.py), not per step.
    settings_changes = 0

    @property
    def hook(self):
        return self.__dict__["_hook"]

    @hook.setter
    def hook(self, value) -> None:
        self.__dict__["_hook"] = value
        MultiHeadAttention.settings_changes += 1

    @property
    def backend(self) -> str:
        return self.__dict__["_backend"]

    @backend.setter
    def backend(self, value: str) -> None:
        self.__dict__["_backend"] = value
        MultiHeadAttention.settings_changes += 1

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: LayerKVCache | None = None,
        head_mask: Tensor | None = None,
        rope_cos_sin: tuple[Tensor, Tensor] | None = None,
        num_new: Tensor | None = None,
    ):
        """query (B, T, C); key (B, S, kdim), value (B, S, vdim) default to query.

        attn_mask: (T, S), (B*H, T, S) as in nn.MultiheadAttention, or anything
        broadcastable to (B, H, T, S). head_mask: (H,) or (B, H) multiplier on each
        head's output (0 ablates a head; pass requires_grad for importance scores).
        rope_cos_sin: `self.rope.cos_sin(positions)` of the T new tokens, computed once by
        a model and shared by all its layers (self-attention, where the T keys are those
        same tokens, or cached ones that were rotated when written).
        num_new: with cache=, (B,) real tokens among the T when rows are right-padded (the
        padding is not kept); key_padding_mask (B, T) says the same as a mask.
        Returns the output (B, T, C), or (output, weights (B, H, T, S)) with
        need_weights (computed on the math backend for that call).
        """
        if query.dim() != 3 or query.shape[-1] != self.d_model:
            raise ValueError(f"query must be (B, T, d_model={self.d_model}), got {tuple(query.shape)}")
        key = query if key is None else key
        value = key if value is None else value
        self_attn = key is query and value is query
        if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must be (B, S, dim) "
                f"with the query's batch {query.shape[0]}"
            )
        B, T, _ = query.shape
        S_new = key.shape[1]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim

        q, k, v = self._project(query, key, value, self_attn)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, S_new, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
        v = v.view(B, S_new, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
        q, k = self.norm_qk(q, k)  # Qwen3 / Gemma 3: per-head RMSNorm, before RoPE

        if attn_mask is not None and attn_mask.dim() == 3 and attn_mask.shape[0] == B * H and B * H != 1:
            attn_mask = attn_mask.view(B, H, *attn_mask.shape[1:])  # nn.MultiheadAttention's (B*H, T, S)
        hook = self.hook
        kwargs = dict(
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            alibi_slopes=self.alibi_slopes,
            dropout_p=self.dropout if self.training else 0.0,
            backend="math" if need_weights else self.backend,
            need_weights=need_weights,
            return_lse=hook is not None and hook.wants_lse,
            **self.attend_settings(),  # window, softcap, scale: what a hook rebuilding weights needs too
        )
        if cache is not None:
            if not self_attn:
                raise ValueError("cache= is for self-attention; cross-attention K/V can be computed once")
            if key_padding_mask is not None:  # with a cache it marks padding among the T new tokens
                if num_new is not None:
                    raise ValueError("pass num_new or key_padding_mask with cache=, not both")
                num_new = right_padding_lengths(key_padding_mask, B, T)
                kwargs["key_padding_mask"] = None
            if self.rope is not None:
                cs = rope_cos_sin if rope_cos_sin is not None else self.rope.cos_sin(cache.positions(T))
                q, k = self.rope(q, cos_sin=cs), self.rope(k, cos_sin=cs)
        elif num_new is not None:
            raise ValueError(
                "num_new counts the real new tokens written to a cache; without cache= "
                "mark padding with key_padding_mask"
            )
        elif self.rope is not None and rope_cos_sin is not None:
            if k.shape[2] != T:
                raise ValueError(
                    f"rope_cos_sin covers the {T} query tokens but there are {k.shape[2]} keys; "
                    f"it is for self-attention"
                )
            q, k = self.rope(q, cos_sin=rope_cos_sin), self.rope(k, cos_sin=rope_cos_sin)
        elif self.rope is not None:
            S = k.shape[2]
            q = self.rope(q, torch.arange(S - T, S, device=q.device))  # bottom-right, as causal masks
            k = self.rope(k, torch.arange(S, device=k.device))
        res = self.attend_heads(q, k, v, cache, num_new, kwargs)
        out, weights = (res.out, res.weights) if isinstance(res, tuple) else (res, None)  # out: (B, H, T, D)
        if hook is not None:  # k, v: what attend() saw; with a cache only the new ones, so not passed
            out = hook(
                self,
                q,
                *((k, v) if cache is None else (None, None)),
                out,
                res.lse if isinstance(res, tuple) else None,
                weights,
                kwargs,
            )
        if head_mask is not None:
            out = out * _head_multiplier(head_mask, B, H).to(out.dtype)
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, H * D))  # (B, T, C)
        return (out, weights) if need_weights else out

    def attend_heads(
        self, q: Tensor, k: Tensor, v: Tensor, cache: LayerKVCache | None, num_new: Tensor | None, kwargs: dict
    ):
        """Heads in, heads out: q (B, H, T, D) and this step's k, v (B, Hkv, T|S, D), rotated already,
        written to `cache` (if any) and attended through it or directly (`attend` kwargs). The
        general forward and the decoder block's few-rows route both end here. The layer's own
        window, softcap and scale join `kwargs` (a caller's own values win), so callers pass none."""
        kv_map = self._buffers["kv_map"]  # a registered buffer, read without nn.Module's slow __getattr__
        if self.window is not None or self.softcap is not None or self.scale is not None:
            kwargs = {**self.attend_settings(), **kwargs}
        if cache is not None:
            read = cache.update(k, v, num_new)
            kv = getattr(read, "kv", None)
            if kwargs.get("softcap") is not None and isinstance(kv, LayerKV):
                # a paged cache's read (cache/paged_step.py) names its attend() keywords and softcap
                # is not yet among them: read its blocks through attend_kv, which its attend() calls
                return attend_kv(q, kv, kv_map=kv_map, **kwargs)
            return read.attend(q, kv_map=kv_map, **kwargs)
        if kv_map is not None:  # uneven groups after pruning: give each query head its K/V
            k, v = k.index_select(1, kv_map), v.index_select(1, kv_map)
        return attend(q, k, v, **kwargs)

    def attend_settings(self) -> dict:
        """The `attend` keywords this layer adds to every call: window, softcap, scale (those set)."""
        pairs = (("window", self.window), ("softcap", self.softcap), ("scale", self.scale))
        return {name: value for name, value in pairs if value is not None}

    def norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q_norm(q), k_norm(k) (each unchanged where the layer has none): per-head norms over
        the last dim D, so any layout works ((B, H, T, D), (B, T, H, D), (N, H, D)). Call it
        after the projection and before RoPE, as `forward` does; a route that projects and
        rotates q and k itself (models' fused layer) calls it between the two."""
        m = self._modules
        qn, kn = m.get("q_norm"), m.get("k_norm")
        return (q if qn is None else qn(q)), (k if kn is None else kn(k))

    def _project(self, query, key, value, self_attn):
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        sizes = [H * D, Hkv * D, Hkv * D]
        if not self.fused:
            return self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if self_attn:
            return self.qkv_proj(query).split(sizes, dim=-1)  # one matmul
        w = self.qkv_proj.weight.split(sizes, dim=0)
        b = self.qkv_proj.bias.split(sizes, dim=0) if self.qkv_proj.bias is not None else (None,) * 3
        q = F.linear(query, w[0], b[0])
        if key is value:  # one matmul for K and V
            wkv = self.qkv_proj.weight[H * D :]
            bkv = self.qkv_proj.bias[H * D :] if self.qkv_proj.bias is not None else None
            k, v = F.linear(key, wkv, bkv).split(sizes[1:], dim=-1)
            return q, k, v
        return q, F.linear(key, w[1], b[1]), F.linear(value, w[2], b[2])

    # ------------------------------------------------------------- weights in/out
    def unfuse(self) -> "MultiHeadAttention":
        """Hold Q, K and V in three linears (q_proj, k_proj, v_proj) instead of qkv_proj's one: the
        same rows, three matmuls. Loading does it where a checkpoint stores them in quantized formats
        that cannot share one matrix (llama.cpp's Q4_K_M: Q4_K Q and K, a Q6_K V in some layers), so
        each keeps its blocks instead of becoming fp32. The decode routes run such a layer's q, k
        and v as three kernel calls (models/blocks.qkv_linear, the decoder stack's split field)."""
        if not self.fused:
            return self
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        old = self._modules.pop("qkv_proj")
        ws = old.weight.split([H * D, Hkv * D, Hkv * D], dim=0)
        bs = old.bias.split([H * D, Hkv * D, Hkv * D], dim=0) if old.bias is not None else (None,) * 3
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), ws, bs):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
            lin.weight = nn.Parameter(w.detach().clone(), requires_grad=old.weight.requires_grad)
            if b is not None:
                lin.bias = nn.Parameter(b.detach().clone(), requires_grad=old.bias.requires_grad)
            setattr(self, name, lin)
        self.fused = False
        return self

    def projection_weights(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(W_q (H*D, C), W_k (Hkv*D, kdim), W_v (Hkv*D, vdim), W_o (C, H*D)), as views."""
        if self.fused:
            H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
            wq, wk, wv = self.qkv_proj.weight.split([H * D, Hkv * D, Hkv * D], dim=0)
        else:
            wq, wk, wv = self.q_proj.weight, self.k_proj.weight, self.v_proj.weight
        return wq, wk, wv, self.out_proj.weight

    def projection_biases(self) -> tuple[Tensor | None, ...]:
        if not self.bias:
            return None, None, None, self.out_proj.bias
        if self.fused:
            H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
            bq, bk, bv = self.qkv_proj.bias.split([H * D, Hkv * D, Hkv * D], dim=0)
        else:
            bq, bk, bv = self.q_proj.bias, self.k_proj.bias, self.v_proj.bias
        return bq, bk, bv, self.out_proj.bias

    def load_projections(self, w_q, w_k, w_v, w_o, b_q=None, b_k=None, b_v=None, b_o=None) -> "MultiHeadAttention":
        """Copy four textbook projections (tensors in nn.Linear's (out, in) layout, or
        nn.Linear modules, whose biases are taken too) into this layer."""
        return layer_weights.load_projections(self, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, backend: str = "auto") -> "MultiHeadAttention":
        """Exact copy of an `nn.MultiheadAttention`'s weights. The new layer is batch-first
        and uses headwise mask conventions (bool attn_mask True = may attend)."""
        return layer_weights.from_torch(cls, mha, backend)

    def to_torch(self) -> nn.MultiheadAttention:
        """An `nn.MultiheadAttention(batch_first=True)` with these exact weights (MHA only)."""
        return layer_weights.to_torch(self)

    # ------------------------------------------------------------------ pruning
    def prune_heads(self, heads: Iterable[int]) -> "MultiHeadAttention":
        """Remove query heads for real: Q rows and O columns go; a KV head goes when its
        whole group does. `heads` are original head indices (see `head_ids`); ones
        already pruned are ignored. Groups left uneven are served through `kv_map`."""
        return layer_weights.prune_heads(self, heads)

    def extra_repr(self) -> str:
        kind = "MHA" if self.num_kv_heads == self.num_heads else ("MQA" if self.num_kv_heads == 1 else "GQA")
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, {kind}, backend={self.backend!r}"
            + (", uneven groups" if self.kv_map is not None else "")
            + "".join(f", {name}={value}" for name, value in self.attend_settings().items())
        )


def _head_multiplier(head_mask: Tensor, B: int, H: int) -> Tensor:
    if head_mask.shape == (H,):
        return head_mask.view(1, H, 1, 1)
    if head_mask.shape == (B, H):
        return head_mask.view(B, H, 1, 1)
    raise ValueError(f"head_mask must be (H,) = ({H},) or (B, H) = ({B}, {H}), got {tuple(head_mask.shape)}")
