"""Command-line argument checks: a bad value is one line on stderr and exit 2, before any model loads.

p.add_argument("--max-new-tokens", type=positive_int)    # -5 -> "argument --max-new-tokens: must be >= 1"
p.add_argument("model", type=model_for("chat"))          # unknown name / missing file / wrong kind of model
"""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (the problem, then where the usage is) instead of the usage block."""

    def error(self, message: str):
        usage = "" if "`" in message else f" (see `{self.prog} --help`)"  # unless it names a command already
        self.exit(2, f"{self.prog}: error: {message}{usage}\n")


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" after every option that has a value by default."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class RawFormatter(Formatter, argparse.RawDescriptionHelpFormatter):
    """Formatter that keeps the description's line breaks as written."""


def _number(kind, ok, want: str):
    def check(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return x

    return check


positive_int = _number(int, lambda x: x >= 1, ">= 1")
nonneg_int = _number(int, lambda x: x >= 0, ">= 0")
positive_float = _number(float, lambda x: x > 0, "> 0")
nonneg_float = _number(float, lambda x: x >= 0, ">= 0")
probability = _number(float, lambda x: 0 < x <= 1, "in (0, 1]")
unit_interval = _number(float, lambda x: 0 <= x <= 1, "in [0, 1]")


def backend_name(text: str) -> str:
    """An attention backend from the registry, or "auto" (the default: answered without importing torch)."""
    if text == "auto":
        return text
    from ..attention import backends

    names = list(backends())
    if text != "auto" and text not in names:
        raise argparse.ArgumentTypeError(
            f"unknown attention backend {text!r}; choose auto, {', '.join(names)} (see `headwise backends`)"
        )
    return text


def weights_name(text: str) -> str:
    """A headwise.load weights= value: auto, fp32, bf16, or a quantized format (int8, q4_1, ...)."""
    from ..models.quantized_load import check_weights

    try:
        return check_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_model(source: str, task: str | None = None) -> str:
    """Raise ValueError naming the problem and the fix unless `source` is something `headwise.load` can read
    (for `task`, when it can be told without loading it). Cheap: nothing is loaded."""
    from ..models.builtin import BuiltinNotInstalled
    from ..models.sources import find

    try:
        found = find(source)
    except (OSError, ValueError, BuiltinNotInstalled) as e:
        raise ValueError(str(e)) from None
    if found.builtin is None and found.path.is_dir() and not (found.path / "config.json").is_file():
        raise ValueError(
            f"{source} is a directory without config.json; a checkpoint directory needs the "
            "Hugging Face config.json next to its weights"
        )
    kind = found.task
    if task and kind and kind != task:
        other = {"chat": "an embedding model (an encoder)", "embed": "a chat model (a decoder)"}[task]
        example = {"chat": "smollm2-135m-instruct", "embed": "all-minilm-l6-v2"}[task]
        use = {"chat": "headwise embed", "embed": "headwise generate / chat"}[task]
        raise ValueError(
            f"{source} is {other}; this command needs {'a chat' if task == 'chat' else 'an embedding'}"
            f" model such as {example} (for {source}, use `{use}`)"
        )
    return source


def model_for(task: str | None = None):
    """argparse `type=` for a model argument: builtin name, .gguf file or checkpoint directory."""

    def check(text: str) -> str:
        try:
            return check_model(text, task)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return check


def fail(prog: str, error: BaseException | str) -> int:
    """One line on stderr for an error found after parsing (e.g. while loading); exit status 2."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2
