"""What an upstream sends back, read under caps and scrubbed of the key we sent it (issue 43).

- Decoding: we ask for `Accept-Encoding: gzip, deflate` and decode ourselves, at most STEP bytes
  per zlib call, so a gzip bomb (1 GiB of spaces in a 1 MB body) never exists in memory at once;
  an encoding we did not ask for is a fault.
- Size: a body the gateway holds whole (a non-streamed answer, an error) is read up to a cap,
  counted after decoding; one byte more is a fault. Streams are relayed event by event and bounded
  by the size of one event and by their deadlines (upstream.py), not by a total.
- Secrets: an upstream may echo our request's headers anywhere (an extra field of a streamed
  event, a debug block of an answer). Every JSON string of what we relay, keys included, has the
  key replaced by "[redacted]"; JSON escapes (\\u0073k-...) are seen through, as the text is
  checked once parsed.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

ACCEPT_ENCODING = "gzip, deflate"  # what we decode under a cap (br and zstd would need packages)
STEP = 64 << 10  # decoded bytes per zlib call: the most one compressed chunk becomes at once
REDACTED = "[redacted]"


class Fault(Exception):
    """The upstream answered 200 but not what it should have."""

    def __init__(self, kind: str, what: str, code: str = "upstream_invalid_response", **fields):
        super().__init__(what)
        self.kind, self.what, self.code, self.fields = kind, what, code, fields


def _decoder(encoding: str, first: bytes):
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    # "deflate" is meant to be zlib-wrapped (RFC 9110), some servers send it raw (as httpx allows)
    wrapped = len(first) >= 2 and first[0] & 0x0F == 8 and (first[0] << 8 | first[1]) % 31 == 0
    return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)


async def decoded(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The body's bytes, decoded from its Content-Encoding, in pieces of at most STEP bytes
    (identity: as they arrive). Raises Fault."""
    encoding = resp.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        async for chunk in resp.aiter_raw():
            yield chunk
        return
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise Fault("bad_encoding", f"sent Content-Encoding: {encoding[:40]!r}; it was asked for {ACCEPT_ENCODING}")
    d = None
    try:
        async for chunk in resp.aiter_raw():
            if d is None:
                d = _decoder(encoding, chunk)
            while chunk and not d.eof:
                out = d.decompress(chunk, STEP)
                chunk = d.unconsumed_tail
                while len(out) == STEP:  # zlib may hold more output than the input left over
                    yield out
                    out = d.decompress(chunk, STEP)
                    chunk = d.unconsumed_tail
                if out:
                    yield out
    except zlib.error:
        raise Fault("bad_encoding", f"sent a body that its Content-Encoding ({encoding}) does not decode") from None


async def read_capped(chunks: AsyncIterator[bytes], cap: int, setting: str) -> bytes:
    """The whole body, or Fault once it passes `cap` bytes (`setting` names where to raise it)."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > cap:
            raise Fault("too_large", f"sent an answer over {cap} bytes ({setting})", code="upstream_too_large")
        parts.append(chunk)
    return b"".join(parts)


def parsed(content: bytes, what: str) -> Any:
    """JSON, or Fault naming `what` was not JSON (nesting too deep for the parser included)."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError):
        raise Fault("invalid_json", f"{what} that is not JSON") from None


def scrub(value: Any, secret: str) -> bool:
    """Replace `secret` in every string and key of parsed JSON, in place (loop, not recursion:
    the parser's depth is already near the recursion limit). -> whether anything changed."""
    changed, stack = False, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in [k for k in node if secret in k]:
                node[key.replace(secret, REDACTED)] = node.pop(key)
                changed = True
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, v in list(items):
            if isinstance(v, str):
                if secret in v:
                    node[key], changed = v.replace(secret, REDACTED), True
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return changed


def scrubbed(payload: bytes, value: Any, secret: str | None) -> bytes:
    """`payload` as it came when no JSON string of it can hold `secret`, else `value` (its parse)
    scrubbed and written anew. Without an escape, a string holding the key holds its bytes."""
    if not secret or (secret.encode() not in payload and b"\\" not in payload):
        return payload
    if isinstance(value, str):
        return json.dumps(value.replace(secret, REDACTED)).encode() if secret in value else payload
    return json.dumps(value, ensure_ascii=False).encode() if scrub(value, secret) else payload
