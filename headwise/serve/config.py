"""What `headwise serve` serves: local models, upstream providers, routes, server limits.

A TOML file (examples/gateway.toml) or, with none, the two builtin models. Clients name
a model; the gateway resolves that name to a route (an alias, a local model, or
`provider/model`) and the route to its targets:

    [models.smollm2]            # a local model: builtin name, checkpoint path, or a folder written by
                                # save_pruned / `headwise analyze` (headwise_pruned.json: served pruned)
    source = "smollm2-135m-instruct"
    cache = "paged"             # paged | int8: the format of the engine's KV block pool
    weights = "auto"            # auto (a GGUF computed as stored) | fp32 | bf16 | int8 | int4 | q4_0 | ... | q6_k | q4_k_m | ...
    max_num_seqs = 64           # the engine's limits: any headwise.EngineConfig field but kv_dtype
    kv_memory = "512MiB"        # the KV pool's bytes (EngineConfig.memory_budget_bytes; num_blocks wins)
    tensor_parallel = 1         # N > 1: heads split over N local processes (this one leads; one such model)
    [providers.peer]            # an upstream OpenAI-compatible server (config_providers.py)
    base_url = "http://10.0.0.2:8000/v1"
    api_key_env = "PEER_KEY"    # the key itself never sits in the file
    models = ["smollm2-135m-instruct"]
    api = "openai"              # or "anthropic": /v1/messages passed straight to <base_url>/messages
    [replicas.pool]             # other `headwise serve` processes serving the same models
    urls = ["http://10.0.0.3:8000", "http://10.0.0.4:8000"]   # their root URLs (/health, /v1)
    models = ["smollm2-135m-instruct"]                        # clients send "pool/smollm2-135m-instruct"
    [routes.chat]               # an alias: weighted targets, then fallbacks
    targets = [{target = "smollm2", weight = 3}, {target = "peer/smollm2-135m-instruct", weight = 1}]
    fallbacks = ["smollm2"]

Upstream URLs come only from here, never from a request.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..core.plan import parse_size
from ..runtime.config import EngineConfig
from .config_providers import ConfigError, Provider, ReplicaSet, from_table, parse_providers, parse_replicas

__all__ = ["ConfigError", "Provider", "ReplicaSet", "LocalModel", "Route", "Target", "ServeConfig", "ServerSettings"]

# the engine's block pool: paged (its K/V dtype the engine's choice: 16-bit for quantized weights, the
# model's dtype otherwise) or K/V stored as named (EngineConfig.kv_dtype)
CACHE_KINDS = ("paged", "int8", "bfloat16", "float16", "float32")
METRICS_AUTH = ("auto", "always", "never")
ACCEPT_RESUME = ("keyed", "always", "never")  # [server] accept_resume (middleware.ApiKeyAuth)


# [models.NAME] keys that are the engine's limits (EngineConfig fields; its kv_dtype comes from `cache`)
ENGINE_KEYS = tuple(k for k in EngineConfig.fields() if k != "kv_dtype")


@dataclass(frozen=True)
class LocalModel:
    name: str  # what clients send as "model"
    source: str  # builtin name or checkpoint dir / .gguf path
    backend: str = "auto"  # attention backend (headwise.attention registry)
    cache: str = "paged"  # paged | int8 | bfloat16 | float16 | float32 -> the engine's kv_dtype
    dtype: str | None = None  # None keeps the checkpoint's float dtype
    weights: str = "auto"  # headwise.load's weights=: auto (a GGUF as stored), fp32, bf16, int8, int4, q4_0, ...
    # the engine's limits (max_num_seqs, num_blocks, block_size, max_num_batched_tokens, max_waiting_requests,
    # max_waiting_tokens, memory_budget_bytes): keys of [models.NAME] in the file, validated by EngineConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_model_len: int | None = None  # cap the context below the model's own
    # per request, checked before any tokenizing (which costs ~1 s per MB, on a worker thread)
    max_input_chars: int = 2_000_000  # characters of text over all messages / prompts / inputs
    max_embedding_tokens: int = 300_000  # tokens over all inputs of one embeddings request (OpenAI's)
    # N > 1: the model's heads split over N ranks, this process rank 0 (its engine), N - 1 local follower
    # processes (serve/tensor_parallel.py); N must divide the KV heads; decoders only
    tensor_parallel: int = 1

    def __post_init__(self):
        where = f"[models.{self.name}]"
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(
                f"{where} tensor_parallel must be an integer >= 1 (the number of processes that split the "
                f"model's heads; 1 = not split), got {tp!r}"
            )
        if self.cache == "contiguous":
            raise ConfigError(
                f"{where} cache = 'contiguous' cannot be served: continuous batching needs the "
                "paged block pool (a contiguous cache reserves max length per sequence up front; "
                "headwise.generate uses it). Choose paged or int8"
            )
        if self.cache not in CACHE_KINDS:
            raise ConfigError(f"{where} cache = {self.cache!r}; choose one of {', '.join(CACHE_KINDS)}")
        from ..models.quantized_load import check_weights

        try:
            object.__setattr__(self, "weights", check_weights(self.weights))
        except ValueError as e:
            raise ConfigError(f"{where} {e}") from None
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(
                f"{where} engine must be a headwise.engine.EngineConfig, got {type(self.engine).__name__}"
            )
        object.__setattr__(self, "engine", self.engine.replace(kv_dtype=None if self.cache == "paged" else self.cache))
        for key in ("max_input_chars", "max_embedding_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where} {key} must be >= 1, got {getattr(self, key)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"{where} max_model_len must be >= 1 or unset, got {self.max_model_len}")


def _local_model(name: str, table: dict) -> LocalModel:
    """A [models.NAME] table -> LocalModel; its engine keys make the EngineConfig."""
    where = f"[models.{name}]"
    t = dict(table)
    t.setdefault("source", name)
    if "kv_memory" in t:
        if "memory_budget_bytes" in t:
            raise ConfigError(f"{where} sets both kv_memory and memory_budget_bytes (the same budget); keep one")
        t["memory_budget_bytes"] = kv_memory_bytes(t.pop("kv_memory"), f"{where} kv_memory")
    known = (set(LocalModel.__dataclass_fields__) - {"name", "engine"}) | set(ENGINE_KEYS) | {"kv_memory"}
    unknown = sorted(set(t) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        engine = EngineConfig(**{k: t.pop(k) for k in ENGINE_KEYS if k in t})
    except ValueError as e:
        raise ConfigError(f"{where} {e}") from None
    return from_table(t, LocalModel, where, name=name, engine=engine)


def kv_memory_bytes(size, where: str = "--kv-memory") -> int:
    """A KV pool budget as written ("512MiB", "1GB" = 10**9, "2G" = 2 GiB, or bytes) -> bytes >= 1."""
    try:
        n = parse_size(size) if isinstance(size, (str, int)) and not isinstance(size, bool) else None
    except ValueError:
        n = None
    if n is None or n < 1:
        raise ConfigError(
            f"{where} = {size!r} is not a memory size; write e.g. 512MiB, 1GiB, 1GB (10^9 bytes) or 2G (= 2GiB)"
        )
    return n


def with_kv_memory(config: "ServeConfig", nbytes: int | None) -> "ServeConfig":
    """`headwise serve --kv-memory SIZE`: every local model's KV pool budget set to `nbytes`
    (a model's num_blocks, where the config gives one, still decides its pool)."""
    if nbytes is None:
        return config
    models = {
        name: dataclasses.replace(m, engine=m.engine.replace(memory_budget_bytes=nbytes))
        for name, m in config.models.items()
    }
    return dataclasses.replace(config, models=models)


@dataclass(frozen=True)
class Target:
    target: str  # a local model name or "provider/model"
    weight: float = 1.0


@dataclass(frozen=True)
class Route:
    name: str
    targets: tuple[Target, ...]
    fallbacks: tuple[str, ...] = ()  # tried in order once the weighted targets have failed
    retries: int = 1  # extra weighted draws after the first target fails
    timeout: float = 60.0  # seconds to wait for a target's first byte
    cooldown_failures: int = 3  # consecutive failures that put a target in cooldown
    cooldown_seconds: float = 30.0  # ... for this long

    def __post_init__(self):
        where = f"[routes.{self.name}]"
        if not self.targets:
            raise ConfigError(f"{where} has no targets")
        if any(t.weight <= 0 for t in self.targets):
            raise ConfigError(f"{where} target weights must be > 0")
        if self.retries < 0 or self.cooldown_failures < 1 or self.timeout <= 0 or self.cooldown_seconds < 0:
            raise ConfigError(f"{where} needs retries >= 0, cooldown_failures >= 1, timeout > 0, cooldown_seconds >= 0")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # prefer api_key_env: keys in a file end up in backups
    api_key_env: str | None = "HEADWISE_API_KEYS"  # comma-separated keys; unset/empty = no auth
    max_body_bytes: int = 4 * 2**20  # FastAPI has no limit of its own
    drain_timeout: float = 30.0  # SIGTERM: seconds in-flight requests get to finish
    # slowloris: headers must arrive within header_timeout s, the body within body_timeout s (else 408, closed)
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    metrics_auth: str = "auto"  # /metrics needs a key: auto (with keys, beyond loopback) | always | never
    direct_streams: bool = True  # a one-choice stream's chunks written by the engine's thread (direct.py)
    # who may send headwise.resume (a gateway moving a stream here from a dead replica): keyed (a
    # request with one of the API keys) | always (replicas on a private network, no keys) | never
    accept_resume: str = "keyed"
    stall_timeout: float = 30.0  # seconds a stream's client may read nothing before it is aborted
    # open connections (serve/connections.py): unset = from the open-files limit (half of it, at most 8192;
    # half of that per address). At a cap the oldest idle connection is closed to make room, else a 503
    max_connections: int | None = None
    max_connections_per_client: int | None = None  # per client IP address

    def __post_init__(self):
        for key in ("max_connections", "max_connections_per_client"):
            n = getattr(self, key)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ConfigError(
                    f"[server] {key} must be an integer >= 1 (leave it out for a default from the open-files "
                    f"limit), got {n!r}"
                )
        if self.max_connections and self.max_connections_per_client:
            if self.max_connections_per_client > self.max_connections:
                raise ConfigError(
                    f"[server] max_connections_per_client = {self.max_connections_per_client} is above "
                    f"max_connections = {self.max_connections}: lower it (one address may hold at most them all)"
                )
        if not isinstance(self.direct_streams, bool):
            raise ConfigError(f"[server] direct_streams must be true or false, got {self.direct_streams!r}")
        for key in ("header_timeout", "body_timeout", "stall_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"[server] {key} must be > 0 seconds, got {getattr(self, key)}")
        if self.accept_resume not in ACCEPT_RESUME:
            raise ConfigError(
                f"[server] accept_resume = {self.accept_resume!r}; choose one of {', '.join(ACCEPT_RESUME)}"
            )
        if self.metrics_auth not in METRICS_AUTH:
            raise ConfigError(f"[server] metrics_auth = {self.metrics_auth!r}; choose one of {', '.join(METRICS_AUTH)}")

    def keys(self) -> tuple[str, ...]:
        env = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return tuple(k for k in (*self.api_keys, *(s.strip() for s in env.split(","))) if k)

    def metrics_need_key(self) -> bool:
        """/metrics names every model, route and target: behind the API keys when they are set
        and the server is reachable beyond this machine (or always / never, if told)."""
        if self.metrics_auth == "never":
            return False
        if not self.keys():
            if self.metrics_auth == "always":
                raise ConfigError(
                    "[server] metrics_auth = 'always' but no API keys are set: set "
                    f"{self.api_key_env or 'api_key_env'} or api_keys, or use metrics_auth = 'auto'"
                )
            return False
        return self.metrics_auth == "always" or not _loopback(self.host)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class ServeConfig:
    server: ServerSettings = field(default_factory=ServerSettings)
    models: dict[str, LocalModel] = field(default_factory=dict)
    providers: dict[str, Provider] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)
    replicas: dict[str, ReplicaSet] = field(default_factory=dict)

    def __post_init__(self):
        both = sorted(set(self.providers) & set(self.replicas))
        if both:
            raise ConfigError(f"{both} name both a provider and a replica set ('NAME/model' would clash); rename one")
        known = set(self.models) | set(self.remote_names())
        for route in self.routes.values():
            for name in [t.target for t in route.targets] + list(route.fallbacks):
                if name not in known:
                    raise ConfigError(
                        f"[routes.{route.name}] target {name!r} is neither a local model nor "
                        f"provider/model or replicas/model; known: {', '.join(sorted(known)) or 'none'}"
                    )
        split = [name for name, m in self.models.items() if m.tensor_parallel > 1]
        if len(split) > 1:
            raise ConfigError(
                f"models {', '.join(split)} all set tensor_parallel > 1; a server leads one tensor-parallel "
                "group (torch.distributed has one default group per process): keep it on one model and "
                "serve the others from another `headwise serve`, behind [replicas] or [providers]"
            )
        clash = set(self.routes) & known
        if clash:
            raise ConfigError(f"route names {sorted(clash)} hide models of the same name; rename the routes")

    def remote_names(self) -> list[str]:
        """provider/model and replica-set/model names."""
        sets = [*self.providers.values(), *self.replicas.values()]
        return [f"{p.name}/{m}" for p in sets for m in p.models]

    def model_names(self) -> list[str]:
        """Every name a client may send, in a stable order."""
        return [*self.models, *self.remote_names(), *self.routes]


def default_config(host: str | None = None, port: int | None = None) -> ServeConfig:
    """No config file: SmolLM2 for chat and completions, MiniLM for embeddings."""
    server = ServerSettings(**{k: v for k, v in (("host", host), ("port", port)) if v is not None})
    models = {n: LocalModel(n, n) for n in ("smollm2-135m-instruct", "all-minilm-l6-v2")}
    return ServeConfig(server=server, models=models)


def models_config(
    sources: list[str], host: str | None = None, port: int | None = None, tensor_parallel: int = 1
) -> ServeConfig:
    """`headwise serve MODEL...`: each builtin name, .gguf file or checkpoint directory served under
    its own name (the builtin's name, else the file or folder name; a repeat gets -2, -3, ...).
    tensor_parallel: `--tensor-parallel N`, for the one MODEL it may be given with."""
    from ..models.builtin import canonical, is_builtin

    server = ServerSettings(**{k: v for k, v in (("host", host), ("port", port)) if v is not None})
    models: dict[str, LocalModel] = {}
    for source in sources:
        path = Path(source).expanduser()
        base = (
            canonical(source)
            if is_builtin(source) and not path.exists()
            else (path.stem if path.suffix == ".gguf" else path.resolve().name)
        )
        name, n = base, 1
        while name in models:
            n += 1
            name = f"{base}-{n}"
        models[name] = LocalModel(name, str(path) if path.exists() else source, tensor_parallel=tensor_parallel)
    return ServeConfig(server=server, models=models)


def parse_config(data: dict) -> ServeConfig:
    """A parsed TOML document -> ServeConfig (errors name the table and key)."""
    unknown = sorted(set(data) - {"server", "models", "providers", "routes", "replicas"})
    if unknown:
        raise ConfigError(f"unknown table(s) {', '.join(unknown)}; known: server, models, providers, replicas, routes")
    server = dict(data.get("server", {}))
    if "api_keys" in server:
        server["api_keys"] = tuple(server["api_keys"])
    models = {name: _local_model(name, t) for name, t in data.get("models", {}).items()}
    providers = parse_providers(data.get("providers", {}))
    replicas = parse_replicas(data.get("replicas", {}))
    routes = {}
    for name, t in data.get("routes", {}).items():
        t = dict(t)
        raw = t.get("targets", ())
        t["targets"] = tuple(
            Target(x) if isinstance(x, str) else from_table(x, Target, f"[routes.{name}] targets") for x in raw
        )
        t["fallbacks"] = tuple(t.get("fallbacks", ()))
        routes[name] = from_table(t, Route, f"[routes.{name}]", name=name)
    if not models and not providers and not replicas:
        raise ConfigError("the config serves nothing: add a [models.NAME], [providers.NAME] or [replicas.NAME] table")
    return ServeConfig(from_table(server, ServerSettings, "[server]"), models, providers, routes, replicas)


def load_config(path: str | os.PathLike, host: str | None = None, port: int | None = None) -> ServeConfig:
    """Read a gateway TOML file; --host/--port override its [server] table."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    server = data.setdefault("server", {})
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
