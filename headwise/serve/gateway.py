"""The gateway: a model name -> a route -> targets (local engines or upstream providers).

A route draws a target by weight; on a retryable failure (overload, loading, upstream
down or timing out) it draws again among the others, up to `retries` more times, then
tries each fallback in order. Retry and fallback happen only before the first byte
reaches the client: every target hands back a response whose first piece has already
arrived. A target that fails `cooldown_failures` times in a row is skipped for
`cooldown_seconds` (a circuit breaker); when every target of a route is cooling down,
the one whose cooldown ends first is probed rather than failing outright.
A plain model name is a route of one target with no retries and no cooldown.
Upstream URLs and keys come only from the config.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .config import Provider, Route, ServeConfig, Target
from .errors import APIError
from .openai import chat, completions, embeddings
from .openai.common import SSE_DONE, sse

PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}
HANDLERS = {"chat": chat.create, "completions": completions.create, "embeddings": embeddings.create}


class LocalTarget:
    owner = "headwise"

    def __init__(self, name: str, runtime):
        self.name, self.runtime = name, runtime

    async def handle(self, endpoint: str, req, body: dict, request: Request, model: str, timeout, metrics):
        return await HANDLERS[endpoint](self.runtime, req, model, request, timeout=timeout, metrics=metrics)


class UpstreamTarget:
    """An OpenAI-compatible server; requests are forwarded with `model` renamed, answers
    (and streams, event for event) passed back. The timeout covers the wait for the first
    byte: for a non-streamed answer, the whole answer."""

    def __init__(self, name: str, provider: Provider, model: str, client: httpx.AsyncClient):
        self.name, self.provider, self.model, self.client = name, provider, model, client
        self.owner = provider.name

    def _error(self, status: int, content: bytes, headers) -> APIError:
        try:
            body = json.loads(content)
            message = body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)[:300]
        except (ValueError, KeyError, TypeError, AttributeError):
            body, message = None, content[:300].decode("utf-8", "replace")
        where = f"upstream {self.provider.name}"
        if status in (400, 413, 422):               # the client's request: the same anywhere, not retried
            envelope = body if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
            return APIError(400 if status == 422 else status, f"{where}: {message}", body=envelope)
        if status == 429:
            retry = headers.get("retry-after")
            return APIError(429, f"{where} is rate limiting: {message}", code="upstream_rate_limited",
                            retry_after=float(retry) if retry and retry.isdigit() else None)
        if status in (401, 403):                    # our configured key, not the client's
            return APIError(502, f"{where} refused the configured key ({status}); check {self.provider.api_key_env}",
                            code="upstream_auth")
        return APIError(502, f"{where} answered {status}: {message}", code="upstream_error")

    async def handle(self, endpoint: str, req, body: dict, request: Request, model: str, timeout, metrics):
        url = self.provider.base_url.rstrip("/") + PATHS[endpoint]
        headers = {"Authorization": f"Bearer {self.provider.api_key}"} if self.provider.api_key else {}
        limit = timeout or self.provider.timeout
        upstream = self.client.build_request("POST", url, json={**body, "model": self.model}, headers=headers,
                                             timeout=httpx.Timeout(self.provider.timeout, connect=limit))
        resp, streaming = None, False
        try:
            async with asyncio.timeout(limit):      # until the first byte
                resp = await self.client.send(upstream, stream=True)
                if resp.status_code != 200:
                    raise self._error(resp.status_code, await resp.aread(), resp.headers)
                if not body.get("stream"):
                    content = await resp.aread()
                    return Response(content, media_type=resp.headers.get("content-type", "application/json"))
                chunks = resp.aiter_bytes()         # decoded: the upstream may gzip, our answer does not
                first = await anext(chunks, b"")
                streaming = True
        except TimeoutError:
            raise APIError(504, f"upstream {self.provider.name} sent nothing within {limit:g} s",
                           code="upstream_timeout") from None
        except httpx.HTTPError as e:
            raise APIError(502, f"upstream {self.provider.name} is unreachable ({type(e).__name__})",
                           code="upstream_unreachable") from None
        finally:
            if resp is not None and not streaming:
                await resp.aclose()

        async def passthrough():
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as e:
                yield sse(APIError(502, f"upstream {self.provider.name} broke off the stream "
                                        f"({type(e).__name__})", code="upstream_error").body())
                yield SSE_DONE
            finally:
                await resp.aclose()                 # a client that hangs up closes the upstream stream too
        return StreamingResponse(passthrough(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


@dataclass
class _Health:
    failures: int = 0
    cooled_until: float = 0.0


class Gateway:
    def __init__(self, config: ServeConfig, runtimes: dict, client: httpx.AsyncClient, metrics=None,
                 rng: random.Random | None = None):
        self.config, self.metrics, self.rng = config, metrics, rng or random.Random()
        self.targets: dict = {name: LocalTarget(name, rt) for name, rt in runtimes.items()}
        for p in config.providers.values():
            for m in p.models:
                self.targets[f"{p.name}/{m}"] = UpstreamTarget(f"{p.name}/{m}", p, m, client)
        self.health: dict[str, _Health] = {name: _Health() for name in self.targets}
        self.draining = False

    def names(self) -> list[tuple[str, str]]:
        """(model id, owner) for /v1/models."""
        return [(n, self.targets[n].owner) for n in self.targets] + [(r, "headwise-route") for r in self.config.routes]

    def route(self, name: str) -> Route:
        if name in self.config.routes:
            return self.config.routes[name]
        if name in self.targets:
            return Route(name, (Target(name),), retries=0)
        raise APIError(404, f"model {name!r} does not exist here; available: {', '.join(n for n, _ in self.names())}",
                       param="model", code="model_not_found")

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

    def _outcome(self, route: Route, target: str, ok: bool) -> None:
        if self.metrics:
            self.metrics.attempt(route.name, target, "ok" if ok else "error")
        if route.name not in self.config.routes:
            return                                  # plain model names have no circuit breaker
        h = self.health[target]
        if ok:
            h.failures, h.cooled_until = 0, 0.0
            return
        h.failures += 1
        if h.failures >= route.cooldown_failures:
            h.cooled_until = time.monotonic() + route.cooldown_seconds
            h.failures = 0
        if self.metrics:
            self.metrics.cooldown(target, h.cooled_until > time.monotonic())

    async def dispatch(self, endpoint: str, req, request: Request) -> Response:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="draining")
        route = self.route(req.model)
        configured = route.name in self.config.routes
        timeout = route.timeout if configured else None
        body = req.model_dump(mode="json", exclude_unset=True)     # what the client set, validated
        last: APIError | None = None
        for name in self.plan(route):
            try:
                resp = await self.targets[name].handle(endpoint, req, body, request, req.model, timeout,
                                                       self.metrics)
            except APIError as e:
                if not e.retryable:                 # the client's mistake: says nothing about the target
                    if self.metrics:
                        self.metrics.attempt(route.name, name, "client_error")
                    raise
                self._outcome(route, name, ok=False)
                last = e
                continue
            self._outcome(route, name, ok=True)
            if self.metrics:
                self.metrics.cooldown(name, False)
            resp.headers["x-headwise-target"] = name
            return resp
        assert last is not None
        raise last
