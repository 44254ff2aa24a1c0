"""Where headwise keeps files it derives once and reuses: parsed GGUF metadata, builtin models joined from parts."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$HEADWISE_CACHE, or ~/.cache/headwise."""
    return Path(os.environ.get("HEADWISE_CACHE") or Path.home() / ".cache" / "headwise")
