"""The long-context part of the `headwise analyze` report (report.py draws the rest).

  long_context.png  layers x heads at the long context (`--context N`): the strongest role
                    label, mass on the sinks, mass within the local window, mean attended
                    distance, entropy / log(visible keys), and the most attended token's share
                    of the value-weighted norms against its share of the weight

`summary(result["long_context"])` is what the HTML page shows (no per-head matrices).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .report_style import ROLE_COLORS, SHORT, heads_grid, pyplot, strongest_role


def fig_long_context(result: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.colors import LogNorm, to_rgb

    lc = result["long_context"]
    heads, st = lc["roles"]["heads"], lc["stats"]
    L, H = len(heads), max(len(r) for r in heads)
    fig, axes = plt.subplots(1, 6, figsize=(3.0 + 2.1 * 6 * max(H, 4) / 9, 1.6 + 0.2 * L), dpi=80)
    img = np.ones((L, H, 3))
    ax = axes[0]
    for l, row in enumerate(heads):
        for h, info in enumerate(row):
            best = strongest_role(info, lc["roles"]["thresholds"])
            if best:
                role = "offset" if best.startswith("offset") else best
                img[l, h] = to_rgb(ROLE_COLORS[role])
                short = best.replace("offset ", "off") if role == "offset" else SHORT[role]
                ax.text(h, l, short, ha="center", va="center", fontsize=5, color="white")
    ax.imshow(img, aspect="auto", interpolation="nearest")
    ax.set_title("strongest role", fontsize=8)
    broad = [[info["scores"]["broad"] for info in row] for row in heads]
    ratio = [
        [n / max(w, 1e-9) for n, w in zip(nr, wr)] for nr, wr in zip(st["top_norm_share"], st["max_weight"])
    ]  # < 1: the top token's vector is small (Kobayashi et al. 2020)
    panels = [
        (heads_grid(st["sink_mass"]), f"mass on the first {lc['sinks']} tokens", "viridis", (0, 1)),
        (heads_grid(st["local_mass"]), f"mass within {lc['local']} tokens", "viridis", (0, 1)),
        (heads_grid(st["distance"]), "mean attended distance (tokens)", "magma", "log"),
        (heads_grid(broad), "entropy / log(visible keys)", "viridis", (0, 1)),
        (heads_grid(ratio), "top token: norm share / weight", "RdBu", (0, 2)),
    ]
    for ax, (m, title, cmap, scale) in zip(axes[1:], panels):
        if scale == "log":
            im = ax.imshow(m, aspect="auto", cmap=cmap, norm=LogNorm(vmin=1, vmax=max(2.0, np.nanmax(m))))
        else:
            im = ax.imshow(m, aspect="auto", cmap=cmap, vmin=scale[0], vmax=scale[1], interpolation="nearest")
        fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
        ax.set_title(title, fontsize=8)
    for ax in axes:
        ax.set_xticks(range(H))
        ax.set_yticks(range(0, L, max(1, L // 15)))
        ax.tick_params(labelsize=6)
        ax.set_xlabel("head", fontsize=7)
    axes[0].set_ylabel("layer")
    mem = lc["memory"]
    fig.suptitle(
        f"{result['model']['name']} at {lc['tokens']} tokens: peak memory {mem['peak_mib']} MiB "
        f"({mem['extra_mib']} MiB for the pass; VmHWM) where the patterns would take "
        f"{lc['patterns_bytes'] / 2**30:.0f} GiB; {lc['seconds']:.0f} s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


FIGURES = {"long_context.png": (fig_long_context, lambda r: bool(r.get("long_context")))}


def summary(lc: dict) -> dict:
    """The long-context numbers the HTML summary shows, with each head's labels."""
    keep = ("tokens", "source", "copies", "sinks", "local", "seconds", "memory", "patterns_bytes")
    out = {k: lc[k] for k in keep}
    out["trained_context"], out["beyond_trained_context"] = lc["trained_context"], lc["beyond_trained_context"]
    out["labels"] = [[info["labels"] for info in row] for row in lc["roles"]["heads"]]
    return out
