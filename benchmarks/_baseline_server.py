"""serving.py's baseline: transformers generate, one request at a time, behind /v1/completions.

    python benchmarks/_baseline_server.py --port PORT

LlamaForCausalLM (sdpa) built from the very same GGUF tensors as headwise.load uses (as
benchmarks/decode.py does), `generate` with a token streamer, one request at a time behind a
lock, the same /v1/completions SSE format (with usage) as `headwise serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's headwise
import headwise  # noqa: E402,F401  (before torch: it sets the OpenMP wait policy, headwise/core/threads.py)

MODEL = "smollm2-135m-instruct"


def baseline_app():
    """transformers generate, one request at a time, behind /v1/completions (SSE + usage)."""
    import copy
    import threading

    import torch
    import transformers
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from headwise.models.builtin import resolve
    from headwise.models.gguf import read_gguf
    from headwise.models.stream_decode import StreamDecoder

    transformers.logging.set_verbosity_error()
    hf_config, tensors, tok = read_gguf(resolve(MODEL))
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config.items() if k not in ("gguf", "_name_or_path")})
    config._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(copy.deepcopy(config)).eval()
    res = hf.load_state_dict(tensors, strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"lm_head.weight"}, res
    hf.tie_weights()
    del tensors
    one_at_a_time = threading.Lock()
    app = FastAPI()

    class Tokens(BaseStreamer):
        """generate() calls put() with the prompt first, then each new token."""

        def __init__(self, loop, queue):
            self.loop, self.queue, self.prompt_seen = loop, queue, False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(value.reshape(-1)[0]))

        def end(self):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(body: dict):
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        n = int(body.get("max_tokens", 16))
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        streamer = Tokens(loop, queue)

        def run():
            with one_at_a_time, torch.inference_mode():
                x = torch.tensor([ids])
                hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                    streamer=streamer,
                )

        job = loop.run_in_executor(None, run)
        head = {"id": "cmpl-baseline", "object": "text_completion", "created": int(time.time()), "model": MODEL}
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        async def tokens():
            decoder = StreamDecoder(tok)
            while (t := await queue.get()) is not None:
                yield decoder.push(t)
            await job

        if not body.get("stream"):
            text = "".join([t async for t in tokens()])
            return JSONResponse(
                {**head, "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}
            )

        async def events():
            async for text in tokens():
                chunk = {**head, "choices": [{"index": 0, "text": text, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def run_baseline_server(port: int) -> None:
    import uvicorn

    uvicorn.run(baseline_app(), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    run_baseline_server(ap.parse_args().port)
