"""Heads grouped by the kind of layer they sit in: local (a sliding window) or global.

Gemma 3 puts one global layer after every five local ones whose queries see only the last 512
keys (Gemma Team 2025, arXiv:2503.19786); Gemma 2 alternates local and global; Mistral v0.1 is
windowed throughout. A local head cannot reach past its window, so long-range and induction
roles over longer spans can only live in the global layers: the report compares the roles each
kind of layer carries.

    windows(model)            [W or None per attention layer]: each layer's own `window`, what
                              its attention honours (model.config.windows for headwise decoders)
    by_layer_type(result)     per type: its layers, heads, the share of heads carrying each role,
                              the mean role scores and the mean importance
    summary_line(groups)      the text summary's line

A type is "global" (no window) or "local" (a window; "local W" when layers differ in W). Rows
shorter than a window (--seq-len below W) leave its layers as unrestricted as the global ones.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from .hooks import attention_layers


def windows(model: nn.Module) -> list[int | None]:
    return [m.window for m in attention_layers(model)]


def type_names(wins: Sequence[int | None]) -> list[str]:
    """Each layer's type: "global", "local", or "local W" when the local layers' windows differ."""
    distinct = {w for w in wins if w is not None}
    return ["global" if w is None else "local" if len(distinct) == 1 else f"local {w}" for w in wins]


def by_layer_type(result: dict) -> list[dict]:
    """Roles and importance per layer type, from analyze()'s result (model.windows, roles,
    importance). Local types come first (by window), then global; JSON-able."""
    wins = result["model"]["windows"]
    names = type_names(wins)
    # the longest rows the roles saw: decoder rows of seq_len (encoders: sentences, short)
    rows = result["settings"]["seq_len"] if result["model"]["causal"] else None
    heads = result["roles"]["heads"]  # L lists of {"labels", "scores", ...}
    importance = (result.get("importance") or {}).get("normalized")
    groups = []
    order = sorted(set(names), key=lambda n: (n == "global", n))
    for name in order:
        layers = [l for l, n in enumerate(names) if n == name]
        infos = [info for l in layers for info in heads[l]]
        n = len(infos)
        counts: dict[str, int] = {}
        for info in infos:
            for role in {"offset" if lab.startswith("offset") else lab for lab in info["labels"]}:
                counts[role] = counts.get(role, 0) + 1
        roles = list(infos[0]["scores"]) if infos else []
        g = {
            "type": name,
            "window": wins[layers[0]],
            "layers": layers,
            "heads": n,
            "labelled": sum(1 for info in infos if info["labels"]),
            "role_counts": {r: counts.get(r, 0) for r in roles},
            "role_share": {r: round(counts.get(r, 0) / max(n, 1), 4) for r in roles},
            "mean_scores": {r: round(sum(info["scores"][r] for info in infos) / max(n, 1), 4) for r in roles},
        }
        if g["window"] is not None and rows is not None:
            g["window_binds"] = rows > g["window"]  # False: every row fit the window, nothing was cut
        if importance is not None:
            vals = [x for l in layers for x in importance[l]]
            g["mean_importance"] = round(sum(vals) / max(len(vals), 1), 5)
        groups.append(g)
    return groups


def windowed(groups: list[dict]) -> bool:
    """Some layer has a window (worth a chart and a summary line)."""
    return any(g["window"] is not None for g in groups)


def summary_line(groups: list[dict]) -> str:
    """roles by layer type: local (window 512; 15 layers, 60 heads): sink 45%, ...; global (...): ..."""
    parts = []
    for g in groups:
        where = f"window {g['window']}; " if g["window"] is not None else ""
        shares = sorted(((s, r) for r, s in g["role_share"].items() if s > 0), reverse=True)
        roles = ", ".join(f"{r} {s:.0%}" for s, r in shares) or "no labels"
        imp = f"; importance {g['mean_importance']:.2f}" if "mean_importance" in g else ""
        if g.get("window_binds") is False:
            where += "rows fit the window, so it cut nothing (--seq-len > W to see it); "
        parts.append(f"{g['type']} ({where}{_n(len(g['layers']), 'layer')}, {_n(g['heads'], 'head')}{imp}): {roles}")
    return "roles by layer type: " + "; ".join(parts)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def fig_roles_by_type(result: dict, path) -> None:
    """Two panels: the share of heads carrying each role, and the mean role score, one bar per
    layer type in each role's group."""
    from .report_style import pyplot

    plt = pyplot()
    groups = result["layer_types"]
    roles = list(groups[0]["role_share"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), dpi=80)
    width = 0.8 / len(groups)
    colors = {"global": "#d62728"}
    for ax, key, label in (
        (axes[0], "role_share", "share of the type's heads with the label"),
        (axes[1], "mean_scores", "mean role score"),
    ):
        for i, g in enumerate(groups):
            xs = [r + (i - (len(groups) - 1) / 2) * width for r in range(len(roles))]
            name = f"{g['type']} ({_n(len(g['layers']), 'layer')}, {_n(g['heads'], 'head')})"
            ax.bar(xs, [g[key][r] for r in roles], width, label=name, color=colors.get(g["type"], f"C{i}"))
        ax.set_xticks(range(len(roles)), [r.replace("_", " ") for r in roles], fontsize=8)
        ax.set_ylim(0, 1.3)  # room above the bars for the legend
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper center", ncol=len(groups), frameon=False)
    wins = sorted({g["window"] for g in groups if g["window"] is not None})
    fig.suptitle(
        f"{result['model']['name']}: roles by layer type (local = sliding window of {', '.join(map(str, wins))} keys)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


FIGURES = {
    "roles_by_layer_type.png": (fig_roles_by_type, lambda r: bool(r.get("layer_types")) and windowed(r["layer_types"]))
}
