"""Where a model's files are: a builtin name, a .gguf file or a checkpoint directory, resolved once.

    find("smollm2")             # Source(name="smollm2", path=.../SmolLM2-135M-Instruct.Q4_1.gguf, builtin=...)
    find("~/ckpt")              # Source(name="~/ckpt", path=/home/me/ckpt, builtin=None)
    find("nope")                # FileNotFoundError: unknown model 'nope': ... (see `headwise models`)

`headwise.load`, the CLI's argument checks and the server's tensor-parallel checks all ask this
one function, so a name means the same model everywhere and the errors read the same. Nothing
is loaded or read here beyond what a path's existence and a config.json's model_type tell.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import builtin as builtin_models
from .builtin import BUILTIN, BuiltinModel, BuiltinNotInstalled, find_builtin


@dataclass(frozen=True)
class Source:
    name: str  # as typed: what errors and config.name say ("smollm2", "~/ckpt")
    path: Path  # the .gguf file or the checkpoint directory holding the weights
    builtin: BuiltinModel | None = None  # the builtin model the name means, if it is one

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file()  # find() lets no other file through

    @property
    def task(self) -> str | None:
        """ "chat" (a decoder), "embed" (an encoder), or None when it cannot be told without loading."""
        if self.builtin is not None:
            return self.builtin.task
        if self.is_gguf:
            return "chat"  # headwise reads decoder GGUFs only
        try:
            kind = json.loads((self.path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
        return "embed" if kind == "bert" else "chat" if kind else None


def find(source: str | os.PathLike) -> Source:
    """The files `source` names: an existing .gguf file or directory (`~` expanded), else a builtin
    name. Raises ValueError for a file that is not a .gguf, FileNotFoundError naming the fix for
    anything else not found, BuiltinNotInstalled (with the pip command) for a builtin whose
    package is missing."""
    name = str(source)
    path = Path(source).expanduser()
    names = ", ".join(BUILTIN)
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise ValueError(
                f"{name} is a file but not a .gguf; pass a .gguf file, a checkpoint directory "
                f"(config.json + weights) or a builtin name ({names})"
            )
        return Source(name, path)
    try:
        found = builtin_models.resolve(name)  # KeyError for a name that is no builtin's
    except KeyError:
        if name.endswith(".gguf") or "/" in name or name.startswith(("~", ".")):
            raise FileNotFoundError(
                f"{name!r} is neither a checkpoint directory, a .gguf file nor a builtin model name: "
                "no such file or directory"
            ) from None
        raise FileNotFoundError(
            f"unknown model {name!r}: no such file or directory, and not a builtin name "
            f"({names}; see `headwise models`)"
        ) from None
    return Source(name, found, find_builtin(name))


def model_task(source: str | os.PathLike) -> str | None:
    """find(source).task, and for a builtin whose package is missing, the task it would have;
    None when the files don't say (or there are none: the load will say what is wrong)."""
    try:
        return find(source).task
    except BuiltinNotInstalled:
        return find_builtin(str(source)).task
    except (OSError, ValueError):
        return None
