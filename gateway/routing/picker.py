"""Which engine of a pool serves a request: filters, then scorers, then the pick.

A plain function of the request's facts (`RequestFacts`: prompt ids, session key, tenant,
structured-output constraint, engines already tried) and the pool's datastore
(`EndpointStore`); no aiohttp, no I/O. The clock and the random source are passed in.

Filters drop the engines that cannot take the request: tried already, circuit open, the
generate API refused (403) lately, or (once probed) not enforcing the request's
structured-output kind. Each says, when it drops the last one, why no engine is left.

Scorers put a cost on each remaining engine, in prompt tokens to prefill before the
request's first token, and the lowest total wins; ties go to the session's last engine,
then to a rendezvous hash of the prompt's first block past what the engines hold (an
engine that leaves moves only its own prompts; conversations sharing a cached head
spread). `balancing.mode` picks the scorers:

- `least_outstanding`: two engines drawn at random, the one with fewer outstanding
  requests (power of two choices).
- `prefix_affinity`: the rendezvous hash of the first `prefix_tokens` tokens, among the
  engines under `load_factor` × the pool's mean outstanding (+1, so an idle pool still
  concentrates a prefix); if none is, the least loaded.
- `kv_cache`: the prompt's cached prefix (the KV index) against the engine's load:

      cost(e) = len(prompt) − block_size × matched_blocks(e)       its uncached prompt tokens
              + prefill_tokens(e)                                    queued ahead of it
              + kv_load_tokens × outstanding(e)
              + kv_waiting_tokens × waiting(e) + kv_usage_tokens × kv_usage(e)
              + kv_fill_tokens × held(e) / cache_blocks(e)

  `matched_blocks(e)`: the prompt's leading full blocks engine e holds; `prefill_tokens(e)`:
  the uncached tokens of the requests this gateway has open there (what it prefills before
  this prompt, or prefilled while they decode); `outstanding(e)`: those requests;
  `waiting(e)`, `kv_usage(e)`: the engine's own queue and cache fill from its metrics (all
  gateways' requests, as of the last scrape); `held(e)`: the blocks the index says it holds
  (cached, not only running), over its cache's size (`vllm:cache_config_info`; the term is 0
  while that is unknown): a full engine pays for what taking a new conversation there will
  evict, so at low load new conversations that share a cached head spread rather than all
  follow it to one engine. When any candidate's index is stale (events
  lost and not replayed) the mode decides as `prefix_affinity` does: blind to the cache,
  but consistent.
- `load` (a prefill pool's decode side in P/D): the kv_cache cost without the prompt's
  term — the KV arrives from prefill, so only load counts.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.config import Balancing
from gateway.edge.errors import EngineUnavailable, InvalidRequest
from gateway.routing.datastore import Endpoint, EndpointStore
from gateway.routing.kv_index import request_extra_keys

Mode = Literal["least_outstanding", "prefix_affinity", "kv_cache", "load"]


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What routing knows of a request."""

    prompt: Sequence[int] | None = None
    """The rendered prompt's token ids (None: a request without one, e.g. a probe)."""
    session: str | None = None
    """The conversation's key (`gateway.flow.session`): its turns' ties go to its last engine."""
    tenant: str | None = None
    """Whose session it is: one tenant's session key never steers another's."""
    constraint: str | None = None
    """The structured-output kind the engine must enforce."""
    cache_salt: str | None = None
    """The request's `cache_salt`: engines key its first block with it (vLLM's extra keys)."""
    priority: int = 0
    """The request's priority (`gateway.edge.priority`), sent to engines as `priority`."""
    tried: frozenset[str] = frozenset()
    """Engines this request already failed on."""


NO_FACTS = RequestFacts()
"""A request without a prompt or a session (a probe, a retry of one)."""


@dataclass(frozen=True, slots=True)
class Choice:
    endpoint: Endpoint
    why: str | None = None
    """Why, when the mode weighed the prompt's cache (the policy header, the trace)."""
    prefill_tokens: int = 0
    """The prompt tokens the engine is expected to prefill (not cached there)."""


