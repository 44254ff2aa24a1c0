"""Local models behind the API: a decoder runs in a headwise.Engine (continuous batching),
an encoder answers /v1/embeddings through headwise.embed.

Models load in a background thread after the server starts, so /health can say 503
until they are ready. Variants of one checkpoint (same source, dtype and attention backend;
say an fp32 and an int8 KV cache) share one loaded model: one set of weights, one engine
each. A model that fails to load is marked failed with its reason; when every one fails,
the server stops (`load_all`'s on_done). Requests reach the engine as token ids: the endpoints
(serve/openai) render chat templates and tokenize off the event loop; the engine's output
processor (runtime/output.py) turns the ids it samples into text and stop strings.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable

from .config import LocalModel
from .errors import APIError

log = logging.getLogger("headwise.serve")

Loader = Callable[[LocalModel], object]  # LocalModel -> a loaded headwise model
EMBED_BATCH = 16  # texts per embedding micro-batch: ~0.1-0.5 s of MiniLM on a CPU core, a fair turn


def weights_key(spec: LocalModel) -> tuple:
    """Specs with the same key load the same weights: they share one model object (a sharded
    model holds only rank 0's heads: its key is its own)."""
    return (spec.source, spec.dtype, spec.weights, spec.backend, spec.tensor_parallel)


def default_loader(spec: LocalModel):
    """headwise.load, or for a folder written by save_pruned / `headwise analyze` (it holds
    headwise_pruned.json) load_pruned with one KV-head count for every layer, as the engine's
    pool needs (analysis/prune.py), in the weights it was saved in."""
    import headwise
    from ..analysis.prune import is_pruned_dir, load_pruned

    if is_pruned_dir(spec.source):
        if spec.weights != "auto" or spec.dtype is not None:
            raise ValueError(
                f"{spec.source} is a pruned model, served in the weights it was saved in (GGUF blocks "
                f"or float); weights = {spec.weights!r} / dtype = {spec.dtype!r} cannot apply to it: "
                "leave both unset, or prune a model loaded with those weights"
            )
        return load_pruned(spec.source, backend=spec.backend, uniform_kv=True)
    return headwise.load(spec.source, weights=spec.weights, dtype=spec.dtype, backend=spec.backend)


class LocalRuntime:
    """One configured local model: its loading state, and then its engine or encoder."""

    def __init__(self, spec: LocalModel, loader: Loader = default_loader):
        self.spec, self.loader = spec, loader
        self.state = "loading"  # loading | ready | failed | stopped
        self.error: str | None = None
        self.model = self.tokenizer = self.engine = None
        self.kind: str | None = None  # "generate" (decoder) | "embed" (encoder), known once loaded
        self.max_model_len = 0
        self.loaded_at = time.time()
        self._embed_lock = threading.Lock()
        self._embed_turn: asyncio.Lock | None = None  # whose micro-batch runs next (embed)
        self._restart_lock = threading.Lock()
        self.tp = None  # serve/tensor_parallel.TensorParallel when spec.tensor_parallel > 1

    @property
    def name(self) -> str:
        return self.spec.name

    # ---- lifecycle (runs in the loader thread) ----------------------------------
    def load(self, shared: dict | None = None) -> None:
        """Load the model (or take it from `shared`, {weights_key: model} of the models loaded
        so far) and start its engine; on failure state = "failed" and error says why."""
        try:
            t0 = time.perf_counter()
            key = weights_key(self.spec)
            model = shared.get(key) if shared is not None else None
            reused = model is not None
            if self.spec.tensor_parallel > 1:
                from .tensor_parallel import TensorParallel

                self.tp = TensorParallel(self.spec, self.loader, on_failure=self._group_failed)
                model, reused, shared = self.tp.load(), False, None  # rank 0's share: no one else's to reuse
            elif not reused:
                model = self.loader(self.spec)
            self.model, self.tokenizer = model, getattr(model, "tokenizer", None)
            if self.tokenizer is None:
                raise ValueError(f"{self.spec.source} has no tokenizer; the API needs one to read text")
            if not reused:
                from ..models.packing import prepack

                prepack(model)  # the first request should not pay for reordering weights
                if shared is not None:
                    shared[key] = model
            if getattr(model.config, "causal", True):
                self.engine = self._make_engine(model)
                cap = self.spec.max_model_len
                if cap is not None and cap > self.engine.max_model_len:  # as vLLM: over the model's context is an error
                    raise ValueError(
                        f"[models.{self.name}] max_model_len = {cap:,} is over the model's context of "
                        f"{self.engine.max_model_len:,} tokens; give at most that (or leave it unset)"
                    )
                self.engine.start()
                self.max_model_len = min(self.engine.max_model_len, cap or 1 << 62)
                self.kind = "generate"
            else:
                self.max_model_len = model.config.max_positions
                self.kind = "embed"
            with self._restart_lock:
                if self.state != "loading":
                    return  # a tensor-parallel rank failed meanwhile (_group_failed says why)
                self.state = "ready"
            log.info(
                "model %s ready (%s, %.1f s%s%s)",
                self.name,
                self.kind,
                time.perf_counter() - t0,
                f"; {self.engine.kv_pool_line()}" if self.kind == "generate" else "",
                "; weights shared with an earlier variant" if reused else "",
            )
        except Exception as e:  # the server stays up and reports it
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", self.name, self.error)
            if self.tp is not None:
                self.tp.close(self.engine, timeout=0, release=False)

    def _make_engine(self, model):
        if self.tp is not None:
            return self.tp.lead(model)  # rank 0's engine: each step goes to the followers too
        from ..engine import Engine

        return Engine(model, config=self.spec.engine)

    def _group_failed(self, why: str) -> None:
        """A tensor-parallel rank is gone: this model stops serving (503, /health degraded), the others go on."""
        with self._restart_lock:
            if self.state in ("ready", "loading"):
                self.state, self.error = "failed", why
                log.error("model %s: %s", self.name, why)

    def shutdown(self, timeout: float | None = None) -> None:
        if self.tp is not None:
            # a whole group: release the followers (their follow() returns); else stop them
            self.tp.close(self.engine, timeout, release=self.state == "ready")
        elif self.engine is not None:
            self.engine.shutdown(timeout=timeout)
        self.state = "stopped"

    # ---- serving --------------------------------------------------------------
    def require(self, kind: str, endpoint: str) -> None:
        """503 while loading/failed, 400 when the model cannot do this endpoint."""
        if self.state == "loading":
            raise APIError(
                503, f"model {self.name!r} is still loading; retry shortly", code="model_loading", retry_after=2
            )
        if self.state != "ready":
            raise APIError(
                503, f"model {self.name!r} is unavailable: {self.error or self.state}", code="model_unavailable"
            )
        if self.kind != kind:
            use = "/v1/embeddings" if self.kind == "embed" else "/v1/chat/completions or /v1/completions"
            raise APIError(
                400, f"model {self.name!r} cannot serve {endpoint}; use {use}", param="model", code="wrong_endpoint"
            )

    async def stream(
        self, prompt: list[int], sampling, request_id: str, resume=None, direct=None, **fair
    ) -> AsyncIterator:
        """The engine's stream, QueueFull -> 429 + Retry-After, ValueError -> 400, a failed
        engine -> 500 (and a fresh engine for the requests that follow). resume: continue a
        completion another server began (runtime.output.Resume); direct: see Engine.stream;
        fair: priority, client, share (Engine.add_request; openai/streams.py fair_share)."""
        from ..engine import QueueFull

        engine = self.engine
        if resume is not None and sampling.seed is not None and not sampling.greedy:
            # the engine replays the seed's draws for the ids sent (runtime/sampling.py skip_draws):
            # 8,100 ids held this loop, /health and every stream, 8.7 s. Queued from a loop of its
            # own instead; direct writes off (their order rests on this loop reading every piece)
            gen = _on_own_loop(lambda: engine.stream(prompt, sampling, request_id=request_id, resume=resume, **fair))
        else:
            gen = engine.stream(prompt, sampling, request_id=request_id, resume=resume, direct=direct, **fair)
        try:
            while True:
                try:
                    piece = await gen.__anext__()
                except StopAsyncIteration:
                    return
                except QueueFull as e:
                    raise APIError(
                        429,
                        f"model {self.name!r} is at capacity ({e}); retry after the given time",
                        code="queue_full",
                        retry_after=getattr(e, "retry_after", 1.0),
                    ) from None
                except ValueError as e:
                    raise APIError(400, str(e), code="invalid_request") from None
                except RuntimeError as e:
                    if self.tp is not None:  # a rank failed (ParallelError): no new engine can run without it
                        why = await asyncio.to_thread(self.tp.describe, e.__cause__ or e)
                        self._group_failed(why)
                        raise APIError(
                            503, f"model {self.name!r} failed on this request: {why}", code="model_unavailable"
                        ) from None
                    self._restart_if_dead(engine, e)
                    raise APIError(
                        500,
                        f"model {self.name!r} failed on this request ({e.__cause__ or e}); its engine was restarted",
                        code="engine_error",
                    ) from None
                yield piece
        finally:
            engine.abort(request_id)  # no-op once finished; frees blocks at once otherwise
            await gen.aclose()

    def _restart_if_dead(self, engine, error: BaseException) -> None:
        """An engine whose step raised stops for everyone (Engine._fail); the model itself is
        fine, so build a new engine instead of leaving the model down until a restart."""
        with self._restart_lock:
            if engine is not self.engine:
                return  # another request already replaced it
            try:
                engine.start()  # raises only when the engine has failed
                return
            except RuntimeError:
                pass
            log.error("model %s: engine failed (%s); starting a new one", self.name, error.__cause__ or error)
            self.engine = self._make_engine(self.model)
            self.engine.start()
            engine.shutdown(timeout=0)

    def abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)

    def abort_all(self) -> int:
        """End every request of this model now: each stream gets its abort piece (the API
        turns it into an error event and [DONE]); -> how many."""
        return self.engine.abort_all() if self.engine is not None else 0

    async def embed(self, texts: list[str] | list[list[int]], batch_size: int = EMBED_BATCH):
        """(N, C) fp32 vectors for texts or their token ids, computed off the event loop in
        micro-batches of `batch_size` texts.
        Between two batches the model goes to the request that has waited longest (asyncio.Lock
        wakes waiters in order), so requests take turns: a 2,048-input request held the model for
        minutes while a one-line request waited; now the short one waits for one batch."""
        import torch

        from ..models.embeddings import embed

        def run(chunk):
            with self._embed_lock:  # a cancelled request's batch may still be running
                return embed(self.model, chunk)

        if self._embed_turn is None:
            self._embed_turn = asyncio.Lock()  # made on the server's loop
        out = []
        for start in range(0, len(texts), batch_size):
            async with self._embed_turn:
                out.append(await asyncio.to_thread(run, texts[start : start + batch_size]))
        return torch.cat(out)

    def card(self) -> dict | None:
        """What /v1/models lists beside the OpenAI fields (under "headwise"), once loaded:
        parameters, the KV bytes a token takes in this engine's pool, and for a pruned model
        the quality `headwise analyze` measured and each layer's KV heads."""
        if self.state != "ready":
            return None
        from ..analysis.prune import param_count
        from ..runtime.paged import kv_pool_info

        pruned = getattr(self.model, "pruned", None)
        info: dict = {"parameters": (pruned or {}).get("parameters") or param_count(self.model)}
        if self.engine is not None:  # measured on the pool itself: what its tensors take per token slot
            pool = kv_pool_info(self.engine.cache)  # (rank 0's heads when tensor-parallel: each rank holds as much)
            types = pool["layer_types"]  # global, and sliding layers with their window (they keep only it)
            info["kv_bytes_per_token"] = sum(t["kv_bytes_per_token"] for t in types)
            info["kv_pool_blocks"] = pool["blocks"]
            if any(t["window"] is not None for t in types):
                info["kv_layer_types"] = types
        if self.tp is not None:
            info["tensor_parallel"] = self.tp.size
        if pruned is not None:
            info["pruned"] = {"kv_heads_per_layer": pruned["kv_heads"]}
            info["quality"] = pruned.get("quality")
        return info

    def stats(self) -> dict:
        if self.engine is None or self.state != "ready":
            return {}
        return self.engine.stats().as_dict()


