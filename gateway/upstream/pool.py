"""The engine pool: which endpoint serves the next request, and which are out.

- Picking, among endpoints whose circuit admits traffic and that this request
  has not already failed on, by `balancing.mode`: power of two choices on
  outstanding requests (two random candidates, the less loaded wins); the
  prompt's prefix hashed (`prefix_affinity`); or the engines' cached prefix
  of the prompt, from their KV events, against their load (`kv_cache`,
  `gateway.routing.kv_score`).
- Circuit breaker per endpoint: `failure_threshold` consecutive failures
  (refused connections, 5xx answers, failed health checks) open it; after
  `open_s` one trial request is let through (half-open); a success, or a
  passing health check, closes it.
- Membership: the configured URLs, and for `resolve: true` entries every
  address their host name resolves to (a Kubernetes headless Service),
  re-resolved every `dns_interval_s`; an endpoint that leaves DNS leaves the
  pool once its requests are done.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import socket
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from yarl import URL

from gateway.config import Balancing, EngineEndpoint, Health
from gateway.edge.errors import EngineUnavailable
from gateway.routing.kv_index import KVIndex
from gateway.routing.kv_score import EngineView, score

log = logging.getLogger(__name__)


class Circuit(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class Breaker:
    threshold: int
    open_s: float
    state: Circuit = Circuit.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    trial: bool = False
    """A half-open trial request is in flight."""

    def admits(self, now: float) -> bool:
        if self.state is Circuit.CLOSED:
            return True
        if self.state is Circuit.OPEN and now - self.opened_at >= self.open_s:
            self.state = Circuit.HALF_OPEN
            self.trial = False
        return self.state is Circuit.HALF_OPEN and not self.trial

    def started(self) -> None:
        if self.state is Circuit.HALF_OPEN:
            self.trial = True

    def success(self) -> None:
        self.state, self.failures, self.trial = Circuit.CLOSED, 0, False

    def failure(self, now: float) -> None:
        self.failures += 1
        self.trial = False
        if self.state is Circuit.HALF_OPEN or self.failures >= self.threshold:
            self.state, self.opened_at = Circuit.OPEN, now


@dataclass
class Endpoint:
    url: str
    breaker: Breaker
    outstanding: int = 0


@dataclass
class Pool:
    members: list[EngineEndpoint]
    health: Health
    balancing: Balancing = field(default_factory=Balancing)
    on_circuit: Callable[[str, bool], None] = lambda url, is_open: None
    """Told when an endpoint's circuit opens (True) or closes (False): the metrics gauge."""
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    index: KVIndex | None = None
    """Which engine holds which prefix blocks (`kv_cache` mode; fed by the engines' KV events)."""
    _sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    """`kv_cache`: each session's last engine, least recent first (bounded by `kv_sessions`)."""
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._set_urls(m.url.rstrip("/") for m in self.members if not m.resolve)

    def _set_urls(self, urls: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(urls))
        for url in wanted:
            if url not in self.endpoints:
                self.endpoints[url] = Endpoint(url, Breaker(self.health.failure_threshold, self.health.open_s))
                self.on_circuit(url, False)
        static = {m.url.rstrip("/") for m in self.members if not m.resolve}
        for url in list(self.endpoints):
            if url not in wanted and url not in static and self.endpoints[url].outstanding == 0:
                del self.endpoints[url]

    def urls(self) -> list[str]:
        return list(self.endpoints)

    def pick(
        self, exclude: set[str] = frozenset(), prompt: Sequence[int] | None = None, session: str | None = None  # type: ignore[assignment]
    ) -> Endpoint:
        return self.choose(exclude, prompt, session)[0]

    def choose(
        self, exclude: set[str] = frozenset(), prompt: Sequence[int] | None = None, session: str | None = None  # type: ignore[assignment]
    ) -> tuple[Endpoint, str | None]:
        """The engine for the next request, and why when the mode weighed the prompt's cache."""
        now = time.monotonic()
        candidates = [e for e in self.endpoints.values() if e.url not in exclude and e.breaker.admits(now)]
        if not candidates:
            tried = f" ({len(exclude)} tried)" if exclude else ""
            raise EngineUnavailable(f"no engine can take the request: every circuit is open{tried}")
        if len(candidates) == 1:
            return candidates[0], None
        mode = self.balancing.mode
        if mode == "kv_cache" and prompt is not None and self.index is not None:
            return self._by_cache(candidates, prompt, session, self.index)
        if mode in ("prefix_affinity", "kv_cache") and prompt is not None:
            return self._by_prefix(candidates, prompt), None
        a, b = self._rng.sample(candidates, 2)
        return (a if a.outstanding <= b.outstanding else b), None

    def _by_cache(
        self, candidates: list[Endpoint], prompt: Sequence[int], session: str | None, index: KVIndex
    ) -> tuple[Endpoint, str]:
        """The engine whose cached prefix saves the most prefill for its load; a stale index
        (events lost) hashes the prefix instead."""
        matched = index.match(prompt)
        views = [EngineView(e.url, e.outstanding, matched.get(e.url, 0), index.is_stale(e.url)) for e in candidates]
        size = index.block_size
        scored = score(
            views,
            prompt_blocks=len(prompt) // size,
            block_size=size,
            load_tokens=self.balancing.kv_load_tokens,
            session_engine=self._sessions.get(session) if session is not None else None,
            tie_key=array("I", prompt[:size]).tobytes(),
        )
        if scored is None:
            return self._by_prefix(candidates, prompt), "hash: an engine's KV index is stale"
        if session is not None and self.balancing.kv_sessions:
            self._sessions[session] = scored.url
            self._sessions.move_to_end(session)
            if len(self._sessions) > self.balancing.kv_sessions:
                self._sessions.popitem(last=False)
        return self.endpoints[scored.url], scored.explain(size)

    def _by_prefix(self, candidates: list[Endpoint], prompt: Sequence[int]) -> Endpoint:
        """Rendezvous hashing on the prompt's prefix, with bounded load: the highest-ranked
        engine that is not over `load_factor` × the mean outstanding (+1, so an idle pool
        still concentrates a prefix)."""
        prefix = array("I", prompt[: self.balancing.prefix_tokens]).tobytes()
        ranked = sorted(
            candidates, key=lambda e: hashlib.blake2b(e.url.encode() + b"\0" + prefix, digest_size=8).digest()
        )
        bound = self.balancing.load_factor * sum(e.outstanding for e in candidates) / len(candidates) + 1
        return next((e for e in ranked if e.outstanding < bound), min(ranked, key=lambda e: e.outstanding))

    def succeeded(self, endpoint: Endpoint) -> None:
        was_open = endpoint.breaker.state is not Circuit.CLOSED
        endpoint.breaker.success()
        if was_open:
            log.info("engine %s is back: circuit closed", endpoint.url)
            self.on_circuit(endpoint.url, False)

    def failed(self, endpoint: Endpoint) -> None:
        was_open = endpoint.breaker.state is Circuit.OPEN
        endpoint.breaker.failure(time.monotonic())
        if endpoint.breaker.state is Circuit.OPEN and not was_open:
            log.warning("engine %s failed %d times: circuit open", endpoint.url, endpoint.breaker.failures)
            self.on_circuit(endpoint.url, True)

    async def resolve(self) -> None:
        """Re-read DNS for `resolve: true` members (static ones stay)."""
        urls = [m.url.rstrip("/") for m in self.members if not m.resolve]
        loop = asyncio.get_running_loop()
        for member in (m for m in self.members if m.resolve):
            url = URL(member.url)
            port = url.port or 80
            try:
                infos = await loop.getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("cannot resolve %s, keeping the pool as it is: %s", url.host, exc)
                return
            hosts = {info[4][0] for info in infos}
            for address in sorted(host for host in hosts if isinstance(host, str)):  # IPv4 and IPv6 give a str
                host = f"[{address}]" if ":" in address else address
                urls.append(f"{url.scheme}://{host}:{port}")
        self._set_urls(urls)

    def resolves(self) -> bool:
        """Whether any member is a host name to look up again (`resolve: true`)."""
        return any(m.resolve for m in self.members)
