"""What the report's parts share (report.py, patching_report.py, long_context_report.py): the role
colours and short labels, matplotlib's off-screen pyplot, and a layers x heads grid. Kept below
all three so each imports it and none imports another."""

from __future__ import annotations

import numpy as np

ROLE_COLORS = {
    "previous": "#1f77b4",
    "next": "#17becf",
    "offset": "#9467bd",
    "local": "#2ca02c",
    "long_range": "#ff7f0e",
    "broad": "#bcbd22",
    "sink": "#7f7f7f",
    "induction": "#d62728",
}
SHORT = {
    "previous": "prev",
    "next": "next",
    "local": "local",
    "long_range": "long",
    "broad": "broad",
    "sink": "sink",
    "induction": "ind",
}


def pyplot():
    """matplotlib.pyplot on the Agg backend: figures render with no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def strongest_role(info: dict, thresholds: dict) -> str:
    """The head's label whose score clears its threshold by the widest factor ("" if none)."""
    best, margin = "", 0.0
    for lab in info["labels"]:
        role = "offset" if lab.startswith("offset") else lab
        m = info["scores"][role] / thresholds[role]
        if m > margin:
            best, margin = lab, m
    return best


def heads_grid(rows: list[list[float]]) -> np.ndarray:
    """Layers x heads, NaN where a (pruned) layer has fewer heads."""
    img = np.full((len(rows), max(len(r) for r in rows)), np.nan)
    for l, r in enumerate(rows):
        img[l, : len(r)] = r
    return img