async def _on_own_loop(make: Callable[[], AsyncIterator]) -> AsyncIterator:
    """The items of the async iterator make() returns, which runs on an event loop of its own in a
    worker thread (for what would hold this loop); its exception is raised here. Once this
    generator is closed, the worker stops at the next item (closing make()'s iterator)."""
    loop, queue, stop, end = asyncio.get_running_loop(), asyncio.Queue(), threading.Event(), object()

    def hand(item, error=None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))
        except RuntimeError:  # the server's loop is closed: no one reads any more
            stop.set()

    async def drain() -> None:
        try:
            async for item in make():
                hand(item)
                if stop.is_set():
                    break  # leaving the loop closes make()'s iterator (an engine stream: aborted)
        except BaseException as e:  # QueueFull, ValueError, an engine failure: the reader's to map
            hand(end, e)
            return
        hand(end)

    threading.Thread(target=asyncio.run, args=(drain(),), name="headwise-own-loop", daemon=True).start()
    try:
        while True:
            item, error = await queue.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()


def load_all(
    runtimes: list[LocalRuntime],
    on_done: Callable[[list[LocalRuntime]], None] | None = None,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """Load every model, one after the other, in a daemon thread (the server answers meanwhile);
    variants of the same weights share one model. Then on_done(runtimes). Once `stop` is set, the
    models not begun are not loaded (state "stopped") and on_done is not called: the server is
    stopping (a load under way cannot be interrupted; cli/startup.py says how the process ends)."""

    def run():
        shared: dict = {}
        for i, rt in enumerate(runtimes):
            if stop is not None and stop.is_set():
                for left in runtimes[i:]:
                    left.state, left.error = "stopped", "the server stopped before this model loaded"
                return
            rt.load(shared)
        if on_done is not None:
            on_done(runtimes)

    t = threading.Thread(target=run, name="headwise-loader", daemon=True)
    t.start()
    return t
