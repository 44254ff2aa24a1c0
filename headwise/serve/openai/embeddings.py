"""POST /v1/embeddings on a local encoder: headwise.embed (mean pooled, L2-normalized,
truncated to the model's max_seq_length as sentence-transformers does). Input is text or token
ids (the model's own: `token_inputs`).

Bounded as OpenAI bounds it: at most 2,048 inputs, none longer than the model's positions
(a 400 naming the input, not a silent cut), at most max_embedding_tokens in all. The model
works in micro-batches and serves waiting requests between them (LocalRuntime.embed), so a
request of 2,048 inputs does not hold it while a one-line request waits."""

from __future__ import annotations

import base64
import json

from fastapi import Request
from fastapi.responses import Response

from ..errors import APIError
from ..schemas import EmbeddingRequest
from .common import check_chars, check_ids, off_loop, tokenize_many
from .streams import until_disconnect


MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def token_inputs(runtime, given) -> list[list[int]]:
    """Token-id input (one list of ids, or a list of them: what LangChain's OpenAIEmbeddings
    sends) -> the ids, checked against this model's vocabulary. The ids are read
    as this model's own, as vLLM and llama-server read them (LangChain counts with tiktoken's
    unless told `check_embedding_ctx_length=False`, which sends text instead)."""
    items = [given] if isinstance(given[0], int) else given
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input has {len(items):,} token lists; at most {MAX_INPUTS:,} per request", param="input")
    vocab = runtime.model.config.vocab_size
    for i, ids in enumerate(items):
        try:
            check_ids(ids, vocab, "input" if items is not given else f"input[{i}]")
        except APIError as e:
            e.message += (
                "; token ids are this model's own (LangChain's OpenAIEmbeddings sends tiktoken's unless "
                "created with check_embedding_ctx_length=False, which sends the text)"
            )
            raise
    return [list(ids) for ids in items]


async def create(runtime, req: EmbeddingRequest, model: str, request: Request, *, timeout=None, metrics=None):
    runtime.require("embed", "/v1/embeddings")
    text = isinstance(req.input, str) or isinstance(req.input[0], str)
    given = None if text else await off_loop(token_inputs, runtime, req.input)  # 2,048 x 512 ids to check
    texts = given or ([req.input] if isinstance(req.input, str) else req.input)
    width = runtime.model.config.d_model
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(
            400,
            f"{model} gives {width}-dimensional embeddings; dimensions={req.dimensions} is not supported (omit it)",
            param="dimensions",
        )
    if given is None:
        check_chars(texts, runtime.spec.max_input_chars, "input")
    ids = given or await off_loop(tokenize_many, runtime.tokenizer, texts)
    positions = runtime.max_model_len
    for i, t in enumerate(ids):
        if len(t) > positions:
            one = isinstance(req.input, str) or isinstance(req.input[0], int)
            where = "input" if one else f"input[{i}]"
            raise APIError(
                400,
                f"{where} has {len(t)} tokens; {model} takes at most {positions} tokens per input. Shorten or split it",
                param="input",
                code="context_length_exceeded",
            )
    total = sum(len(t) for t in ids)
    cap = runtime.spec.max_embedding_tokens
    if total > cap:
        raise APIError(
            400,
            f"the input has {total:,} tokens in all, over this server's limit of {cap:,} per "
            "embeddings request ([models.NAME] max_embedding_tokens); send fewer or shorter "
            "inputs per request",
            param="input",
            code="input_too_long",
        )
    limit = getattr(runtime.model, "max_seq_length", None) or positions
    tokens = sum(min(len(t), limit) for t in ids)
    vecs = await until_disconnect(runtime.embed(ids), request)  # tokenized once, above
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    # 2,048 x 384 floats to JSON take ~1 s: off the loop too
    return Response(await off_loop(_body, vecs, req.encoding_format, model, usage), media_type="application/json")


def _body(vecs, encoding_format: str, model: str, usage: dict) -> bytes:
    data = []
    for i, v in enumerate(vecs.float().numpy()):
        if encoding_format == "base64":  # what the openai client asks for: little-endian float32
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode()
        else:
            emb = v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    body = {"object": "list", "data": data, "model": model, "usage": usage}
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
