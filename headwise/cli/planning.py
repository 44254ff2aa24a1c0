"""`headwise plan MODEL`: core/plan_report.py's command, with MODEL also a .gguf file or a checkpoint
folder (read for its sizes: models/describe.py), which core -- below models -- cannot open itself."""

from __future__ import annotations

from pathlib import Path

from ..core import plan_report
from ..core.config import ALIASES, PRESETS, ModelConfig, get_preset


def add_cli(sub) -> None:
    plan_report.add_cli(sub).set_defaults(func=run)


def run(args) -> int:
    return plan_report.run_plan(args, resolve=resolve)


def resolve(name: str) -> tuple[ModelConfig, str | None, str | None]:
    """A file or folder that exists (its config, its stored weight format, a note), else a preset;
    ValueError naming every kind of MODEL otherwise."""
    path = Path(name).expanduser()
    if path.exists():
        from ..models.describe import describe

        try:
            d = describe(path)
        except OSError as e:  # unreadable: a permission, a folder that went away
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
        return d.config, d.weights, d.note
    try:
        return get_preset(name), None, None
    except ValueError:
        raise ValueError(
            f"not a preset, file or folder: {name!r}; presets: {', '.join(PRESETS)} (aliases: "
            f"{', '.join(ALIASES)}), or a .gguf file or a checkpoint folder with config.json"
        ) from None
