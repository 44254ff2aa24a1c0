"""`embed()`: sentence embeddings from an encoder, pooled the way sentence-transformers does.

all-MiniLM-L6-v2 (modules.json: Transformer -> Pooling(mean) -> Normalize) averages
the token vectors of each text, ignoring padding, then L2-normalizes; texts are
truncated to its max_seq_length (256 tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor


def embed(
    model,
    texts: str | list[str] | list[list[int]],
    *,
    normalize: bool = True,
    batch_size: int = 32,
    pooling: str = "mean",
    max_length: int | None = None,
) -> Tensor:
    """Embed texts with an encoder model -> (N, C) fp32 tensor (one row for a single string).
    `texts` may also be token ids per text, as the tokenizer gives them (special tokens included):
    a caller that has tokenized already (the server, to bound a request) does not pay twice."""
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise ValueError("no texts to embed")
    if getattr(model.config, "causal", False):
        raise ValueError(f"{model.config.name} is a decoder; embed() needs an encoder such as all-minilm-l6-v2")
    tok = model.tokenizer
    pretokenized = isinstance(texts[0], (list, tuple))
    if tok is None and not pretokenized:
        raise ValueError("this model has no tokenizer; embed() needs one (or token ids)")
    limit = min(
        max_length or getattr(model, "max_seq_length", None) or model.config.max_positions, model.config.max_positions
    )
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            ids = [list(i) for i in chunk] if pretokenized else tok.encode_batch(chunk)
            ids = [i if len(i) <= limit else i[: limit - 1] + [i[-1]] for i in ids]  # truncate, keep [SEP]
            T = max(len(i) for i in ids)
            pad = (tok.pad_token_id if tok is not None else None) or 0
            input_ids = torch.full((len(ids), T), pad, dtype=torch.long, device=device)
            mask = torch.zeros(len(ids), T, dtype=torch.long, device=device)
            for b, i in enumerate(ids):
                input_ids[b, : len(i)] = torch.tensor(i, device=device)
                mask[b, : len(i)] = 1
            hidden = model(input_ids, attention_mask=mask).float()  # (b, T, C)
            if pooling == "mean":
                m = mask[..., None].float()
                pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
            elif pooling == "cls":
                pooled = hidden[:, 0]
            else:
                raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
            out.append(torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled)
    return torch.cat(out)
