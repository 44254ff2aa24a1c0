"""POST /v1/embeddings on a local encoder: headwise.embed (mean pooled, L2-normalized,
truncated to the model's max_seq_length as sentence-transformers does)."""
from __future__ import annotations

import base64

from fastapi import Request
from fastapi.responses import JSONResponse

from ..errors import APIError
from ..schemas import EmbeddingRequest
from .common import tokenize, until_disconnect


async def create(runtime, req: EmbeddingRequest, model: str, request: Request, *, timeout=None, metrics=None):
    runtime.require("embed", "/v1/embeddings")
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "token-id input is not supported for embeddings here; send text", param="input")
    width = runtime.model.config.d_model
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(400, f"{model} gives {width}-dimensional embeddings; dimensions={req.dimensions} "
                            "is not supported (omit it)", param="dimensions")
    limit = getattr(runtime.model, "max_seq_length", None) or runtime.max_model_len
    tokens = sum(min(len(tokenize(runtime.tokenizer, t)), limit) for t in texts)
    vecs = await until_disconnect(runtime.embed(texts), request)
    data = []
    for i, v in enumerate(vecs.float().numpy()):
        if req.encoding_format == "base64":      # what the openai client asks for: little-endian float32
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode()
        else:
            emb = v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
