"""Fair shares of the engine between requests and clients (the scheduler's policy, scheduler.py).

First come, first served let one request of 64 prompts x n=16 (1,024 sequences) hold every
slot: other clients' first token waited 12.9 s (p50; 0.2 s alone) for five minutes (issue 43).
So the scheduler counts the running sequences of each *client* (a server's hashed API key; a
request without one is a client of its own) and, within it, of each *share* (the requests that
count as one: a server's prompts of one API request, or one add_request call):

- admission takes the waiting request whose client, then share, holds the fewest running
  sequences; then the lowest `priority` (vLLM's convention: lower is served first); then arrival;
- a share richer than the next waiting one by two sequences or more gives up its newest running
  sequence (preempted, recomputed later), so the waiting one runs at the next step. By two, since
  moving one sequence then never turns the order around: shares even out without ping-pong;
- preemption victims are the richest client's richest share, lowest priority, newest first;
- a richer share's prompt chunks leave the budget the next waiting request's prompt needs; when
  a richer share owes that request its place, they take no more of that step than its prompt,
  so the step that brings its first token is a short one.

With one share (or requests of one sequence each) the order is arrival and nobody is richer by
two: first come, first served, exactly as before. Fairness only reorders and preempts; a
preempted sequence is recomputed to the same K/V, so greedy outputs do not change.
"""

from __future__ import annotations

from collections import Counter

from .request import Request


class Shares:
    """Running sequences per client and per share, kept up to date through one step."""

    def __init__(self, running: list[Request]):
        self.clients: Counter = Counter()
        self.shares: Counter = Counter()
        for r in running:
            self.add(r)

    def add(self, r: Request) -> None:
        self.clients[r.group.client_key] += 1
        self.shares[r.group.share_key] += 1

    def remove(self, r: Request) -> None:
        self.clients[r.group.client_key] -= 1
        self.shares[r.group.share_key] -= 1

    def key(self, r: Request) -> tuple:
        """Ascending: who is admitted (and scheduled) first; descending: who is preempted first."""
        g = r.group
        return (self.clients[g.client_key], self.shares[g.share_key], g.priority, r.arrival)

    def richer(self, v: Request, w: Request, by: int = 2) -> bool:
        """Does v's client (or, within one client, v's share) hold `by` or more sequences more than w's?"""
        (cv, sv), (cw, sw) = (v.group.client_key, v.group.share_key), (w.group.client_key, w.group.share_key)
        if cv != cw:
            return self.clients[cv] - self.clients[cw] >= by
        return sv != sw and self.shares[sv] - self.shares[sw] >= by


def check_priority(priority) -> int:
    """The priority as an int; ValueError naming the fix otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer (lower is served first, default 0), got {priority!r}")
    return priority
