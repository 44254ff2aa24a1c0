"""Direct logit attribution: each head's share of the answer's logit (pre-norm decoders).

A pre-norm decoder's last residual stream is a sum of what every part wrote into it:

    x_L = embed (+ pos_embed) + sum_l [ sum_h result_{l,h} + b_O,l + mlp_l ]

and the logit of token a is W_U[a] . norm(x_L) (+ an output bias). Gemma 2/3 scale the
embeddings by sqrt(C) and norm each branch's output before its add (post-norms): x + post(a).
With post's scale frozen at the branch's own 1 / rms(a), post is linear too, so a head's term is
result_h * w_post / rms(a) and the terms still sum to x_L. The final norm is not
linear in x_L; freezing its scale at the run's own value (1 / rms(x_L) for RMSNorm,
1 / std(x_L) with mean-centering for LayerNorm), as TransformerLens does, makes it linear,
so every term t gets the share W_U[a] . (scale * w * center(t)), LayerNorm's bias is one
more term, and the shares sum exactly to the logit (Elhage et al. 2021, "A mathematical
framework for transformer circuits"). With a direction W_U[a] - W_U[b] the shares sum to
the logit difference. A share is the *direct* effect only: what a head writes that later
layers read and transform is credited to those layers (activation patching measures the
total effect).

The unembedding is lm_head.weight in fp32 (a quantized head is dequantized); a quantized
head's forward also rounds its input to int8 per block (models/linear.py), so its logit
can differ from the shares' sum by that rounding: both are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .capture import is_causal
from .hooks import Capture, attached, head_results


@dataclass
class Attribution:
    """Shares of one logit (or logit difference) at the last position. heads: per layer (H_l,);
    terms: embed, pos_embed (learned positions), attn_bias / mlp (per layer), norm_bias,
    unembed_bias, where the model has them. total = their sum; logit = the model's own value."""

    heads: list[Tensor]
    terms: dict[str, float | list[float]] = field(default_factory=dict)
    logit: float = 0.0

    @property
    def total(self) -> float:
        s = sum(float(h.double().sum()) for h in self.heads)
        for v in self.terms.values():
            s += sum(v) if isinstance(v, list) else v
        return s

    def to_json(self) -> dict:
        r = lambda x: round(float(x), 5)  # noqa: E731
        return {
            "heads": [[r(x) for x in t] for t in self.heads],
            "terms": {k: [r(x) for x in v] if isinstance(v, list) else r(v) for k, v in self.terms.items()},
            "total": r(self.total),
            "logit": r(self.logit),
        }


def _check(model: nn.Module) -> None:
    if not is_causal(model) or getattr(model.config, "norm_placement", "pre") != "pre":
        raise ValueError(
            f"direct logit attribution needs a pre-norm decoder (Llama, GPT-2); {model.config.arch} ends at "
            f"hidden states with a LayerNorm after every block, so no sum of terms reaches a logit: "
            f"use activation patching (patch_heads, cosine metric) instead"
        )
    for name in ("embed", "layers", "norm", "lm_head"):
        if not hasattr(model, name):
            raise ValueError(f"{type(model).__name__} has no .{name}; DLA reads embed, layers, norm and lm_head")


