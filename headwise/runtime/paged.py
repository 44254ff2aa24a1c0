"""`EngineCore`: the one loop (core.py) over the paged KV pool with continuous batching.

    core = EngineCore(model, EngineConfig(num_blocks=128, block_size=4))

What the `Engine` and `headwise serve` step: the scheduler (scheduler.py) fills a token budget
from running and waiting requests, the runner (runner.py) packs them into one forward.
"""

from __future__ import annotations

import threading

from ..cache.hybrid import HybridPagedKVCache
from ..cache.paged import PagedKVCache
from ..core.plan import kv_layer_groups
from .config import EngineConfig
from .core import Core, check_decoder
from .runner import PagedRunner
from .scheduler import Scheduler
from .windows import model_windows


class EngineCore(Core):
    def __init__(self, model, config: EngineConfig | None = None, *, lock: threading.RLock | None = None):
        check_decoder(model)
        cfg = model.config
        param = next(model.parameters())
        # kv_dtype decided for this model (16-bit for a quantized one unless given), then every size
        self.config = (config or EngineConfig()).for_model(model).resolve(cfg, param.dtype)
        c = self.config
        # Sequences start at fixed-stride regions of the pool while there is room (decodes of all of
        # them read as one strided view), else mid-way into the largest free stretch (each stays one
        # consecutive run, read in place); see cache/packed.py.
        kw = dict(dtype=param.dtype, device=param.device, kv_dtype=c.kv_dtype, spread=True)
        windows = model_windows(cfg)
        if windows is None:
            self.cache = PagedKVCache(
                cfg.num_layers,
                cfg.num_kv_heads,
                cfg.head_dim,
                c.num_blocks,
                c.block_size,
                region_blocks=max(1, c.num_blocks // c.max_num_seqs),
                **kw,
            )
        else:  # layers of different windows: a block table per group of layers (cache/hybrid.py)
            groups = sum(n for _, n in kv_layer_groups(cfg)[1])
            self.cache = HybridPagedKVCache(
                cfg.num_layers,
                cfg.num_kv_heads,
                cfg.head_dim,
                c.num_blocks,
                c.block_size,
                windows=windows,
                region_blocks=max(1, c.num_blocks // (c.max_num_seqs * groups)),
                **kw,
            )
        scheduler = Scheduler(self.cache, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens)
        runner = PagedRunner(model, self.cache)
        super().__init__(model, scheduler, runner, max_model_len=c.max_model_len(cfg), lock=lock)
        self.dtype = param.dtype

    def pool_info(self) -> dict:
        """The KV pool in blocks, tokens and bytes, and per layer type (`kv_pool_info`)."""
        return {**kv_pool_info(self.cache), "max_model_len": self.max_model_len}

    def limit_source(self) -> str:
        short = self.config.window_blocks(self.model.config) if self.max_model_len == 0 else None
        if short is not None:
            return f"the KV pool's {self.cache.num_blocks} blocks are too few for this model's windowed layers: {short}"
        return (
            f"the model's context of {self.model.config.max_positions} tokens, or the KV pool's "
            f"{self.cache.num_blocks} blocks x {self.config.block_size} tokens"
        )


def kv_pool_info(cache) -> dict:
    """A paged pool (PagedKVCache or HybridPagedKVCache) in blocks, tokens (of every layer), bytes
    (when full: its pages become resident as blocks are first used) and the K/V dtype it stores,
    and per layer type (global: window None, or sliding with its window) the bytes a token takes in
    those layers, measured on the pool's planes (a windowed layer holds its last W only)."""
    layers = getattr(cache, "group_layers", [range(cache.num_layers)])
    g, slots = len(layers[0]), cache.num_blocks * cache.block_size
    per_layer = cache.memory_bytes() // (g * slots)
    types: dict = {}
    for w in getattr(cache, "windows", None) or [None] * cache.num_layers:
        types[w] = types.get(w, 0) + 1
    return {
        "blocks": cache.num_blocks,
        "block_size": cache.block_size,
        "bytes": cache.memory_bytes(),
        "tokens": slots * g // cache.num_layers,
        "kv_dtype": cache.kv_dtype or str(cache.dtype).removeprefix("torch."),
        "layer_types": [
            {"window": w, "layers": n, "kv_bytes_per_token": n * per_layer}
            for w, n in sorted(types.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        ],
    }