@dataclass(frozen=True, slots=True)
class Cost:
    """One candidate's kv_cache cost, in parts."""

    matched_blocks: int
    uncached: int
    load: float

    @property
    def total(self) -> float:
        return self.uncached + self.load


Filter = Callable[[Endpoint, RequestFacts, float], bool]


def _untried(endpoint: Endpoint, facts: RequestFacts, now: float) -> bool:
    return endpoint.url not in facts.tried


def _admitted(endpoint: Endpoint, facts: RequestFacts, now: float) -> bool:
    return endpoint.breaker.admits(now)


def _serving(endpoint: Endpoint, facts: RequestFacts, now: float) -> bool:
    return not endpoint.off(now)


def _enforcing(endpoint: Endpoint, facts: RequestFacts, now: float) -> bool:
    """Enforces the request's constraint, as far as known (an engine not probed yet passes:
    its client probes it and asks again when it does not)."""
    return facts.constraint is None or endpoint.routes is None or facts.constraint in endpoint.constraints


FILTERS: tuple[tuple[Filter, str], ...] = (
    (_untried, "tried"),
    (_admitted, "circuit"),
    (_serving, "off"),
    (_enforcing, "constraint"),
)


def candidates(store: EndpointStore, facts: RequestFacts, now: float) -> list[Endpoint]:
    """The engines that can take the request; raises with the reason when none can."""
    left = list(store.endpoints.values())
    for keep, reason in FILTERS:
        kept = [endpoint for endpoint in left if keep(endpoint, facts, now)]
        if not kept:
            raise _none_left(reason, left, facts)
        left = kept
    return left


def _none_left(reason: str, dropped: list[Endpoint], facts: RequestFacts) -> EngineUnavailable | InvalidRequest:
    tried = f" ({len(facts.tried)} tried)" if facts.tried else ""
    if reason == "off":
        return EngineUnavailable(
            f"no engine serves the generate API (refused with 403: {', '.join(sorted(e.url for e in dropped))})"
        )
    if reason == "constraint":
        return InvalidRequest(
            f"no engine of this model enforces structured_outputs.{facts.constraint}"
            f" (engines: {', '.join(sorted(e.url for e in dropped))})",
            param="structured_outputs",
        )
    if reason == "tried" or not dropped:
        return EngineUnavailable(f"no engine can take the request{tried}" if dropped else "no engine in the pool")
    return EngineUnavailable(f"no engine can take the request: every circuit is open{tried}")


