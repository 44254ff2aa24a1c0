"""Named capture points inside every `MultiHeadAttention` of a model, for one run.

    with hooks.attached(model, capture=Capture(points=("pattern", "z"))) as run:
        model(input_ids)
    run.capture.pattern[3]          # layer 3: (B, H, T, S)

A `MultiHeadAttention` has one `hook` slot, None in normal runs (one `if` per
forward, nothing else). `attached` fills it on every attention layer for the
duration of a `with` block and empties it on the way out, whatever happens
inside (TransformerLens: hooks are removed when the run ends).

The same slot carries interventions on the per-head outputs z (B, H, T, D), the
tensor right before the output projection, where a head is a slice:
  - `mask`: a multiplier per head, (H,) or (B, H); 0 ablates a head, and with
    requires_grad its gradient is the head importance of Michel et al. 2019.
  - `replace`: the value an ablated head takes instead of zero, (H, D) per layer
    (mean ablation: a head's average output over a corpus), or (H, T, D) per position
    (activation patching: another run's outputs, patching.py).
z' = z * m + (1 - m) * replace, so m = 1 leaves the model exactly as it was.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from ..attention import MultiHeadAttention

# What a capture can record, per attention layer (shapes as stored):
POINTS = {
    "q": "(B, H, T, D) queries after RoPE",
    "k": "(B, Hkv, S, D) keys after RoPE (Hkv = H after uneven GQA pruning)",
    "v": "(B, Hkv, S, D) values",
    "pattern": "(B, h, T, S) fp32 attention weights of the requested heads h",
    "z": "(B, H, T, D) per-head outputs, after any intervention",
    "result": "(B, T, h, C) each requested head's contribution to the residual: z_h @ W_O[:, h].T",
}


def attention_layers(model: nn.Module) -> list[MultiHeadAttention]:
    """The model's attention layers in forward order (module registration order)."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no headwise MultiHeadAttention layer to analyse")
    return layers


def heads_per_layer(model: nn.Module) -> list[int]:
    return [m.num_heads for m in attention_layers(model)]


class Capture:
    """What to record during a run: `points` (keys of POINTS) for `layers` (None = all) and,
    for "pattern" / "result", only the query heads `heads` (None = all; a list applies to
    every layer, a dict {layer: heads} per layer). Records of the last forward pass, per
    layer index: `cap.pattern[l]`, `cap.z[l]`, ... (`cap[point]` works too)."""

    def __init__(
        self,
        points: Sequence[str] = ("pattern",),
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | dict[int, Sequence[int]] | None = None,
        detach: bool = True,
    ):
        unknown = [p for p in points if p not in POINTS]
        if unknown:
            raise ValueError(f"unknown capture points {unknown}; known: {', '.join(POINTS)}")
        self.points = tuple(points)
        self.layers = None if layers is None else set(int(i) for i in layers)
        self.heads = heads
        self.detach = detach
        for p in POINTS:
            setattr(self, p, {})

    def __getitem__(self, point: str) -> dict[int, Tensor]:
        if point not in POINTS:
            raise KeyError(f"unknown capture point {point!r}; known: {', '.join(POINTS)}")
        return getattr(self, point)

    def wants(self, index: int) -> bool:
        return self.layers is None or index in self.layers

    def heads_of(self, index: int, num_heads: int) -> list[int]:
        heads = self.heads.get(index) if isinstance(self.heads, dict) else self.heads
        heads = list(range(num_heads)) if heads is None else [int(h) for h in heads]
        bad = [h for h in heads if not 0 <= h < num_heads]
        if bad:
            raise ValueError(f"layer {index} has {num_heads} heads; heads {bad} are out of range")
        return heads

    def _keep(self, point: str, index: int, t: Tensor) -> None:
        getattr(self, point)[index] = t.detach() if self.detach else t


class _LayerHook:
    """What sits in `MultiHeadAttention.hook` for one layer during `attached`."""

    def __init__(self, index: int, run: "Run"):
        self.index, self.run = index, run
        cap = run.capture
        self.capturing = cap is not None and cap.wants(index)
        self.wants_lse = self.capturing and "pattern" in cap.points

    def __call__(
        self,
        layer: MultiHeadAttention,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        out: Tensor,
        lse: Tensor | None,
        weights: Tensor | None,
        kwargs: dict,
    ) -> Tensor:
        i, run = self.index, self.run
        mask = run.mask[i] if run.mask is not None else None
        if mask is not None:
            B, H = out.shape[:2]
            m = _multiplier(mask, B, H, i).to(out.dtype)  # (B|1, H, 1, 1)
            replace = run.replace[i] if run.replace is not None else None
            if replace is None:
                out = out * m
            else:
                r = replace.to(out.dtype)
                if r.dim() == 3 and r.shape[1] != out.shape[2]:
                    raise ValueError(f"replace[{i}] has {r.shape[1]} positions but this run has T={out.shape[2]}")
                out = out * m + (1 - m) * (r[None, :, None, :] if r.dim() == 2 else r[None])  # (1, H, 1|T, D)
        if self.capturing:
            self._capture(layer, q, k, v, out, lse, weights, kwargs)
        return out

    def _capture(self, layer, q, k, v, out, lse, weights, kwargs) -> None:
        cap, i = self.run.capture, self.index
        if k is None and any(p in cap.points for p in ("k", "v", "pattern")):
            raise ValueError(
                "capturing k, v or pattern needs a forward without cache= (the cache holds "
                "the earlier keys); run the whole sequence at once"
            )
        heads = cap.heads_of(i, layer.num_heads)
        for name, t in (("q", q), ("k", k), ("v", v), ("z", out)):
            if name in cap.points:
                cap._keep(name, i, t)
        if "pattern" in cap.points:
            if weights is not None:  # the caller asked the math path
                pattern = weights[:, heads].float()
            else:  # exact rows from the fused LSE
                from ..attention import weights_from_lse

                # every keyword that shaped the scores: a windowed layer's weights are zero outside
                # its window (Mistral, Gemma's local layers), Gemma's scale and soft-cap change them all
                names = ("attn_mask", "key_padding_mask", "is_causal", "alibi_slopes", "window", "softcap", "scale")
                masks = {n: kwargs[n] for n in names if n in kwargs}
                kv_map = layer.kv_map
                ks = k if kv_map is None else k.index_select(1, kv_map)  # uneven groups after pruning
                pattern = weights_from_lse(q, ks, lse, heads=heads, **masks)
            cap._keep("pattern", i, pattern)  # (B, h, T, S)
        if "result" in cap.points:
            cap._keep("result", i, head_results(layer, out, heads))


