"""Replicas behind the gateway: which one gets a request, and which are up.

    pool = ReplicaPool(spec, client)        # spec: config.ReplicaSet; one pool per [replicas.NAME]
    pool.start()                            # polls each replica's /health (on the running loop)
    replica = pool.pick("tiny", affinity_key("chat", body, 256))

Routing. A request whose prompt is long enough to share a prefix with others (its first
`affinity_chars` characters: an agent's system prompt, a document asked about again) goes to
its preferred replica, whose prefix cache already holds that prefix: rendezvous hashing
(Thaler & Ravishankar 1998) over the replicas that are up, so when one leaves, only its own
prefixes move (to their second choice, which keeps them together), and when it comes back they
return. The preference yields when that replica has more than `affinity_slack` requests in flight
beyond the least busy one. Every other request goes to the less busy of two replicas drawn at
random (power of two choices, Mitzenmacher 2001): close to least-loaded, without every request of
a burst herding onto the one replica that looked idlest a moment ago.

Health. Each replica's /health is polled every `health_interval` seconds in the background: 200
with the model "ready" is up. Passive checks act at once: a connection error, a 503 or a stream
that breaks takes a replica out of the rotation (failover.py), and only a good /health brings it
back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from dataclasses import dataclass

import httpx

from .config import ReplicaSet

log = logging.getLogger("headwise.serve")


@dataclass(eq=False)
class Replica:
    url: str
    up: bool = True  # until a check says otherwise: a fresh gateway serves at once
    states: dict | None = None  # its /health's "models": name -> loading | ready | failed (None: not said)
    in_flight: int = 0  # requests (and streams) the gateway has open on it now
    why: str = ""  # why it is down

    def serves(self, model: str) -> bool:
        """Up, and the model ready there; a model its /health does not list (a nested gateway's
        route or replica set) counts as served."""
        return self.up and (self.states is None or self.states.get(model, "ready") == "ready")


def affinity_key(endpoint: str, body: dict, chars: int) -> str | None:
    """The first `chars` characters of a request's prompt (chat: roles and contents in order), or
    None when the prompt is shorter (nothing long to share) or the endpoint keeps no cache."""
    if chars <= 0 or endpoint == "embeddings":
        return None
    if endpoint == "chat":
        parts = []
        for m in body.get("messages", ()):
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content)
            parts.append(f"\x1e{m.get('role')}\x1f{content or ''}")
        text = "".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt stands for it
        text = prompt if isinstance(prompt, str) else ",".join(map(str, prompt or ()))
    return text[:chars] if len(text) >= chars else None


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest(), "big")


class ReplicaPool:
    """The replicas of one [replicas.NAME]: their health, their load, the pick."""

    def __init__(self, spec: ReplicaSet, client: httpx.AsyncClient, rng: random.Random | None = None, metrics=None):
        self.spec, self.client, self.metrics = spec, client, metrics
        self.rng = rng or random.Random()
        self.replicas = [Replica(u) for u in spec.urls]
        self._task: asyncio.Task | None = None
        for r in self.replicas:
            self._gauge(r)

    # ---- routing ----------------------------------------------------------------
    def pick(self, model: str, key: str | None, exclude=()) -> tuple[Replica | None, str]:
        """-> (the replica for a request, how it was chosen: "affinity" | "balanced"), or
        (None, "") when none that serves `model` is up (outside `exclude`)."""
        live = [r for r in self.replicas if r.serves(model) and r not in exclude]
        if not live:
            return None, ""
        if key is not None:
            key = f"{model}\0{key}"  # models of one set keep separate caches
            best = max(live, key=lambda r: _score(key, r.url))
            if best.in_flight <= min(r.in_flight for r in live) + self.spec.affinity_slack:
                return best, "affinity"
        if len(live) == 1:
            return live[0], "balanced"
        a, b = self.rng.sample(live, 2)
        if a.in_flight == b.in_flight:
            return self.rng.choice((a, b)), "balanced"
        return (a if a.in_flight < b.in_flight else b), "balanced"

    def reasons(self, model: str) -> str:
        """Why no replica serves `model` now, for an error message."""
        out = []
        for r in self.replicas:
            if not r.up:
                out.append(f"{r.url}: {r.why or 'down'}")
            elif not r.serves(model):
                out.append(f"{r.url}: model {model!r} is {r.states.get(model)} there")
        return "; ".join(out) or "none up"

    # ---- health -----------------------------------------------------------------
    def down(self, r: Replica, why: str) -> None:
        """Out of the rotation until /health says 200 again."""
        if r.up:
            log.warning("replica %s is down (%s); skipped until its /health answers 200", r.url, why)
        r.up, r.why = False, why
        self._gauge(r)

    def _up(self, r: Replica, states: dict | None) -> None:
        if not r.up:
            log.info("replica %s is back (its /health answers 200)", r.url)
        r.up, r.why, r.states = True, "", states
        self._gauge(r)

    def _gauge(self, r: Replica) -> None:
        if self.metrics:
            self.metrics.replica_up(self.spec.name, r.url, r.up)

    async def check(self, r: Replica) -> None:
        """One /health poll of one replica."""
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        try:
            resp = await self.client.get(
                r.url + "/health", headers=headers, timeout=min(5.0, max(1.0, self.spec.health_interval))
            )
        except httpx.HTTPError as e:
            return self.down(r, f"/health unreachable ({type(e).__name__})")
        if resp.status_code != 200:
            return self.down(r, f"/health answered {resp.status_code}")
        try:
            models = resp.json().get("models")
        except (ValueError, AttributeError):
            models = None
        self._up(r, models if isinstance(models, dict) else None)

    async def _poll(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self.check(r) for r in self.replicas))
            except Exception:  # a poll that breaks must not end polling for good
                log.exception("replicas %s: health poll failed", self.spec.name)
            await asyncio.sleep(self.spec.health_interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll(), name=f"replicas-{self.spec.name}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
