"""The gateway: a model name -> a route -> targets (local engines, upstream providers, replica sets).

A route draws a target by weight; on a retryable failure (overload, loading, upstream
down or timing out) it draws again among the others, up to `retries` more times, then
tries each fallback in order. Retry and fallback happen only before the first byte
reaches the client: every target hands back a response whose first piece has already
arrived. A target that fails `cooldown_failures` times in a row is skipped for
`cooldown_seconds` (a circuit breaker); when every target of a route is cooling down,
the one whose cooldown ends first is probed rather than failing outright.
An upstream's answer that turns out broken (not JSON, a stream cut short: upstream.py)
counts as a failure too, even when found mid-stream; such a stream's target is settled
when the stream ends, not when it starts.
A plain model name is a route of one target with no retries and no cooldown.
A replica set's target ("NAME/model", failover.py) picks a replica itself (replicas.py) and
moves a stream that breaks mid-way to another replica; to a route it is one target.
Upstream URLs and keys come only from the config.
What each target receives (passthrough.py): an upstream provider, the body as the client sent it;
a local model or a replica set, the body validated by our strict schemas, checked when that target
is drawn. /v1/messages goes as it came to local models and to api = "anthropic" providers
(anthropic_upstream.py), translated to chat (ViaChat) for other targets. A route's targets that
cannot serve the endpoint (an Anthropic provider on /v1/chat/completions) are left out of its draw;
a route with none left is a 400 naming why.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response

from .config import Route, ServeConfig, Target
from .errors import APIError
from .failover import ReplicaTarget
from .anthropic import messages
from .anthropic.via_chat import ViaChat
from .anthropic_upstream import AnthropicUpstream
from .openai import chat, completions, embeddings
from .openai.streams import until_disconnect
from .passthrough import Incoming
from .replicas import ReplicaPool
from .upstream import UpstreamTarget

HANDLERS = {
    "chat": chat.create,
    "completions": completions.create,
    "embeddings": embeddings.create,
    "messages": messages.create,
}


class LocalTarget:
    owner = "headwise"
    messages_native = True  # serves /v1/messages itself (anthropic/messages.py)

    def __init__(self, name: str, runtime):
        self.name, self.runtime = name, runtime

    async def handle(self, endpoint: str, req, body: dict, request: Request, model: str, timeout, metrics, settle=None):
        # A stream's response starts only with its first piece: until then, a client that hangs up
        # must abort its queued requests at once, not after their prefill.
        return await until_disconnect(
            HANDLERS[endpoint](self.runtime, req, model, request, timeout=timeout, metrics=metrics), request
        )


@dataclass
class _Health:
    failures: int = 0
    cooled_until: float = 0.0


class Gateway:
    def __init__(
        self,
        config: ServeConfig,
        runtimes: dict,
        client: httpx.AsyncClient,
        metrics=None,
        rng: random.Random | None = None,
    ):
        self.config, self.metrics, self.rng = config, metrics, rng or random.Random()
        self.targets: dict = {name: LocalTarget(name, rt) for name, rt in runtimes.items()}
        for p in config.providers.values():
            for m in p.models:
                kind = AnthropicUpstream if p.api == "anthropic" else UpstreamTarget
                self.targets[f"{p.name}/{m}"] = kind(f"{p.name}/{m}", p, m, client)
        self.pools = {s.name: ReplicaPool(s, client, self.rng, metrics) for s in config.replicas.values()}
        for s in config.replicas.values():
            for m in s.models:
                self.targets[f"{s.name}/{m}"] = ReplicaTarget(f"{s.name}/{m}", s, m, self.pools[s.name], client)
        self.health: dict[str, _Health] = {name: _Health() for name in self.targets}
        self.draining = False

    def start(self) -> None:
        """Background work on the server's loop: the replicas' /health polls."""
        for pool in self.pools.values():
            pool.start()

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()

    def names(self) -> list[tuple[str, str]]:
        """(model id, owner) for /v1/models."""
        return [(n, self.targets[n].owner) for n in self.targets] + [(r, "headwise-route") for r in self.config.routes]

    def route(self, name: str) -> Route:
        if name in self.config.routes:
            return self.config.routes[name]
        if name in self.targets:
            return Route(name, (Target(name),), retries=0)
        raise APIError(
            404,
            f"model {name!r} does not exist here; available: {', '.join(n for n, _ in self.names())}",
            param="model",
            code="model_not_found",
        )

    def servable(self, route: Route, endpoint: str) -> Route:
        """`route` without the targets that cannot serve `endpoint`; a 400 when none can."""

        def serves(name: str) -> bool:
            return endpoint in getattr(self.targets[name], "endpoints", (endpoint,))

        targets = tuple(t for t in route.targets if serves(t.target))
        fallbacks = tuple(f for f in route.fallbacks if serves(f))
        if len(targets) == len(route.targets) and len(fallbacks) == len(route.fallbacks):
            return route
        if not targets and not fallbacks:
            why = "; ".join(dict.fromkeys(self.targets[t.target].refusal(endpoint) for t in route.targets))
            where = f"route {route.name!r}: " if route.name in self.config.routes else ""
            raise APIError(400, where + why, param="model", code="unsupported_endpoint")
        if not targets:
            targets, fallbacks = (Target(fallbacks[0]),), fallbacks[1:]
        return dataclasses.replace(route, targets=targets, fallbacks=fallbacks)

    def cooling(self, target: str, now: float) -> bool:
        return self.health[target].cooled_until > now

    def plan(self, route: Route) -> list[str]:
        """Targets to try, in order: weighted draws without replacement among those not
        cooling down (1 + retries of them), then the fallbacks."""
        now = time.monotonic()
        pool = [t for t in route.targets if not self.cooling(t.target, now)]
        order: list[str] = []
        while pool and len(order) < 1 + route.retries:
            pick = self.rng.choices(pool, weights=[t.weight for t in pool])[0]
            order.append(pick.target)
            pool = [t for t in pool if t.target != pick.target]
        order += [f for f in route.fallbacks if f not in order and not self.cooling(f, now)]
        if not order:
            everyone = [t.target for t in route.targets] + list(route.fallbacks)
            order = [min(everyone, key=lambda n: self.health[n].cooled_until)]
        return order

    def _attempt(self, route: Route, target: str, outcome: str) -> None:
        if self.metrics:
            self.metrics.attempt(route.name, target, outcome)

    def _health(self, route: Route, target: str, ok: bool) -> None:
        """The circuit breaker: a success resets the target's failures; enough in a row cool it down."""
        if route.name not in self.config.routes:
            return  # plain model names have no circuit breaker
        h = self.health[target]
        if ok:
            h.failures, h.cooled_until = 0, 0.0
        else:
            h.failures += 1
            if h.failures >= route.cooldown_failures:
                h.cooled_until = time.monotonic() + route.cooldown_seconds
                h.failures = 0
        if self.metrics:
            self.metrics.cooldown(target, h.cooled_until > time.monotonic())

    async def dispatch(self, endpoint: str, req: Incoming, request: Request) -> Response:
        """req: the body as the client sent it (passthrough.read), or a request model validated
        already (responses.py's chat request)."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="draining")
        incoming = req if isinstance(req, Incoming) else Incoming.of(endpoint, req)
        route = self.servable(self.route(incoming.model), endpoint)
        configured = route.name in self.config.routes
        timeout = route.timeout if configured else None
        last: APIError | None = None
        for name in self.plan(route):
            target = self.targets[name]
            if endpoint == "messages" and not getattr(target, "messages_native", False):
                target = ViaChat(target)  # an OpenAI-style target: Anthropic's request as chat, and back
            if getattr(target, "takes_raw", False):
                valid, body = None, incoming.raw  # an upstream decides what it accepts
            else:  # ours (local, replicas, the translation): the strict schema; its 400 is not retried
                valid, body = incoming.validated(), incoming.strict_body()
            later = getattr(target, "settles_streams", False) and bool(body.get("stream"))  # settles when it ends
            try:
                resp = await target.handle(
                    endpoint,
                    valid,
                    body,
                    request,
                    incoming.model,
                    timeout,
                    self.metrics,
                    settle=functools.partial(self._health, route, name),
                )
            except APIError as e:
                if not e.retryable:  # the client's mistake: says nothing about the target
                    self._attempt(route, name, "client_error")
                    raise
                self._attempt(route, name, "error")
                self._health(route, name, ok=False)
                last = e
                continue
            self._attempt(route, name, "ok")
            if not later:
                self._health(route, name, ok=True)
            resp.headers["x-headwise-target"] = name
            return resp
        assert last is not None
        raise last