@torch.no_grad()
def decompose(model: nn.Module, ids: Tensor) -> dict:
    """One run of ids (T,): the last position's residual terms, each (C,) or (H, C), the final
    residual x_L (C,) and the model's logits (V,). Checks that the terms sum to x_L."""
    _check(model)
    ids = ids.reshape(1, -1).to(next(model.parameters()).device)
    kept: dict[str, Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            kept[name] = out[0, -1].float()  # (C,) the last position

        return hook

    handles = [model.embed.register_forward_hook(keep("embed"))]
    if isinstance(getattr(model, "pos_embed", None), nn.Module):
        handles.append(model.pos_embed.register_forward_hook(keep("pos_embed")))
    for i, block in enumerate(model.layers):
        handles.append(block.attn.register_forward_hook(keep(f"attn.{i}")))
        post = getattr(block, "mlp_post_norm", None) if getattr(block, "post_norms", False) else None
        handles.append((post or block.mlp).register_forward_hook(keep(f"mlp.{i}")))  # what the add receives
    handles.append(model.norm.register_forward_pre_hook(lambda m, args: kept.__setitem__("x", args[0][0, -1].float())))
    cap = Capture(("z",))
    try:
        with attached(model, capture=cap):
            logits = model(ids)[0, -1]  # (V,)
    finally:
        for h in handles:
            h.remove()
    L = len(model.layers)
    scale = getattr(model.config, "embed_scale", None)  # Gemma: sqrt(C), a tensor of the stream's dtype
    terms = {"embed": kept["embed"] if scale is None else kept["embed"] * torch.tensor(scale).to(kept["embed"])}
    if "pos_embed" in kept:
        terms["pos_embed"] = kept["pos_embed"]
    for i, block in enumerate(model.layers):
        post = _frozen(block, kept[f"attn.{i}"])  # x + post(a): linear once its scale is frozen
        terms[f"heads.{i}"] = post(head_results(block.attn, cap.z[i][:, :, -1:])[0, 0].float())  # (H, C)
        bias = block.attn.out_proj.bias
        if bias is not None:
            terms[f"attn_bias.{i}"] = post(bias.float())
        if hasattr(block.attn.out_proj, "fmt"):  # a QuantizedLinear rounds z to int8 blocks first
            rest = post(kept[f"attn.{i}"]) - terms[f"heads.{i}"].sum(0)
            terms[f"out_proj_rounding.{i}"] = rest - (terms[f"attn_bias.{i}"] if bias is not None else 0)
        terms[f"mlp.{i}"] = kept[f"mlp.{i}"]
    x = kept["x"]
    total = sum(t.sum(0) if t.dim() == 2 else t for t in terms.values())
    err = float((total - x).abs().max())
    if err > 1e-4 * max(1.0, float(x.abs().max())):
        raise ValueError(
            f"{type(model).__name__}'s last residual is not embeddings + heads + biases + MLPs over {L} "
            f"layers (off by {err:.3g}); direct logit attribution does not know this block layout"
        )
    return {"terms": terms, "x": x, "logits": logits.float()}


def _frozen(block: nn.Module, a: Tensor):
    """t -> what the residual receives of t, a part of the attention output a (C,): t itself, or
    with post-norms (Gemma 2/3) t * w / rms(a), the RMSNorm's scale frozen at a's own."""
    if not getattr(block, "post_norms", False):
        return lambda t: t
    norm = block.attn_post_norm
    if isinstance(norm, nn.LayerNorm):
        raise ValueError("direct logit attribution supports RMSNorm post-norms (Gemma) only, not LayerNorm")
    f = norm.weight.float() * torch.rsqrt(a.pow(2).mean() + norm.eps)  # (C,)
    return lambda t: t * f


@torch.no_grad()
def attribute(model: nn.Module, parts: dict, direction: Tensor, bias: float = 0.0, logit: float = 0.0) -> Attribution:
    """Shares of direction . norm(x_L) (+ bias) with the final norm's scale frozen at x_L."""
    norm, x = model.norm, parts["x"]
    w = norm.weight.float()
    if isinstance(norm, nn.LayerNorm):  # (t - mean(t)) / std(x_L) * w + b
        scale = torch.rsqrt(x.var(unbiased=False) + norm.eps)
        center = lambda t: t - t.mean(-1, keepdim=True)  # noqa: E731
    else:  # RMSNorm: t / rms(x_L) * w
        scale = torch.rsqrt(x.pow(2).mean() + norm.eps)
        center = lambda t: t  # noqa: E731
    u = direction.float() * w * scale  # (C,): what one unit of residual adds to the logit
    out = Attribution([], {}, logit)
    layers: dict[str, list[float]] = {}
    for name, t in parts["terms"].items():
        share = center(t) @ u  # () or (H,)
        kind, _, i = name.partition(".")
        if kind == "heads":
            out.heads.append(share)
        elif i:
            layers.setdefault(kind, []).append(float(share))
        else:
            out.terms[kind] = float(share)
    out.terms |= layers
    if isinstance(norm, nn.LayerNorm) and norm.bias is not None:
        out.terms["norm_bias"] = float(norm.bias.float() @ direction.float())
    if bias:
        out.terms["unembed_bias"] = bias
    return out


@torch.no_grad()
def unembedding(model: nn.Module, tokens: list[int]) -> tuple[Tensor, Tensor]:
    """The unembedding rows of `tokens` (k, C) fp32 and the output bias there (k,) (0 without)."""
    head = model.lm_head
    w = head.weight  # a dequantized copy for QuantizedLinear
    idx = torch.as_tensor(tokens, device=w.device)
    b = getattr(head, "bias", None)
    bias = b.float().index_select(0, idx) if b is not None else torch.zeros(len(tokens))
    return w.index_select(0, idx).float(), bias


def direct_logit_attribution(model: nn.Module, ids: Tensor, answer: int, wrong: int | None = None) -> Attribution:
    """Shares of logit[answer] (- logit[wrong]) at the last position of ids (T,) (module docstring)."""
    parts = decompose(model, ids)
    toks = [answer] if wrong is None else [answer, wrong]
    rows, bias = unembedding(model, toks)
    if wrong is None:
        return attribute(model, parts, rows[0], float(bias[0]), float(parts["logits"][answer]))
    lg = parts["logits"]
    return attribute(model, parts, rows[0] - rows[1], float(bias[0] - bias[1]), float(lg[answer] - lg[wrong]))


def pair_attribution(model: nn.Module, ids: Tensor, answer: int, wrong: int) -> dict[str, Attribution]:
    """One run, two views: {"diff": shares of logit[answer] - logit[wrong], "answer": of logit[answer]}."""
    parts = decompose(model, ids)
    rows, bias = unembedding(model, [answer, wrong])
    lg = parts["logits"]
    return {
        "diff": attribute(model, parts, rows[0] - rows[1], float(bias[0] - bias[1]), float(lg[answer] - lg[wrong])),
        "answer": attribute(model, parts, rows[0], float(bias[0]), float(lg[answer])),
    }
