"""`EngineCore`: the one loop (core.py) over the paged KV pool with continuous batching.

    core = EngineCore(model, EngineConfig(num_blocks=128, block_size=4))

What the `Engine` and `headwise serve` step: the scheduler (scheduler.py) fills a token budget
from running and waiting requests, the runner (runner.py) packs them into one forward.
"""

from __future__ import annotations

import threading

from ..cache.paged import PagedKVCache
from .config import EngineConfig
from .core import Core, check_decoder
from .runner import PagedRunner
from .scheduler import Scheduler


class EngineCore(Core):
    def __init__(self, model, config: EngineConfig | None = None, *, lock: threading.RLock | None = None):
        check_decoder(model)
        cfg = model.config
        param = next(model.parameters())
        self.config = (config or EngineConfig()).resolve(cfg, param.dtype)  # every size known from here
        c = self.config
        # Sequences start at fixed-stride regions of the pool while there is room (decodes of all of
        # them read as one strided view), else mid-way into the largest free stretch (each stays one
        # consecutive run, read in place); see cache/packed.py.
        self.cache = PagedKVCache(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            c.num_blocks,
            c.block_size,
            dtype=param.dtype,
            device=param.device,
            kv_dtype=c.kv_dtype,
            spread=True,
            region_blocks=max(1, c.num_blocks // c.max_num_seqs),
        )
        scheduler = Scheduler(self.cache, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens)
        runner = PagedRunner(model, self.cache)
        super().__init__(model, scheduler, runner, max_model_len=c.max_model_len(cfg), lock=lock)
        self.dtype = param.dtype

    def limit_source(self) -> str:
        return (
            f"the model's context of {self.model.config.max_positions} tokens, or the KV pool's "
            f"{self.cache.num_blocks} blocks x {self.config.block_size} tokens"
        )
