"""Backends by name. Each is a plain function `fn(q, k, v, spec) -> AttentionOutput`
paired with `check(q, k, v, spec) -> list[str]`: the reasons it cannot serve a
request (empty list = it can). `attend(backend="auto")` walks the registry in
order and takes the first backend whose check passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from ..spec import AttentionOutput, AttentionSpec

BackendFn = Callable[[Tensor, Tensor, Tensor, AttentionSpec], AttentionOutput]
CheckFn = Callable[[Tensor, Tensor, Tensor, AttentionSpec], "list[str]"]


@dataclass(frozen=True)
class Backend:
    name: str
    fn: BackendFn
    check: CheckFn
    description: str = ""
    reads: str = "tensors"  # what K/V it takes: "tensors" (k, v) or "blocks" (a paged cache's description)
    why: str = ""  # why "auto" takes it where it can (before those after it), with the measurement: explain() says it


_REGISTRY: dict[str, Backend] = {}  # insertion order is the "auto" order
_CHANGES = [0]  # bumped by register_backend: memoized choices (functional.attend) are then stale


def registry_version() -> int:
    return _CHANGES[0]


def register_backend(
    name: str,
    fn: BackendFn,
    check: CheckFn | None = None,
    *,
    description: str = "",
    before: str | None = None,
    reads: str = "tensors",
    why: str = "",
) -> Backend:
    """Add (or replace) a backend. `before` places it ahead of another in the auto order.
    reads="blocks": it takes a paged cache's description (`headwise.attention.kv.LayerKV`) as k.
    why: what `explain()` prints when auto picks it (why it goes before the backends after it)."""
    if reads not in ("tensors", "blocks"):
        raise ValueError(f"reads must be 'tensors' or 'blocks', got {reads!r}")
    backend = Backend(name, fn, check or (lambda q, k, v, spec: []), description, reads, why)
    _CHANGES[0] += 1
    _REGISTRY.pop(name, None)
    if before is None:
        _REGISTRY[name] = backend
    else:
        get_backend(before)
        items = list(_REGISTRY.items())
        at = [n for n, _ in items].index(before)
        items.insert(at, (name, backend))
        _REGISTRY.clear()
        _REGISTRY.update(items)
    return backend


def backends() -> list[str]:
    """Registered backend names, in the order `backend="auto"` tries them."""
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; valid backends: {', '.join(['auto', *_REGISTRY])}"
        ) from None
