"""GET /metrics: Prometheus text, one registry per app (so several apps can share a process).

Request latencies are measured here, where the client sees them, with the names and
meaning of vLLM's: time to first token, inter-token latency, end-to-end latency. The
engine's own counters (running, waiting, KV blocks used/free, preemptions, prefix-cache
hits, tokens, ...) are read from `Engine.stats()` at scrape time, one gauge per field,
labelled by model, so a new stats field shows up without touching this file.
"""

from __future__ import annotations

import re
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class EngineCollector:
    """headwise_engine_<field>{model=...} for every numeric field of each engine's stats."""

    def __init__(self, runtimes: dict):
        self.runtimes = runtimes

    def collect(self):
        families: dict[str, GaugeMetricFamily] = {}
        ready = GaugeMetricFamily("headwise_model_ready", "1 when the model is loaded and serving", labels=["model"])
        for name, rt in self.runtimes.items():
            ready.add_metric([name], 1.0 if rt.state == "ready" else 0.0)
            for key, value in _flatten(rt.stats()):
                metric = "headwise_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                if metric not in families:
                    families[metric] = GaugeMetricFamily(metric, f"Engine.stats() field {key}", labels=["model"])
                families[metric].add_metric([name], float(value))
        yield ready
        yield from families.values()


def _flatten(stats: dict, prefix: str = ""):
    for key, value in stats.items():
        if isinstance(value, bool) or isinstance(value, (int, float)):
            yield prefix + key, value
        elif isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}_")
        # lists (latency samples) are left out: the histograms below measure the same at the API


class Metrics:
    def __init__(self, runtimes: dict):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "headwise_requests",
            "API requests by model, endpoint and HTTP status",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "headwise_time_to_first_token_seconds",
            "request arrival to first generated text",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "headwise_inter_token_latency_seconds",
            "time between generated tokens",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "headwise_e2e_request_latency_seconds", "request arrival to last token", ["model"], buckets=_E2E, registry=r
        )
        self.direct_chunks = Counter(
            "headwise_stream_direct_chunks",
            "streamed chunks the engine's thread wrote to the client's socket itself (serve/direct.py)",
            ["model"],
            registry=r,
        )
        self.attempts = Counter(
            "headwise_gateway_attempts",
            "gateway attempts by route, target and outcome",
            ["route", "target", "outcome"],
            registry=r,
        )
        self.cooling = Gauge(
            "headwise_gateway_target_cooling_down", "1 while a target is skipped after failures", ["target"], registry=r
        )
        self.faults = Counter(
            "headwise_gateway_upstream_faults",
            "broken upstream answers by target and kind "
            "(invalid_json, bad_shape, truncated, error_event, broken, oversized)",
            ["target", "kind"],
            registry=r,
        )
        self.replica_requests = Counter(
            "headwise_gateway_replica_requests",
            "requests sent to each replica, by how it was chosen (affinity, balanced, retry, resume)",
            ["target", "replica", "how"],
            registry=r,
        )
        self.replica_is_up = Gauge(
            "headwise_gateway_replica_up", "1 while a replica is in the rotation", ["replicas", "replica"], registry=r
        )
        self.failovers = Counter(
            "headwise_gateway_failovers",
            "streams whose replica died mid-way, by outcome (resumed on another replica, failed)",
            ["target", "outcome"],
            registry=r,
        )
        r.register(EngineCollector(runtimes))

    def token_piece(self, model: str, streams, piece) -> None:
        """Per streamed piece: the labelled child looked up once per stream (labels() costs a lock
        and a tuple per call, on the event loop thread, every token)."""
        now = time.perf_counter()
        last = getattr(streams, "t_last", None)
        if last is None:
            self.ttft.labels(model).observe(now - streams.t_start)
            streams.itl_child = self.itl.labels(model)
        elif piece.token_ids:
            gap = (now - last) / len(piece.token_ids)
            for _ in piece.token_ids:
                streams.itl_child.observe(gap)
        streams.t_last = now

    def finished(self, model: str, streams) -> None:
        self.e2e.labels(model).observe(time.perf_counter() - streams.t_start)

    def stream_closed(self, model: str, direct) -> None:
        """A streamed answer's end: count the chunks its engine thread wrote (a DirectWriter)."""
        if direct is not None and direct.written:
            self.direct_chunks.labels(model).inc(direct.written)

    def request(self, model: str, endpoint: str, status: int) -> None:
        self.requests.labels(model, endpoint, str(status)).inc()

    def attempt(self, route: str, target: str, outcome: str) -> None:
        self.attempts.labels(route, target, outcome).inc()

    def cooldown(self, target: str, cooling: bool) -> None:
        self.cooling.labels(target).set(1.0 if cooling else 0.0)

    def replica_request(self, target: str, replica: str, how: str) -> None:
        self.replica_requests.labels(target, replica, how).inc()

    def replica_up(self, replicas: str, replica: str, up: bool) -> None:
        self.replica_is_up.labels(replicas, replica).set(1.0 if up else 0.0)

    def failover(self, target: str, outcome: str) -> None:
        self.failovers.labels(target, outcome).inc()

    def fault(self, target: str, kind: str) -> None:
        self.faults.labels(target, kind).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