class Picker:
    """`pick`, with the mode's settings and a random source (power of two choices)."""

    def __init__(self, balancing: Balancing, mode: Mode | None = None, rng: random.Random | None = None) -> None:
        self.balancing = balancing
        self.mode: Mode = mode or balancing.mode
        self._rng = rng or random.Random()

    def pick(self, store: EndpointStore, facts: RequestFacts, now: float) -> Choice:
        """The engine for the request (raises `EngineUnavailable`, or `InvalidRequest` for a
        constraint no engine enforces, when none can take it)."""
        found = candidates(store, facts, now)
        prompt = facts.prompt
        mode = self.mode
        if mode == "kv_cache" and prompt is not None and store.index is not None:
            choice = self._by_cache(store, found, facts, prompt)
        elif mode in ("prefix_affinity", "kv_cache") and prompt is not None:
            choice = Choice(self._by_prefix(found, prompt), None, len(prompt))
        elif mode == "load":
            choice = self._by_load(store, found, facts)
        else:
            choice = Choice(self._two_choices(found), None, len(prompt) if prompt is not None else 0)
        if facts.session is not None and mode in ("kv_cache", "load"):
            store.remember_session(facts.tenant, facts.session, choice.endpoint.url)
        return choice

    def _two_choices(self, found: list[Endpoint]) -> Endpoint:
        if len(found) == 1:
            return found[0]
        a, b = self._rng.sample(found, 2)
        return a if a.outstanding <= b.outstanding else b

    def _by_prefix(self, found: list[Endpoint], prompt: Sequence[int]) -> Endpoint:
        key = array("I", prompt[: self.balancing.prefix_tokens]).tobytes()
        ranked = sorted(found, key=lambda e: rank(e.url, key))
        bound = self.balancing.load_factor * sum(e.outstanding for e in found) / len(found) + 1
        return next((e for e in ranked if e.outstanding < bound), min(ranked, key=lambda e: e.outstanding))

    def _by_cache(
        self, store: EndpointStore, found: list[Endpoint], facts: RequestFacts, prompt: Sequence[int]
    ) -> Choice:
        index = store.index
        assert index is not None
        if any(index.is_stale(e.url) for e in found):
            return Choice(self._by_prefix(found, prompt), "hash: an engine's KV index is stale", len(prompt))
        size = index.block_size
        blocks = len(prompt) // size
        salt = facts.cache_salt
        matched = index.match(prompt, request_extra_keys(blocks, cache_salt=salt) if salt else None)
        held = index.counts() if self.balancing.kv_fill_tokens else {}
        costs = {
            e.url: Cost(
                matched.get(e.url, 0),
                len(prompt) - min(matched.get(e.url, 0), blocks) * size,
                self.load_cost(e) + self.fill_cost(e, held.get(e.url, 0)),
            )
            for e in found
        }
        # Ties are hashed on the first block past what the engines hold: new conversations
        # that share a cached head (a system prompt and tools) spread instead of all following it.
        past = min(max(matched.values(), default=0), max(blocks - 1, 0)) * size
        endpoint, rule = self._lowest(
            store, found, facts, {url: cost.total for url, cost in costs.items()}, prompt[past : past + size]
        )
        cost = costs[endpoint.url]
        why = f"{rule}: {cost.matched_blocks * size} tokens cached, cost {cost.total:g}"
        return Choice(endpoint, why, cost.uncached)

    def _by_load(self, store: EndpointStore, found: list[Endpoint], facts: RequestFacts) -> Choice:
        prompt = facts.prompt or ()
        costs = {e.url: self.load_cost(e) for e in found}
        endpoint, rule = self._lowest(store, found, facts, costs, prompt[: self.balancing.kv_index.block_size])
        return Choice(endpoint, f"{rule}: cost {costs[endpoint.url]:g}", len(prompt))

    def load_cost(self, endpoint: Endpoint) -> float:
        """An engine's load in prompt tokens: what it must get through before a new request's
        prefill (the module's formula, less the prompt's own uncached tokens)."""
        b = self.balancing
        return (
            endpoint.prefill_tokens
            + b.kv_load_tokens * endpoint.outstanding
            + b.kv_waiting_tokens * endpoint.load.waiting
            + b.kv_usage_tokens * endpoint.load.kv_usage
        )

    def fill_cost(self, endpoint: Endpoint, held: int) -> float:
        """What taking more blocks costs an engine whose cache is `held` blocks full (by the
        index), in proportion to its size (unknown: nothing)."""
        capacity = endpoint.load.cache_blocks
        return self.balancing.kv_fill_tokens * min(held / capacity, 1.0) if capacity else 0.0

    def _lowest(
        self,
        store: EndpointStore,
        found: list[Endpoint],
        facts: RequestFacts,
        costs: dict[str, float],
        tie_key: Sequence[int],
    ) -> tuple[Endpoint, str]:
        """The lowest cost, and the rule that settled it: `cache` (lowest alone), `session`
        (a tie, the session's last engine), `hash` (a tie, the rendezvous hash of `tie_key`'s
        tokens)."""
        best = min(costs.values())
        tied = [e for e in found if costs[e.url] == best]
        if len(tied) == 1:
            return tied[0], "cache" if self.mode == "kv_cache" else "load"
        if facts.session is not None:
            last = store.session_engine(facts.tenant, facts.session)
            for endpoint in tied:
                if endpoint.url == last:
                    return endpoint, "session"
        key = array("I", tie_key).tobytes()
        return min(tied, key=lambda e: rank(e.url, key)), "hash"


def rank(url: str, key: bytes) -> bytes:
    """Rendezvous hashing: each engine's rank for this key; the lowest wins, and an engine
    that leaves moves only its own keys."""
    return hashlib.blake2b(url.encode() + b"\0" + key, digest_size=8).digest()
