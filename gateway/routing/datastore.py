"""What the gateway knows of one pool's engines, in one place: the picker reads it, the
background loops feed it.

- Membership: the configured URLs, and for `resolve: true` entries every address their
  host name resolves to (a Kubernetes headless Service), re-resolved every
  `dns_interval_s` (`resolve`, by the DNS loop); an endpoint that leaves DNS leaves the
  store once its requests are done.
- Capabilities: the routes an engine serves and the structured-output kinds it enforces,
  probed once by the engine client (`Endpoint.routes` None until then); whether its
  derender route is stock vLLM's form; when it last refused the generate API (403).
- Health: a circuit breaker per endpoint: `failure_threshold` consecutive failures
  (refused connections, 5xx answers, failed health checks) open it; after `open_s` one
  trial request is let through (half-open); a success, or a passing health check, closes it.
- Live load: the gateway's own outstanding requests and the uncached prompt tokens it sent
  each engine (`prefill_tokens`), and the engine's scraped metrics (`Load`, by the
  feedback loop).
- The KV index: which engine holds which prefix blocks (fed by the KV event subscribers),
  and each session's last engine.

No aiohttp here: the loops that talk to engines write, the picker (`gateway.routing.picker`)
reads.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from yarl import URL

from gateway.config import EngineEndpoint, Health
from gateway.routing.kv_index import KVIndex

log = logging.getLogger(__name__)

ROUTES_OFF_RECHECK_S = 60.0
"""How long an engine that refused the generate API (403) is left out before it is tried again
(it may have been restarted with scale-out on); the next request it gets is retried elsewhere
if it refuses again, so a recheck costs one extra hop."""


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


@dataclass(frozen=True, slots=True)
class Load:
    """An engine's load as its metrics tell (scraped every `feedback_interval_s`; stock
    vLLM has no onehop metrics and reads 0 for those)."""

    output_cpu_cores: float = 0.0
    """Cores its output processing used since the previous scrape (onehop engines)."""
    in_flight: int = 0
    """Requests it is serving (onehop engines)."""
    waiting: int = 0
    """Requests queued, not started (`vllm:num_requests_waiting`)."""
    kv_usage: float = 0.0
    """Share of its KV cache in use, 0 to 1 (`vllm:kv_cache_usage_perc`)."""
    cache_blocks: int = 0
    """Its KV cache's size in blocks (`vllm:cache_config_info`'s `num_gpu_blocks`); 0: unknown."""


@dataclass
class Endpoint:
    """One engine URL of the pool and everything known of it."""

    url: str
    breaker: Breaker
    outstanding: int = 0
    """Requests this gateway process has open on it."""
    prefill_tokens: int = 0
    """Prompt tokens it was expected to prefill (not cached there when picked) for the
    requests this process has open on it."""
    load: Load = Load()
    routes: frozenset[str] | None = None
    """The routes it serves, once probed (None: not yet)."""
    constraints: frozenset[str] = frozenset()
    """The structured-output kinds it enforces, once probed."""
    vllm_derender: bool = False
    """Its derender route is stock vLLM's own form (0.33 on), not onehop's."""
    off_at: float | None = None
    """When it refused the generate API (403); None when it has not."""

    def off(self, now: float) -> bool:
        """Left out: it refused the generate API less than `ROUTES_OFF_RECHECK_S` ago."""
        return self.off_at is not None and now - self.off_at < ROUTES_OFF_RECHECK_S


@dataclass
class EndpointStore:
    members: list[EngineEndpoint]
    health: Health
    on_circuit: Callable[[str, bool], None] = lambda url, is_open: None
    """Told when an endpoint's circuit opens (True) or closes (False): the metrics gauge."""
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    index: KVIndex | None = None
    """Which engine holds which prefix blocks (fed by the engines' KV events); None when no
    engine of the pool publishes them."""
    max_sessions: int = 0
    """Sessions whose last engine is remembered (`balancing.kv_sessions`)."""
    _sessions: OrderedDict[tuple[str | None, str], str] = field(default_factory=OrderedDict)
    """Each (tenant, session)'s last engine, least recent first."""

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

    def succeeded(self, endpoint: Endpoint) -> None:
        was_open = endpoint.breaker.state is not Circuit.CLOSED
        endpoint.breaker.success()
        if was_open:
            log.info("engine %s is back: circuit closed", endpoint.url)
            self.on_circuit(endpoint.url, False)

    def failed(self, endpoint: Endpoint, now: float) -> None:
        was_open = endpoint.breaker.state is Circuit.OPEN
        endpoint.breaker.failure(now)
        if endpoint.breaker.state is Circuit.OPEN and not was_open:
            log.warning("engine %s failed %d times: circuit open", endpoint.url, endpoint.breaker.failures)
            self.on_circuit(endpoint.url, True)

    def session_engine(self, tenant: str | None, session: str) -> str | None:
        return self._sessions.get((tenant, session))

    def remember_session(self, tenant: str | None, session: str, url: str) -> None:
        """The engine a session's turn went to, for its next turn's tie (a session key is
        the tenant's own: another tenant's same key is another session)."""
        if not self.max_sessions:
            return
        key = (tenant, session)
        self._sessions[key] = url
        self._sessions.move_to_end(key)
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

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
