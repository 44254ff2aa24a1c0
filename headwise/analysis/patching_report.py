"""The patching part of the `headwise analyze` report (report.py draws the rest).

  patching.png  layers x heads heat maps of the recovered fraction: the mean over the
                pairs, then each pair (clean -> corrupted, answer vs wrong)
  dla.png       direct logit attribution of the logit difference on the clean prompts:
                each head's share (mean over pairs), and per layer its heads, MLP and the
                rest, so the parts that write the answer directly stand out

`summary(result["patching"])` is what the HTML page's table shows (no per-head matrices).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .report_style import heads_grid, pyplot


def _heat(ax, img: np.ndarray, title: str, limit: float):
    im = ax.imshow(img, aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
    L, H = img.shape
    ax.set_xticks(range(H))
    ax.set_yticks(range(0, L, max(1, L // 15)))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=8)
    return im


def fig_patching(result: dict, path: Path) -> None:
    plt = pyplot()
    pt = result["patching"]
    pairs = pt["pairs"]
    grids = [(heads_grid(pt["mean_recovered"]), f"mean over {len(pairs)} pairs")]
    for p in pairs:
        what = f"{p['answer']!r} vs {p['wrong']!r}" if p.get("answer") is not None else "cosine"
        grids.append((heads_grid(p["patching"]["recovered"]), f"{_short(p['clean'])}\n({what})"))
    L, H = grids[0][0].shape
    size = (0.6 + (0.9 + 0.32 * H) * len(grids), 2.2 + 0.17 * L)
    fig, axes = plt.subplots(1, len(grids), figsize=size, dpi=80, layout="constrained")  # room for the titles
    axes = np.atleast_1d(axes)
    limit = max(1.0, float(np.nanmax(np.abs(np.stack([g for g, _ in grids])))))
    for ax, (img, title) in zip(axes, grids):
        im = _heat(ax, img, title, limit)
        l, h = np.unravel_index(np.nanargmax(img), img.shape)
        ax.text(h, l, f"{img[l, h]:.2f}", ha="center", va="center", fontsize=6, color="k")
    unit = "logit difference" if pt["metric"] == "logit_diff" else "cosine to the clean embedding"
    fig.colorbar(im, ax=list(axes), fraction=0.02, label="recovered fraction")
    fig.suptitle(
        f"{result['model']['name']}: activation patching, one head's clean output into the corrupted run; "
        f"recovered {unit} (1 = all of it)",
        fontsize=9,
    )
    fig.savefig(path)
    plt.close(fig)


def fig_dla(result: dict, path: Path) -> None:
    plt = pyplot()
    pt = result["patching"]
    img = heads_grid(pt["mean_dla"])
    fig, axes = plt.subplots(1, 2, figsize=(6.0 + 0.35 * img.shape[1], 1.8 + 0.17 * img.shape[0]), dpi=80)
    im = _heat(axes[0], img, "each head's direct share (mean over pairs)", max(1e-6, float(np.nanmax(np.abs(img)))))
    fig.colorbar(im, ax=axes[0], fraction=0.04, label="logit difference")
    ax = axes[1]
    L = img.shape[0]
    heads, mlp, other = np.zeros(L), np.zeros(L), 0.0
    for p in pt["pairs"]:
        d = p["dla"]["diff"]
        heads += np.array([sum(r) for r in d["heads"]]) / len(pt["pairs"])
        for k, v in d["terms"].items():
            if k == "mlp":
                mlp += np.asarray(v) / len(pt["pairs"])
            else:
                other += (sum(v) if isinstance(v, list) else v) / len(pt["pairs"])
    y = np.arange(L)
    ax.barh(y - 0.2, heads, height=0.4, color="C0", label="attention heads")
    ax.barh(y + 0.2, mlp, height=0.4, color="C1", label="MLP")
    ax.axvline(0, color="k", lw=0.6)
    ax.invert_yaxis()
    ax.set_yticks(range(0, L, max(1, L // 15)))
    ax.set_xlabel("share of the logit difference")
    ax.set_ylabel("layer")
    logit = np.mean([p["dla"]["diff"]["logit"] for p in pt["pairs"]])
    ax.set_title(f"per layer (mean over pairs); the rest (embeddings, biases)\n{other:+.2f} of {logit:.2f}", fontsize=8)
    ax.legend(fontsize=7)
    fig.suptitle(
        f"{result['model']['name']}: direct logit attribution on the clean prompts "
        f"(final norm's scale frozen at the run's own)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _short(text: str, n: int = 38) -> str:
    return text if len(text) <= n else "..." + text[-(n - 3) :]


# name -> (draw, whether the result has what it draws)
FIGURES = {
    "patching.png": (fig_patching, lambda r: bool((r.get("patching") or {}).get("pairs"))),
    "dla.png": (fig_dla, lambda r: "mean_dla" in (r.get("patching") or {})),
}


def summary(pt: dict) -> dict:
    """What the HTML page's table shows: per pair the prompts, the metric and the top heads."""
    rows = []
    for p in pt["pairs"]:
        pa = p["patching"]
        row = {k: p[k] for k in ("clean", "corrupted", "answer", "wrong")}
        row |= {"metric_clean": pa["clean"], "metric_corrupted": pa["corrupted"]}
        row |= {k: pa[k] for k in ("all_heads_recovered", "shared_prefix", "top")}
        if "dla" in p:
            d = p["dla"]["diff"]
            row["dla_total"], row["dla_logit"] = d["total"], d["logit"]
        rows.append(row)
    return {"metric": pt["metric"], "pairs": rows, "top": pt.get("top", []), "skipped": pt.get("skipped", [])}
