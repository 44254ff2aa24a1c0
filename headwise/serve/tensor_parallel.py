"""One served model's heads over N processes: `tensor_parallel = N` / `headwise serve MODEL --tensor-parallel N`.

The server process is rank 0: it loads the model, keeps its share of the heads (parallel.shard)
and runs the engine as every local model does, through parallel.lead(), which sends each step
to the followers. The N - 1 followers are local processes (parallel.RankGroup: the fork server
and file store of parallel.spawn) that load the same model with the same loader and spec,
shard it and replay rank 0's steps (parallel.follow) until shutdown releases them.

    tp = TensorParallel(spec, loader, on_failure=runtime_failed)
    model = tp.load()              # every rank has loaded and sharded, or an error names the rank
    engine = tp.lead(model)        # a headwise.Engine, used as any local model's
    tp.close(engine, timeout)      # release the followers, join them (kill stragglers)

A follower that exits (crash, OOM killer, kill -9) is seen at once by a watchdog thread
(on_failure: the model is marked failed, /health says degraded, requests get 503); rank 0's
collectives with it fail with ParallelError instead of hanging; one that stops answering
while alive fails the step after GROUP_TIMEOUT_S. Either way the model stays down until the
server restarts (the ranks run every step together: none can go on alone); the server's
other models go on serving.
"""

from __future__ import annotations

import json
import logging
import pickle
import threading
import time
from typing import Callable

from .config import ConfigError, LocalModel

log = logging.getLogger("headwise.serve")

# How long rank 0 waits in a collective for a follower that is alive but silent (also for the
# followers to finish loading once rank 0 has): then the step fails with ParallelError.
GROUP_TIMEOUT_S = 60.0


def check(spec: LocalModel) -> None:
    """ConfigError naming the problem when `spec.tensor_parallel` cannot work, as far as the files
    tell without loading weights (a checkpoint's config.json, a GGUF's metadata); the rest
    (a pruned folder's heads, say) shard() checks when the model loads."""
    N = spec.tensor_parallel
    if N == 1:
        return
    from ..models.sources import model_task
    from ..parallel.shard import check_kv_heads

    where = f"model {spec.name!r} (tensor_parallel = {N})"
    if model_task(spec.source) == "embed":
        raise ConfigError(
            f"{where}: {spec.source} is an embedding model; tensor parallelism serves decoders (chat and "
            "completions, through the engine), not /v1/embeddings: leave tensor_parallel unset for it"
        )
    kv = kv_heads(spec.source)
    if kv is not None:
        try:
            check_kv_heads(kv, N)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None


def kv_heads(source: str) -> list[int] | None:
    """The KV-head counts of a model, read without loading it; None when the files don't say."""
    from ..models.sources import find

    try:
        path = find(source).path
        if path.is_file():
            from ..models.gguf import open_gguf
            from ..models.gguf_meta import read_metadata

            meta = read_metadata(open_gguf(path))
            arch = meta["general.architecture"]
            kv = meta.get(f"{arch}.attention.head_count_kv") or meta[f"{arch}.attention.head_count"]
            return [int(h) for h in kv] if isinstance(kv, list) else [int(kv)]
        from ..analysis.prune import is_pruned_dir

        if path.is_dir() and not is_pruned_dir(path):
            from ..models.loading import family_of

            hf = json.loads((path / "config.json").read_text())
            return [family_of(hf).config_from_hf(hf).num_kv_heads]
    except Exception:  # noqa: BLE001 - unreadable here: the load says what is wrong
        return None
    return None


def _follower(comm, spec: LocalModel, loader) -> int:
    """Rank r > 0 (a RankGroup process): load and shard as rank 0 does, then replay its steps."""
    import torch

    from ..models.packing import prepack
    from ..parallel import follow, shard

    model = shard(loader(spec), comm)
    prepack(model)
    comm.all_reduce(torch.zeros(1), "the ranks' start")  # rank 0 learns that every rank has its share
    return follow(model, comm, spec.engine)


