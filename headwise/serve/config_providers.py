"""[providers.NAME] and [replicas.NAME]: the servers elsewhere that the gateway forwards to
(serve/upstream.py, serve/anthropic_upstream.py, serve/failover.py). Split from config.py, which
re-exports every name here; ConfigError lives here because both files raise it.

    [providers.openai-like]     # api = "openai" (the default): base_url ends where OpenAI's /v1 does
    base_url = "http://10.0.0.2:8000/v1"
    models = ["llama-3.1-8b"]
    [providers.claude]          # api = "anthropic": /v1/messages goes to <base_url>/messages as sent
    base_url = "https://api.anthropic.com/v1"
    api = "anthropic"
    api_key_env = "ANTHROPIC_API_KEY"
    models = ["claude-sonnet-4-5"]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

PROVIDER_APIS = ("openai", "anthropic")


class ConfigError(ValueError):
    """The config file is wrong; the message names the table and key."""


def from_table(table: dict, cls, where: str, **fixed) -> Any:
    """A TOML table -> cls(**fixed, **table); an unknown key or a missing one is named."""
    known = set(cls.__dataclass_fields__) - set(fixed)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**fixed, **table)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_limits(where: str, spec, timeouts: tuple[str, ...]) -> None:
    """The upstream limits [providers.NAME] and [replicas.NAME] share: timeouts > 0, a body cap."""
    for key in timeouts:
        v = getattr(spec, key)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            raise ConfigError(f"{where} {key} must be > 0 seconds, got {v!r}")
    v = spec.max_response_bytes
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1024):
        raise ConfigError(f"{where} max_response_bytes must be an integer >= 1024 (bytes), got {v!r}")


@dataclass(frozen=True)
class Provider:
    name: str
    base_url: str  # ".../v1": endpoints are appended ("/chat/completions")
    models: tuple[str, ...]
    api_key_env: str | None = None  # env var holding the upstream key
    timeout: float = 60.0  # seconds until the first byte (a stream: its first event); a whole non-streamed answer
    # a body held whole (a non-streamed answer), counted after decoding; 256 MiB because a 2,048-input
    # embeddings answer at 3,072 dimensions is ~130 MB of JSON, and a 1.5 GB or gzip-bomb body is a 502
    max_response_bytes: int = 256 << 20
    idle_timeout: float = 60.0  # seconds a stream may go without an event (`:` keep-alives do not count)
    total_timeout: float = 3600.0  # seconds a whole request may take: a long reasoning stream, not forever
    # the API it speaks: "openai" (chat, completions, embeddings; /v1/messages translated to chat) or
    # "anthropic" (/v1/messages only, sent as it came to <base_url>/messages with x-api-key)
    api: str = "openai"
    anthropic_version: str = "2023-06-01"  # the anthropic-version header when the client sends none

    def __post_init__(self):
        where = f"[providers.{self.name}]"
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"{where} base_url = {self.base_url!r} is not an http(s) URL")
        if not self.models:
            raise ConfigError(f'{where} lists no models; add models = ["..."]')
        if self.api not in PROVIDER_APIS:
            raise ConfigError(f"{where} api = {self.api!r}; choose one of {', '.join(PROVIDER_APIS)}")
        _check_limits(where, self, ("timeout", "idle_timeout", "total_timeout"))

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True)
class ReplicaSet:
    """`headwise serve` processes that serve the same models (same weights: a stream that one
    of them began, another finishes). Routing and failover: serve/replicas.py, serve/failover.py."""

    name: str
    urls: tuple[str, ...]  # root URLs ("http://host:port"): /health and /v1/... are appended
    models: tuple[str, ...]  # model names each replica serves; targets "NAME/model"
    api_key_env: str | None = None  # env var holding the replicas' API key
    timeout: float = 60.0  # seconds to wait for a replica's first byte, and then between two events
    health_interval: float = 2.0  # seconds between two polls of each replica's /health
    # requests whose prompt shares its first affinity_chars characters (an agent's system prompt,
    # a long document) go to the same replica, whose prefix cache holds it; 0: no affinity
    affinity_chars: int = 256
    # ... unless that replica has this many more requests in flight than the least busy one
    affinity_slack: int = 4
    failovers: int = 2  # replicas a stream may move to after the one it started on dies
    # as [providers.NAME]: a body held whole, after decoding; a leg with no event for idle_timeout
    # (None: timeout; `:` keep-alives do not count) fails over; a client's stream ends at total_timeout
    max_response_bytes: int = 256 << 20
    idle_timeout: float | None = None
    total_timeout: float = 3600.0

    def __post_init__(self):
        where = f"[replicas.{self.name}]"
        if self.idle_timeout is None:
            object.__setattr__(self, "idle_timeout", self.timeout)
        _check_limits(where, self, ("idle_timeout", "total_timeout"))
        if not self.urls:
            raise ConfigError(f'{where} lists no urls; add urls = ["http://host:port", ...]')
        for u in self.urls:
            url = urlparse(u)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ConfigError(f"{where} url {u!r} is not an http(s) URL")
            if url.path.rstrip("/") not in ("",):
                raise ConfigError(
                    f"{where} url {u!r} has a path; give the server's root URL (http://host:port), "
                    "the gateway adds /health and /v1/..."
                )
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError(f"{where} lists a url twice; each replica once")
        if not self.models:
            raise ConfigError(f'{where} lists no models; add models = ["..."] (names the replicas serve)')
        if not (self.timeout > 0 and self.health_interval > 0):
            raise ConfigError(f"{where} needs timeout > 0 and health_interval > 0 (seconds)")
        for key in ("affinity_chars", "affinity_slack", "failovers"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{where} {key} must be an integer >= 0, got {v!r}")

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


def parse_providers(tables: dict) -> dict[str, Provider]:
    providers = {}
    for name, t in tables.items():
        t = dict(t)
        t["models"] = tuple(t.get("models", ()))
        providers[name] = from_table(t, Provider, f"[providers.{name}]", name=name)
    return providers


def parse_replicas(tables: dict) -> dict[str, ReplicaSet]:
    replicas = {}
    for name, t in tables.items():
        t = dict(t)
        for key in ("urls", "models"):
            if not isinstance(t.get(key, []), list):
                raise ConfigError(f'[replicas.{name}] {key} must be a list, e.g. {key} = ["..."]')
            t[key] = tuple(x.rstrip("/") if key == "urls" and isinstance(x, str) else x for x in t.get(key, ()))
        replicas[name] = from_table(t, ReplicaSet, f"[replicas.{name}]", name=name)
    return replicas
