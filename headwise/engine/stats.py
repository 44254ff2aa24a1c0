"""What `Engine.stats()` returns: counts, pool use, time per part of a step, latency percentiles."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SAMPLES = 4096  # latency samples kept (ttft, inter-token): the most recent ones


class Samples(list):
    """Recent latency samples in seconds (a plain list), shown as percentiles: printing
    4,096 floats says nothing. `summary()` -> {"count", "p50", "p90", "p99"} (None when empty)."""

    def summary(self) -> dict:
        xs = sorted(self)
        if not xs:
            return {"count": 0, "p50": None, "p90": None, "p99": None}

        def pct(q):  # nearest rank
            return xs[min(len(xs) - 1, max(0, -(-len(xs) * q // 100) - 1))]

        return {"count": len(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99)}

    def __repr__(self) -> str:
        d = self.summary()
        if not d["count"]:
            return "Samples(count=0)"
        return (
            f"Samples(count={d['count']}, " + ", ".join(f"{k}={d[k] * 1e3:.1f}ms" for k in ("p50", "p90", "p99")) + ")"
        )


@dataclass
class EngineStats:
    running: int  # sequences holding KV blocks (a request with n > 1 counts n)
    waiting: int  # sequences queued, preempted ones included
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_block_size: int
    preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix table on admission
    prefix_cache_hits: int  # of those, found: their K/V was shared, not recomputed
    prompt_tokens: int  # accepted requests' prompt tokens
    prefill_tokens: int  # prompt (and recomputed) tokens run through the model: an aborted
    # request that never got scheduled adds none
    output_tokens: int  # generated tokens
    requests_finished: int  # stop or length
    requests_aborted: int
    steps: int
    step_seconds: dict[str, float]  # time spent per part of all steps: schedule (+ building the packed
    # step), forward, output (sampling, detokenizing, bookkeeping)
    ttft_s: Samples  # recent time-to-first-token samples, seconds (repr: percentiles)
    itl_s: Samples  # recent inter-token latency samples, seconds
    decode_tokens_per_second: float | None  # tokens after each request's first / the time they took,
    # over finished/aborted requests; None before any had 2 tokens
    weight_bytes: dict[str, int]  # the model's weights by storage format ("q4_1", "q8_0", "float32", ...)
    # Predicted Outputs (runtime/predict.py): draft tokens computed beside decodes, and of those the
    # ones the output took (the rest was computed for nothing)
    draft_tokens: int = 0
    draft_tokens_accepted: int = 0
    threads: int = 0  # torch threads the last step ran with: the cores other processes leave, or a
    # pinned count (HEADWISE_THREADS, --threads); /metrics: headwise_engine_threads

    def as_dict(self) -> dict:
        """Plain numbers: the latency samples as {"count", "p50", "p90", "p99"}."""
        d = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "itl_s")}
        return {**d, "ttft_s": self.ttft_s.summary(), "itl_s": self.itl_s.summary()}