class TensorParallel:
    """Rank 0 of one served model's group: its followers, its sharded model, its lead engine."""

    def __init__(self, spec: LocalModel, loader: Callable, on_failure: Callable[[str], None]):
        self.spec, self.loader, self.on_failure = spec, loader, on_failure
        self.group = None
        self._stopping = False

    @property
    def size(self) -> int:
        return self.spec.tensor_parallel

    def load(self):
        """Start the followers, load and shard rank 0's model; returns once every rank holds its
        share (or raises, naming the rank that failed, with the followers stopped)."""
        import torch

        from ..models.packing import prepack
        from ..parallel import ParallelError, RankGroup, shard

        try:
            pickle.dumps(self.loader)
        except Exception as e:  # noqa: BLE001 - pickle raises several kinds
            raise ValueError(
                f"tensor_parallel needs a loader the follower processes can import by name (a module-level "
                f"function), got {self.loader!r} ({e})"
            ) from None
        # as many torch threads per follower as this process uses (OMP_NUM_THREADS sets both)
        self.group = RankGroup(
            _follower, self.size, self.spec, self.loader, threads=torch.get_num_threads(), timeout_s=GROUP_TIMEOUT_S
        )
        followers = ", ".join(f"rank {rank}: pid {pid}" for rank, pid in self.group.pids().items())
        log.info("model %s: tensor-parallel followers started (%s)", self.spec.name, followers)
        try:
            model = self.loader(self.spec)
            if not getattr(model.config, "causal", True):
                raise ValueError(
                    f"{self.spec.source} is an encoder; tensor_parallel serves decoders (chat, completions) only"
                )
            shard(model, self.group.comm)  # raises naming the legal sizes when N does not divide the KV heads
            prepack(model)
            self.group.comm.all_reduce(torch.zeros(1), "the ranks' start")
        except ParallelError as e:  # a follower failed: say which and why, not just that the call failed
            why = self.group.failure(wait_s=2.0)
            self.group.close(timeout=0)
            raise RuntimeError(f"tensor-parallel {why or e}") from None
        except BaseException:
            self.group.close(timeout=0)
            raise
        threading.Thread(target=self._watch, name=f"headwise-tp-watch-{self.spec.name}", daemon=True).start()
        return model

    def lead(self, model):
        from ..parallel import lead

        return lead(model, self.group.comm, self.spec.engine)

    def _watch(self) -> None:
        why = self.group.wait_failure()
        if why is not None and not self._stopping:
            self.on_failure(self.describe(why))

    def describe(self, cause: BaseException | str | None = None, wait_s: float = 5.0) -> str:
        """Why the model cannot serve: `cause`, and a follower's exit when it shows within wait_s
        (a collective fails as the follower's sockets close, a moment before its exit is seen)."""
        deadline = time.monotonic() + wait_s
        why = None
        while self.group is not None:
            why = self.group.failure(wait_s=0.2)
            if why is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if isinstance(cause, BaseException):
            cause = f"{type(cause).__name__}: {cause}"
        parts = [p for p in dict.fromkeys((why, cause)) if p]
        return (
            f"its tensor-parallel group of {self.size} processes failed ({'; '.join(parts) or 'unknown'}); "
            "every rank runs each step, so the model is down until the server restarts"
        )

    def close(self, engine=None, timeout: float | None = None, *, release: bool = True) -> None:
        """Shut `engine` down and, with `release` and every follower running, release the followers
        (their follow() returns); then wait for them to exit, killing any still running after
        `timeout` s (at most 10)."""
        from ..parallel import ParallelError
        from ..parallel import release as release_followers

        self._stopping = True
        if self.group is None:
            return
        if engine is not None:
            try:
                if release and self.group.failure(wait_s=0) is None:
                    release_followers(engine)
                else:
                    engine.shutdown(timeout=0)
            except (ParallelError, RuntimeError) as e:
                log.warning("model %s: releasing the tensor-parallel ranks failed: %s", self.spec.name, e)
        outcomes = self.group.close(timeout=10.0 if timeout is None else min(timeout, 10.0))
        for o in outcomes:
            if not o.ok and "killed" in o.error:
                log.warning("model %s: tensor-parallel rank %d: %s", self.spec.name, o.rank, o.error)
