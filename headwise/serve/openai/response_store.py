"""The bounded in-memory store behind /v1/responses' `store` and `previous_response_id`.

A response is kept only when its request says `store: true` (headwise is stateless by
default, unlike OpenAI, which stores unless told not to). The store holds at most `max_items`
responses, each for at most `max_age` seconds: the least recently used goes first when it is
full, and one older than `max_age` is gone whether or not there is room. It lives in the
server's memory: a restart forgets everything, and replicas behind a gateway do not share it.

    HEADWISE_RESPONSES_STORE_MAX=1000    # responses kept (0: `store: true` keeps nothing)
    HEADWISE_RESPONSES_STORE_TTL=3600    # seconds one is kept
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_ITEMS = 1000  # a few KiB each (the conversation's text): a few MiB at most
DEFAULT_MAX_AGE = 3600.0  # an agent's session continues within minutes; an hour is generous


@dataclass
class Stored:
    response: dict  # the response object as the client got it (GET /v1/responses/{id})
    messages: list[dict]  # the conversation so far as chat messages, its answer last (instructions excluded)
    at: float  # time.monotonic() when stored


class ResponseStore:
    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS, max_age: float = DEFAULT_MAX_AGE):
        if max_items < 0 or max_age <= 0:
            raise ValueError(f"a response store needs max_items >= 0 and max_age > 0, not {max_items} and {max_age}")
        self.max_items, self.max_age = max_items, max_age
        self._items: OrderedDict[str, Stored] = OrderedDict()  # least recently used first

    @classmethod
    def from_env(cls) -> "ResponseStore":
        try:
            n = int(os.environ.get("HEADWISE_RESPONSES_STORE_MAX", DEFAULT_MAX_ITEMS))
            age = float(os.environ.get("HEADWISE_RESPONSES_STORE_TTL", DEFAULT_MAX_AGE))
        except ValueError as e:
            raise ValueError(f"HEADWISE_RESPONSES_STORE_MAX / _TTL must be numbers: {e}") from None
        return cls(n, age)

    def _expire(self, now: float) -> None:
        while self._items:
            key, first = next(iter(self._items.items()))
            if now - first.at <= self.max_age:
                # LRU order is not age order (a get moves an old one to the end): check the rest lazily
                break
            del self._items[key]

    def put(self, rid: str, response: dict, messages: list[dict]) -> None:
        now = time.monotonic()
        self._expire(now)
        if self.max_items == 0:
            return
        self._items[rid] = Stored(response, messages, now)
        self._items.move_to_end(rid)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        now = time.monotonic()
        self._expire(now)
        item = self._items.get(rid)
        if item is None:
            return None
        if now - item.at > self.max_age:
            del self._items[rid]
            return None
        self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)