def head_results(layer: MultiHeadAttention, z: Tensor, heads: Sequence[int] | None = None) -> Tensor:
    """Each head's additive share of the attention output: z_h @ W_O[:, h].T -> (B, T, h, C).
    Summed over all heads, plus the output bias, it is the layer's output."""
    H, D = layer.num_heads, layer.head_dim
    heads = list(range(H)) if heads is None else list(heads)
    w_o = layer.projection_weights()[3].view(layer.d_model, H, D)  # (C, H, D)
    idx = torch.as_tensor(heads, device=z.device)
    return torch.einsum("bhtd,chd->bthc", z.index_select(1, idx), w_o.index_select(1, idx).to(z.dtype))


def _multiplier(mask: Tensor, B: int, H: int, index: int) -> Tensor:
    if mask.shape == (H,):
        return mask.view(1, H, 1, 1)
    if mask.shape == (B, H):
        return mask.view(B, H, 1, 1)
    raise ValueError(f"mask for layer {index} must be (H,) = ({H},) or (B, H) = ({B}, {H}), got {tuple(mask.shape)}")


def _check_per_layer(name: str, seq, what: str, num_layers: int) -> None:
    """`seq` must hold one Tensor-or-None per attention layer (a str is not a list of layers)."""
    if seq is None:
        return
    if not isinstance(seq, (list, tuple, Tensor)):
        raise TypeError(
            f"{name} must be a list with one entry per attention layer ({num_layers} here), each "
            f"{what} or None; got {type(seq).__name__} {seq!r:.60}"
        )
    if len(seq) != num_layers:
        raise ValueError(f"{name} has {len(seq)} entries but the model has {num_layers} attention layers")
    bad = [(i, type(t).__name__) for i, t in enumerate(seq) if t is not None and not isinstance(t, Tensor)]
    if bad:
        raise TypeError(
            f"{name} entries must be {what} or None; entries {[i for i, _ in bad]} are {sorted({t for _, t in bad})}"
        )


class Run:
    """The state `attached` shares with the layer hooks: capture, per-layer mask and replace."""

    def __init__(self, capture: Capture | None, mask, replace):
        self.capture, self.mask, self.replace = capture, mask, replace


@contextlib.contextmanager
def attached(
    model: nn.Module,
    *,
    capture: Capture | None = None,
    mask: Sequence[Tensor | None] | None = None,
    replace: Sequence[Tensor | None] | None = None,
) -> Iterator[Run]:
    """Install capture points / interventions on every attention layer of `model` for one `with`.

    mask: one entry per attention layer, a (H,) or (B, H) tensor or None (untouched).
    replace: one entry per layer, (H, D), (H, T, D) or None (ablated heads become zero).
    """
    layers = attention_layers(model)
    for name, seq, what in (
        ("mask", mask, "a (H,) or (B, H) multiplier"),
        ("replace", replace, "an (H, D) tensor, e.g. from mean_outputs(model, batches)"),
    ):
        _check_per_layer(name, seq, what, len(layers))
    if replace is not None:
        for i, (r, layer) in enumerate(zip(replace, layers)):
            if r is not None and (
                r.dim() not in (2, 3) or (r.shape[0], r.shape[-1]) != (layer.num_heads, layer.head_dim)
            ):
                raise ValueError(
                    f"replace[{i}] must be (H, D) = ({layer.num_heads}, {layer.head_dim}) or per position "
                    f"(H, T, D), got {tuple(r.shape)}"
                )
    busy = [i for i, layer in enumerate(layers) if layer.hook is not None]
    if busy:
        raise RuntimeError(f"attention layers {busy} already have a hook attached (nested `attached` on one model)")
    run = Run(capture, mask, replace)
    try:
        for i, layer in enumerate(layers):
            layer.hook = _LayerHook(i, run)
        yield run
    finally:
        for layer in layers:
            layer.hook = None
