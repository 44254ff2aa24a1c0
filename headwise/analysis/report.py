"""The report of `headwise analyze`: PNG figures, one self-contained HTML page, all numbers in JSON.

    write(result, out_dir) -> {"json": ..., "html": ..., "figures": [...]}

Figures (matplotlib, Agg backend: no display needed):
  patterns.png          every head's attention pattern for the text, layers x heads
  roles.png             the strongest role label of every head, layers x heads (local / global
                        layers named where the model has windows)
  roles_by_layer_type.png  roles per layer type, local vs global (layer_types.py)
  ablation.png          quality drop vs fraction of heads removed, importance vs random orders
  weights_vs_norms.png  raw weights vs value-weighted norms (Kobayashi et al. 2020)
  importance.png        Michel et al.'s normalized importance, pruned heads crossed out
  patching.png, dla.png activation patching and direct logit attribution (patching_report.py)
  long_context.png      per-head statistics and roles at `--context N` tokens (long_context_report.py)

The HTML page inlines its data, script, style and the figures (as data: URIs), so it
opens from disk with no network: pick a layer, a head and a token and see where it
attends, bertviz-style (Vig 2019), as raw weights or as value-weighted norms.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np

from .report_style import ROLE_COLORS, SHORT, pyplot, strongest_role


def _mosaic(tiles: list[list[np.ndarray]], gap: int = 1) -> np.ndarray:
    """Layers x heads of (T, S) tiles -> one image with NaN gaps (one imshow, fast for 270 heads)."""
    T, S = tiles[0][0].shape
    L, H = len(tiles), max(len(r) for r in tiles)
    img = np.full((L * (T + gap) - gap, H * (S + gap) - gap), np.nan)
    for l, row in enumerate(tiles):
        for h, t in enumerate(row):
            img[l * (T + gap) : l * (T + gap) + T, h * (S + gap) : h * (S + gap) + S] = t
    return img


def fig_patterns(view: dict, path: Path, title: str) -> None:
    plt = pyplot()
    pat = view["pattern"]
    L, H, T = len(pat), max(len(p) for p in pat), len(view["tokens"])
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * H, 1.0 + 0.8 * L), dpi=80)
    img = _mosaic([[np.asarray(p) for p in layer] for layer in pat])
    im = ax.imshow(img, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks([h * (T + 1) + T / 2 - 0.5 for h in range(H)], [str(h) for h in range(H)])
    ax.set_yticks([l * (T + 1) + T / 2 - 0.5 for l in range(L)], [str(l) for l in range(L)])
    ax.set_xlabel("head (each tile: query token rows x key token columns)")
    ax.set_ylabel("layer")
    ax.set_title(f"{title}\n{view['text']!r}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02, label="attention weight")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fig_roles(result: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.colors import to_rgb

    heads = result["roles"]["heads"]
    L, H = len(heads), max(len(r) for r in heads)
    img = np.ones((L, H, 3))
    fig, ax = plt.subplots(figsize=(1.5 + 0.75 * H, 1.2 + 0.34 * L), dpi=80)
    for l, row in enumerate(heads):
        for h, info in enumerate(row):
            best = strongest_role(info, result["roles"]["thresholds"])
            if best:
                role = "offset" if best.startswith("offset") else best
                img[l, h] = to_rgb(ROLE_COLORS[role])
                short = best.replace("offset ", "off") if role == "offset" else SHORT[role]
                more = len(info["labels"]) - 1
                ax.text(
                    h, l, short + (f"+{more}" if more > 0 else ""), ha="center", va="center", fontsize=7, color="white"
                )
    ax.imshow(img, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(H))
    wins = result["model"].get("windows") or [None] * L
    ax.set_yticks(
        range(L), [str(l) if not any(wins) else f"{l} {'global' if w is None else 'local'}" for l, w in enumerate(wins)]
    )
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"{result['model']['name']}: strongest role per head (+n: more labels; blank: none)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS.values()]
    ax.legend(handles, list(ROLE_COLORS), loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fig_ablation(result: dict, path: Path) -> None:
    plt = pyplot()
    ab = result["ablation"]
    keys = [k for k in ab["removable"]]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), dpi=90, squeeze=False)
    styles = {
        "importance": ("C0", "-", 2.2),
        "importance_per_layer": ("C2", "--", 1.6),
        "importance_mean_ablation": ("C1", "-.", 1.6),
    }
    for ax, key in zip(axes[0], keys):
        for name, rows in ab["curves"].items():
            xs = [0.0] + [r["fraction_removed"] for r in rows]
            ys = [0.0] + [r[key] * 100 for r in rows]
            if name.startswith("random"):
                ax.plot(xs, ys, color="0.6", lw=1, label="random order" if name == "random0" else None)
            else:
                c, ls, lw = styles.get(name, ("C3", "-", 1.5))
                ax.plot(xs, ys, color=c, ls=ls, lw=lw, marker="o", ms=3, label=name.replace("_", " "))
        for t in (1, 5):
            ax.axhline(t, color="k", lw=0.6, ls=":")
            ax.text(0.0, t, f" {t}%", va="bottom", fontsize=7)
        ax.set_yscale("symlog", linthresh=1.0)  # linear below 1%, log above
        ax.set_ylim(bottom=0)
        ax.set_xlabel("fraction of heads removed (zeroed; one head kept per layer)")
        ax.set_ylabel(f"quality drop, % ({_drop_label(result, key)})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']['name']}: ablation on held-out text ({ab['metric']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _drop_label(result: dict, key: str) -> str:
    causal = result["model"]["causal"]
    return {
        "drop": "perplexity increase" if causal else "1 - mean cosine to full model",
        "drop_loss": "loss increase",
        "drop_retrieval": "1 - nearest-neighbour agreement",
    }.get(key, key)


def fig_weights_vs_norms(result: dict, path: Path) -> None:
    plt = pyplot()
    hints, view = result["hints"], result["view"]
    tw = np.concatenate([np.asarray(x) for x in hints["top_weight"]])
    ns = np.concatenate([np.asarray(x) for x in hints["top_norm_share"]])
    flagged = np.concatenate([np.asarray(x) for x in hints["flagged"]])
    ratio = [np.asarray(r) for r in hints["ratio"]]
    l, h = min(((l, h) for l, r in enumerate(ratio) for h in range(len(r))), key=lambda lh: ratio[lh[0]][lh[1]])
    tokens = view["tokens"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), dpi=80)
    ax = axes[0]
    ax.scatter(tw[~flagged], ns[~flagged], s=10, color="C0", label="weights roughly tell the truth")
    ax.scatter(
        tw[flagged], ns[flagged], s=14, color="C3", label=f"flagged: norm share < {hints['threshold_ratio']} x weight"
    )
    ax.plot([0, 1], [0, 1], color="k", lw=0.6, ls=":")
    ax.set_xlabel("weight on the most attended token (mean over rows)")
    ax.set_ylabel("its share of sum_j ||a_ij f(x_j)||")
    ax.set_title("every head, over the fit corpus", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    for ax, key, name in (
        (axes[1], "pattern", "attention weights a_ij"),
        (axes[2], "norms", "value-weighted norms ||a_ij f(x_j)||, row-normalized"),
    ):
        m = np.asarray(view[key][l][h])
        ax.imshow(m, cmap="viridis", vmin=0, vmax=max(float(m.max()), 1e-6))
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=7)
        ax.set_title(f"layer {l} head {h}: {name}", fontsize=9)
    fig.suptitle(
        f"{result['model']['name']}: attention weights are hints, not explanations "
        f"(layer {l} head {h}: ratio {ratio[l][h]:.2f})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fig_importance(result: dict, path: Path) -> None:
    plt = pyplot()
    norm = result["importance"]["normalized"]
    L, H = len(norm), max(len(r) for r in norm)
    img = np.full((L, H), np.nan)
    for l, r in enumerate(norm):
        img[l, : len(r)] = r
    fig, ax = plt.subplots(figsize=(1.8 + 0.6 * H, 1.2 + 0.3 * L), dpi=80)
    im = ax.imshow(img, aspect="auto", cmap="magma", interpolation="nearest")
    for l, heads in (result.get("pruning") or {}).get("plan", {}).items():
        for h in heads:
            ax.text(h, int(l), "x", ha="center", va="center", color="cyan", fontsize=8)
    ax.set_xticks(range(H))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    title = "head importance E|dL/dxi_h| (layer-normalized)"
    if result.get("pruning"):
        title += f"; x = pruned ({result['pruning']['fraction']:.0%})"
    ax.set_title(f"{result['model']['name']}: {title}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


FIGURES = {
    "patterns.png": lambda r, p: fig_patterns(r["view"], p, f"{r['model']['name']}: attention patterns"),
    "roles.png": fig_roles,
    "ablation.png": fig_ablation,
    "weights_vs_norms.png": fig_weights_vs_norms,
    "importance.png": fig_importance,
}


def write(result: dict, out: str | Path) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for name, draw in FIGURES.items():
        if name == "ablation.png" and "ablation" not in result:
            continue
        draw(result, out / name)
        figures.append(out / name)
    from . import layer_types, long_context_report, patching_report

    more = layer_types.FIGURES | patching_report.FIGURES | long_context_report.FIGURES
    for name, (draw, wanted) in more.items():
        if wanted(result):
            draw(result, out / name)
            figures.append(out / name)
    json_path = out / "analysis.json"
    json_path.write_text(json.dumps(_finite(result), separators=(",", ":")))
    html_path = out / "report.html"
    html_path.write_text(html(result, figures), encoding="utf-8")
    return {"json": json_path, "html": html_path, "figures": figures}


def _finite(x):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def html(result: dict, figures: list[Path]) -> str:
    from .html_page import PAGE

    data = {k: result[k] for k in ("model", "view", "roles", "hints", "importance") if k in result}
    data["summary"] = {k: result[k] for k in ("ablation", "pruning", "corpus", "timings_s") if k in result}
    if result.get("layer_types") and any(g["window"] is not None for g in result["layer_types"]):
        data["summary"]["layer_types"] = result["layer_types"]
    if result.get("patching"):
        from .patching_report import summary

        data["summary"]["patching"] = summary(result["patching"])
    if result.get("long_context"):
        from . import long_context_report

        data["summary"]["long_context"] = long_context_report.summary(result["long_context"])
    if "ablation" in data["summary"]:
        data["summary"]["ablation"] = {k: v for k, v in result["ablation"].items() if k != "curves"}
    payload = json.dumps(_finite(data)).replace("</", "<\\/")  # cannot close the <script>
    imgs = "\n".join(
        f'<figure><img alt="{p.name}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{p.name}</figcaption></figure>'
        for p in figures
    )
    title = f"headwise analyze: {result['model']['name']}"
    return PAGE.replace("%%TITLE%%", _esc(title)).replace("%%DATA%%", payload).replace("%%FIGURES%%", imgs)


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
