"""Scoring engines by the prompt's cached prefix and their load (`balancing: {mode: kv_cache}`).

A plain function of the request's facts and what the gateway knows of each engine: how many
of the prompt's leading blocks it holds (the KV index, fed by the engines' KV events), how
many requests it has outstanding, whether its index can be trusted. No aiohttp, no clock.

The cost of sending the prompt to engine e, in prompt tokens to prefill:

    cost(e) = block_size × (prompt_blocks − matched_blocks(e))  +  load_tokens × outstanding(e)

`load_tokens` (config `balancing.kv_load_tokens`) is what one outstanding request is worth
in tokens of prefill: an engine holding the whole conversation loses it to an idle one only
when it is that much busier. The lowest cost wins; a tie (every cold start, every engine
equally warm) goes to the engine that served the session's last turn, then to a rendezvous
hash of the prompt's first block, so that a new conversation's later turns find the engine
its first one went to. When any candidate's index is stale (a gap in its events that could
not be replayed, or events it could not read), `score` declines (None) and the pool decides
by the prefix-hash mode (`prefix_affinity`): blind to the cache, but consistent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the scorer knows of one candidate engine."""

    url: str
    outstanding: int
    matched_blocks: int
    """Leading blocks of this prompt the engine holds (0 when it holds none, or is stale)."""
    stale: bool = False


@dataclass(frozen=True, slots=True)
class Scored:
    url: str
    rule: str
    """Why: "cache" (the lowest cost), "session" (a tie: the session's engine), "hash" (a tie:
    the rendezvous hash)."""
    matched_blocks: int
    cost: float

    def explain(self, block_size: int) -> str:
        """The choice in a few words, for the policy header and the trace."""
        return f"{self.rule}: {self.matched_blocks * block_size} tokens cached, cost {self.cost:g}"


def score(
    views: Sequence[EngineView],
    *,
    prompt_blocks: int,
    block_size: int,
    load_tokens: float,
    session_engine: str | None,
    tie_key: bytes,
) -> Scored | None:
    """The engine to send the prompt to (`views` is not empty); None when an index is stale."""
    if any(view.stale for view in views):
        return None
    costs = {view.url: _cost(view, prompt_blocks, block_size, load_tokens) for view in views}
    best = min(costs.values())
    tied = [view for view in views if costs[view.url] == best]
    if len(tied) == 1:
        return Scored(tied[0].url, "cache", tied[0].matched_blocks, best)
    for view in tied:
        if view.url == session_engine:
            return Scored(view.url, "session", view.matched_blocks, best)
    view = min(tied, key=lambda v: _rank(v.url, tie_key))
    return Scored(view.url, "hash", view.matched_blocks, best)


def _cost(view: EngineView, prompt_blocks: int, block_size: int, load_tokens: float) -> float:
    uncached = max(prompt_blocks - view.matched_blocks, 0) * block_size
    return uncached + load_tokens * view.outstanding


def _rank(url: str, key: bytes) -> bytes:
    """Rendezvous hashing: each engine's rank for this key; the lowest wins, and an engine
    that leaves moves only its own keys."""
    return hashlib.blake2b(url.encode() + b"\0" + key, digest_size=8).digest()
