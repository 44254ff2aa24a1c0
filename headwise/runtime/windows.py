"""The per-layer attention windows a model's caches are shaped by (`ModelConfig.windows`)."""

from __future__ import annotations


def model_windows(cfg) -> tuple[int | None, ...] | None:
    """Each layer's window (None = global) from a model's config, or None when every layer is
    global (the caches then build exactly what they built before windows existed)."""
    windows = getattr(cfg, "windows", None)
    if windows is None or all(w is None for w in windows):
        return None
    return tuple(windows)
