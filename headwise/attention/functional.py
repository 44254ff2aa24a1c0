"""`attend()`: the one functional entry point (`attend_kv()` for K/V a paged cache describes),
and `explain()`: why it chose a backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .backends import backends, get_backend
from .backends.registry import registry_version
from .backends.paged import paged_reference
from .backends.paged_spec import paged_spec
from .kv import LayerKV
from .masks import tile_masks
from .spec import AttentionSpec, make_spec, soft_cap


_PLAIN: dict[tuple, tuple] = {}  # plain requests' (backend fn, spec), see attend


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    window: int | tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    need_weights: bool = False,
    return_lse: bool = False,
    softcap: float | None = None,
):
    """Scaled dot-product attention over heads, with GQA/MQA and every mask kind.

    Args:
        q: (B, H, T, D) queries. k: (B, Hkv, S, D), v: (B, Hkv, S, Dv); H % Hkv == 0.
            Query head h reads key/value head h // (H // Hkv), as in Llama's GQA.
        attn_mask: broadcastable to (B, H, T, S), each dim 1 or exact.
            **bool: True = may attend** (as in `F.scaled_dot_product_attention`;
            the opposite of `nn.MultiheadAttention`, where True = masked out).
            float: added to the scaled scores (use -inf to block).
        key_padding_mask: (B, S) bool, **True = padded key, ignored** (as in
            `nn.MultiheadAttention`).
        is_causal: query i may attend keys j <= S - T + i (bottom-right aligned:
            the T queries are the *last* T positions, right for decoding against
            a cache and for chunked prefill).
        window: sliding window. int W: each query sees the W keys ending at its
            own position (and W-1 ahead too when not causal); (left, right): keys
            at positions [p - left, p + right].
        alibi_slopes: (H,) or (B, H); adds -slope * |p - j| to the scores.
        scale: defaults to 1/sqrt(D).
        softcap: c > 0 caps the scaled scores at c * tanh(s / c) before masks and
            ALiBi (Gemma 2's attn_logit_softcapping, as Hugging Face applies it).
        dropout_p: dropout on the attention weights (pass 0.0 at inference).
        backend: "auto" or a name from `headwise.attention.backends()`.
        need_weights: also return the (B, H, T, S) weights (math backend).
        return_lse: also return the fp32 (B, H, T) log-sum-exp of each row.

    Returns:
        The output (B, H, T, Dv); or, when need_weights or return_lse is set, an
        `AttentionOutput(out, lse, weights)` named tuple. Rows with no visible key
        give zeros (LSE -inf), never NaN.
    """
    plain = (
        attn_mask is None
        and key_padding_mask is None
        and alibi_slopes is None
        and not dropout_p
        and not need_weights
        and not return_lse
    )
    if plain:
        # A request with no mask tensor, bias, dropout, weights or LSE (a decode step's) is decided by
        # shapes, dtypes, devices and its scalars (causal, window, scale, softcap) alone: its spec and
        # backend are memoized on those, so the ~30
        # attention calls of a decode step consult the registry once (~10 us a call saved).
        key = (
            q.shape,
            k.shape,
            v.shape,
            q.dtype,
            k.dtype,
            v.dtype,
            q.device,
            k.device,
            v.device,
            is_causal,
            window if type(window) is not list else tuple(window),  # an int or a pair: hashable
            scale,
            softcap,
            backend,
            registry_version(),
            q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1,  # what our kernels need of the layout
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),  # a backward
            torch.compiler.is_compiling(),  # traced code cannot call it
        )
        hit = _PLAIN.get(key)
        if hit is not None:
            return hit[0](q, k, v, hit[1]).out
    spec = make_spec(
        q,
        k,
        v,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        window=window,
        alibi_slopes=alibi_slopes,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        return_lse=return_lse,
        softcap=softcap,
    )
    fn = _select(q, k, v, spec, backend)
    if plain:
        if len(_PLAIN) >= 256:
            _PLAIN.clear()
        _PLAIN[key] = (fn, spec)
    res = fn(q, k, v, spec)
    if need_weights or return_lse:
        return res
    return res.out


@dataclass
class Explanation:
    """The backend `auto` picks for a request and why (`why`: the rule that puts it first and what
    was measured), why each other one was passed over, and how the chosen one honours the
    request's sliding window and soft-cap (`handled`)."""

    chosen: str | None
    rejected: dict[str, list[str]] = field(default_factory=dict)
    handled: list[str] = field(default_factory=list)
    why: str = ""

    def __str__(self) -> str:
        lines = [f"chosen: {self.chosen}" + (f" ({self.why})" if self.why else "")]
        lines += [f"  {name}: {'; '.join(why)}" for name, why in self.rejected.items()]
        lines += [f"handled: {how}" for how in self.handled]
        return "\n".join(lines)


# How each backend applies a window: what explain() reports beside the choice.
_WINDOW_HOW = {
    "math": "masked in the full score matrix",
    "chunked": "masked per key tile; tiles wholly outside every query's window are skipped",
    "sdpa": "passed to PyTorch's op as an explicit mask",
    "flash": "flash-attn's window_size",
    "paged": "masked by key position; blocks wholly outside the window are not read",
    "decode": "in the kernel: each query row reads only the keys of its window",
    "prefill": "in the kernel: each query row's keys start at its window's left edge; blocks before it skipped",
}


def _handled(spec: AttentionSpec, chosen: str | None) -> list[str]:
    if chosen is None:
        return []
    notes = []
    if spec.window is not None:
        left, right = spec.window
        how = _WINDOW_HOW.get(chosen, "by the backend")
        notes.append(f"window: query at position p sees keys [p - {left}, p + {right}]; {chosen}: {how}")
    if spec.softcap is not None:
        notes.append(f"softcap: scores become {spec.softcap:g} * tanh(s / {spec.softcap:g}) before masks, by {chosen}")
    return notes


def explain(q: Tensor, k, v: Tensor | None = None, **kwargs) -> Explanation:
    """Which backend `attend(q, k, v, **kwargs)` would use, and every rejection with reasons.
    k may be a cache's description of its K/V (`kv.LayerKV`, e.g. `read.kv` of a paged
    read), v then omitted: the answer for `attend_kv(q, k, **kwargs)`."""
    backend = kwargs.pop("backend", "auto")
    if isinstance(k, LayerKV):
        spec = paged_spec(q, k, **kwargs)
    else:
        spec = make_spec(q, k, v, **kwargs)
    exp = _explain(q, k, v, spec, backend)
    if kwargs.get("window") is not None and spec.window is None:
        exp.handled.insert(0, f"window: {kwargs['window']} covers every key of every query here, nothing to mask")
    return exp


def _explain(q, k, v, spec: AttentionSpec, backend: str) -> Explanation:
    names = backends() if backend == "auto" else [get_backend(backend).name]
    exp = Explanation(chosen=None)
    for name in names:
        reasons = _reasons(get_backend(name), q, k, v, spec, named=backend != "auto")
        if not reasons and exp.chosen is None:
            exp.chosen, exp.why = name, get_backend(name).why
        elif reasons:
            exp.rejected[name] = reasons
    exp.handled = _handled(spec, exp.chosen)
    return exp


def _reasons(b, q, k, v, spec: AttentionSpec, named: bool = False) -> list[str]:
    """Why backend b cannot serve the request; a backend never sees K/V in a form it does not read.
    The math reference takes a cache's blocks when named: `attend_kv` gathers them into tensors."""
    reads = "blocks" if isinstance(k, LayerKV) else "tensors"
    if b.reads != reads:
        if b.reads == "blocks":
            return ["reads K/V in a paged cache's blocks (through a cache read), not k/v tensors"]
        if b.name == "math":
            return (
                []
                if named
                else [
                    "needs k/v tensors; backend='math' gathers a paged cache's blocks into "
                    "tensors first (the reference, for weights and dropout)"
                ]
            )
        return ["needs k/v tensors; these K/V live in a paged cache's blocks"]
    return b.check(q, k, v, spec)


def _select(q, k, v, spec: AttentionSpec, backend: str):
    if backend != "auto":
        b = get_backend(backend)
        reasons = _reasons(b, q, k, v, spec)
        if reasons:
            raise ValueError(f"backend {backend!r} cannot serve this request: {'; '.join(reasons)}")
        return b.fn
    for name in backends():
        b = get_backend(name)
        if not _reasons(b, q, k, v, spec):
            return b.fn
    raise ValueError("no attention backend can serve this request:\n" + str(_explain(q, k, v, spec, "auto")))


def attend_kv(
    q: Tensor,
    kv: LayerKV,
    *,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    kv_map: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    need_weights: bool = False,
    return_lse: bool = False,
    window=None,
    softcap: float | None = None,
):
    """`attend` over K/V that a cache describes instead of holding as tensors (a paged cache's
    step: `kv.LayerKV`), through the registry's backends that read blocks (`paged`).

    backend="math" gathers the sequences into one tensor and runs the reference (weights,
    dropout); "auto", "paged" and every other registered name read the blocks in place
    (a layer's choice of a tensor backend does not apply to blocks). Masks are over the
    padded key axis S = the longest sequence after this step; kv_map (H,) maps each query
    head to its KV head (uneven groups after pruning). Returns as `attend`.
    """
    spec = paged_spec(
        q,
        kv,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        kv_map=kv_map,
        alibi_slopes=alibi_slopes,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        return_lse=return_lse,
        window=window,
        softcap=softcap,
    )
    name = get_backend(backend).name if backend != "auto" else "auto"  # an unknown name lists the valid ones
    if name == "math":
        res = paged_reference(q, kv, spec)
    else:
        named = name != "auto" and get_backend(name).reads == "blocks"
        res = _select(q, kv, None, spec, name if named else "auto")(q, kv, None, spec)
    if need_weights or return_lse:
        return res
    return res.out


def weights_from_lse(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    *,
    heads: Sequence[int] | Tensor | None = None,
    queries: Sequence[int] | Tensor | slice | None = None,
    **mask_kwargs,
) -> Tensor:
    """Rebuild exact attention rows from a fused backend's LSE: w_ij = exp(s_ij - lse_i).

    Pass the same mask arguments (attn_mask, key_padding_mask, is_causal, window,
    alibi_slopes, scale, softcap) as the `attend` call that produced `lse`. Only the chosen
    heads and query rows are computed: (B, len(heads), len(queries), S) in fp32.
    Rows are pre-dropout weights.
    """
    B, H, T, D = q.shape
    spec = make_spec(q, k, k, **mask_kwargs)
    if lse.shape != (B, H, T):
        raise ValueError(f"lse has shape {tuple(lse.shape)} but q implies (B, H, T) = ({B}, {H}, {T})")
    heads = torch.arange(H) if heads is None else torch.as_tensor(heads, dtype=torch.long).reshape(-1)
    if queries is None:
        queries = slice(None)
    heads = heads.to(q.device)
    if ((heads < 0) | (heads >= H)).any():
        raise ValueError(f"heads must be in [0, {H}), got {heads.tolist()}")
    qs = q.index_select(1, heads)[:, :, queries].float()  # (B, h, t, D)
    ks = k.index_select(1, heads // spec.G).float()  # (B, h, S, D): chosen heads only
    s = soft_cap((qs @ ks.transpose(-2, -1)) * spec.scale, spec.softcap)  # (B, h, t, S)
    allowed, bias = tile_masks(spec, 0, T, 0, spec.S, q.device)
    if bias is not None:
        s = s + _rows(bias, heads, queries)
    if allowed is not None:
        s = s.masked_fill(~_rows(allowed, heads, queries), float("-inf"))
    lse_rows = lse.float().index_select(1, heads)[:, :, queries]
    w = torch.exp(s - lse_rows.masked_fill(torch.isneginf(lse_rows), 0.0)[..., None])
    return w.masked_fill(torch.isneginf(lse_rows)[..., None], 0.0)


def _rows(m: Tensor, heads: Tensor, queries) -> Tensor:
    """Select heads (if the mask has a head dim) and query rows (if it has a query dim)."""
    if m.dim() == 2:
        m = m[None, None]
    if m.shape[1] != 1:
        m = m.index_select(1, heads)
    if m.shape[2] != 1:
        m = m[:, :, queries]
    return m
