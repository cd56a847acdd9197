"""The gateway's Prometheus metrics, one registry per app. Names are in docs/operations.md.

Under `onehop gateway --workers N` (prometheus-client's multiprocess mode, on
when `PROMETHEUS_MULTIPROC_DIR` is set before the client is imported) every
worker writes its values to files in that folder, and a scrape, whichever
worker answers it, reads them all: counters and histograms are summed, gauges
are summed over live workers (in flight, waiting) or their maximum (a circuit
open in any worker).
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.observe.outcome import Outcome

_MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Finer from 10 to 50 ms: typical times to first token and between tokens fall there (issue #33).
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120
)
_GAP_BUCKETS = (
    1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1,
    2.5,
)
_STAGE_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5)
STAGES = ("render", "policy", "derender")
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PRIORITY_LABELS = 16
"""Distinct priority labels (clients may ask for any number); past them, `_other`."""


M = TypeVar("M", Counter, Gauge, Histogram)

OTHER_TENANTS = "*"
"""The tenant label of every tenant the config's `tenants:` does not name (and of requests
without one): a client's input never becomes a label value."""


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    tenants: frozenset[str] = frozenset()
    """The tenant names that are label values of their own (the config's `tenants:`)."""
    also: tuple[Callable[[], bytes], ...] = ()
    """Other exposition served on this /metrics after the gateway's own (`onehop serve`: its
    embedded engine's, whose own port is private), each a scrape's text."""

    def __post_init__(self) -> None:
        self._children: dict[Any, dict[tuple[str, ...], Any]] = {}
        r = self.registry
        self.tenant_requests = Counter(
            "onehop_gateway_tenant_requests",
            f"Requests answered, by tenant (each tenant the config names; `{OTHER_TENANTS}` for the others).",
            ["tenant"], registry=r,
        )
        self.tenant_tokens = Counter(
            "onehop_gateway_tenant_tokens",
            "Tokens of the answered requests, by tenant and kind: prompt, cached (of the prompt), completion.",
            ["tenant", "kind"], registry=r,
        )
        self.quota_rejections = Counter(
            "onehop_gateway_quota_rejections",
            "Requests refused with a 429 by a tenant quota, by tenant and limit "
            "(tokens_per_minute, tokens_per_day, requests_per_minute).",
            ["tenant", "limit"], registry=r,
        )
        self.quota_reserved = Gauge(
            "onehop_gateway_quota_reserved_tokens",
            "Tokens reserved by requests in flight (prompt + completion budget), by tenant.",
            ["tenant"], registry=r, multiprocess_mode="livesum",
        )
        self.quota_unavailable = Counter(
            "onehop_gateway_quota_unavailable",
            "Quota operations the shared store did not answer, by what was done: admitted (quota_on_failure: "
            "open), refused (closed, a 503), settle_retried (tried again shortly), settle_failed (given up: its "
            "reservation stays charged); fairness_local: a round of the fair queue's shared counters (each process "
            "ordered by its own meanwhile).",
            ["action"], registry=r,
        )
        self.requests = Counter(
            "onehop_gateway_requests",
            "API requests by endpoint, route, model and status (499: the client left; a stream that ended "
            "with an error event after its 200 headers: that error's status).",
            ["endpoint", "route", "model", "status"], registry=r,
        )
        self.stream_errors = Counter(
            "onehop_gateway_stream_errors",
            "Streams that ended with an error event after their 200 headers, by endpoint, route and error type.",
            ["endpoint", "route", "error"], registry=r,
        )
        self.in_flight = Gauge(
            "onehop_gateway_in_flight_requests", "Requests being served now.", ["endpoint"],
            registry=r, multiprocess_mode="livesum",
        )
        self.stage_seconds = Histogram(
            "onehop_gateway_stage_seconds",
            "Gateway time per request in each stage: render, policy, derender (the derender's own compute).",
            ["stage"], buckets=_STAGE_BUCKETS, registry=r,
        )
        self.render_cache_tokens = Counter(
            "onehop_gateway_render_cache_tokens",
            "Prompt tokens rendered, by result: hit (taken from the worker's turn cache), miss (tokenized).",
            ["result"], registry=r,
        )
        self._cache_hits = self.render_cache_tokens.labels("hit")
        self._cache_misses = self.render_cache_tokens.labels("miss")
        self.derender_cpu = Counter(
            "onehop_gateway_derender_cpu_seconds",
            "Gateway CPU spent derendering engine output, by route.",
            ["route"],
            registry=r,
        )
        self.e2e = Histogram(
            "onehop_gateway_request_duration_seconds", "From request arrival to the last byte, by route.",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.time_to_first_token = Histogram(
            "onehop_gateway_time_to_first_token_seconds",
            "Streams: from request arrival to the first content sent, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "onehop_gateway_inter_token_latency_seconds", "Streams: gap between two writes to the client, by route.",
            ["route"], buckets=_GAP_BUCKETS, registry=r,
        )
        self.disconnects = Counter(
            "onehop_gateway_client_disconnects",
            "Clients that left before the answer was complete, by route.",
            ["route"],
            registry=r,
        )
        self.background_restarts = Counter(
            "onehop_gateway_background_restarts",
            "Background loops (health, dns, feedback, policy_file, key_file) restarted after a failure.",
            ["loop"], registry=r,
        )
        self.engine_aborts = Counter(
            "onehop_gateway_engine_aborts", "Abort requests sent to engines for clients that left.", registry=r
        )
        self.policy_decisions = Counter(
            "onehop_gateway_policy_decisions",
            "Route decisions by route and basis: a rule's name, `cost`, `default` or `header`.",
            ["route", "rule"], registry=r,
        )
        self.engine_retries = Counter(
            "onehop_gateway_engine_retries",
            "Requests this engine failed before answering, retried on another one.",
            ["engine"], registry=r,
        )
        # -- admission: priority and fair queueing (gateway.edge.admission), for autoscalers --
        self.admission_rejections = Counter(
            "onehop_gateway_admission_rejections",
            "Requests refused by admission control, by reason: tenant_limit and queue_share (429s, a tenant over "
            "its limit or its share), queue_full and queue_timeout (503s, the pool saturated).",
            ["reason"], registry=r,
        )
        self.admission_waiting = Gauge(
            "onehop_gateway_admission_waiting", "Requests waiting for a slot (admission control), by priority.",
            ["priority"], registry=r, multiprocess_mode="livesum",
        )
        self.admission_wait = Histogram(
            "onehop_gateway_admission_wait_seconds", "Time admitted requests waited for their slot, by priority.",
            ["priority"], buckets=_WAIT_BUCKETS, registry=r,
        )
        self.admission_in_use = Gauge(
            "onehop_gateway_admission_slots_in_use", "Admission slots held now (requests being served).",
            registry=r, multiprocess_mode="livesum",
        )
        self.admission_capacity = Gauge(
            "onehop_gateway_admission_slots", "Admission slots (admission.max_concurrency; 0: no limit).",
            registry=r, multiprocess_mode="livesum",
        )
        self.admission = AdmissionSignals(self)
        # -- end of admission --
        self.ignored_fields = Counter(
            "onehop_gateway_ignored_fields",
            "Unknown top-level request fields ignored (agents.unknown_fields: ignore), by endpoint and field "
            "(after 64 distinct names, `_other`).",
            ["endpoint", "field"], registry=r,
        )
        self.dropped_tools = Counter(
            "onehop_gateway_dropped_tools",
            "Hosted tools (web_search, ...) left out of the prompt (agents.hosted_tools: drop),"
            " by endpoint and tool type.",
            ["endpoint", "type"],
            registry=r,
        )
        self.context_edits_ignored = Counter(
            "onehop_gateway_context_edits_ignored",
            "Anthropic context_management edits of a type not served, ignored (the request is served unedited by "
            "them), by type (after 16 distinct types, `_other`).",
            ["type"], registry=r,
        )
        self.tokens = Counter(
            "onehop_gateway_tokens",
            "Tokens of the answered requests, as the client was told them, by model, endpoint, route and kind: "
            "prompt, cached (of the prompt, from the engine's prefix cache), completion, reasoning (of the "
            "completion).",
            ["model", "endpoint", "route", "kind"], registry=r,
        )
        self.circuit_open = Gauge(
            "onehop_gateway_engine_circuit_open", "1 while an engine's circuit breaker is open, else 0.", ["engine"],
            registry=r, multiprocess_mode="livemax",
        )
        self.kv_events = Counter(
            "onehop_gateway_kv_events",
            "KV cache events received from engines, by engine and type (BlockStored, BlockRemoved, AllBlocksCleared).",
            ["engine", "type"], registry=r,
        )
        self.kv_event_errors = Counter(
            "onehop_gateway_kv_event_errors",
            "KV cache event batches lost or events not indexed, by engine and reason: frames, seq, decode, gap, "
            "replay_failed, restart, internal (a batch lost); block_size, medium, group, shape, token_ids, "
            "unknown_parent, duplicate (a stored event, or a block of one, not indexed).",
            ["engine", "reason"], registry=r,
        )
        self.kv_replays = Counter(
            "onehop_gateway_kv_replays",
            "Replays of missed KV event batches asked of an engine, by outcome (ok, failed).",
            ["engine", "outcome"], registry=r,
        )
        self.kv_index_blocks = Gauge(
            "onehop_gateway_kv_index_blocks", "Prefix blocks in the KV cache index (once per engine rank holding one).",
            registry=r, multiprocess_mode="livemax",
        )
        self.kv_engine_stale = Gauge(
            "onehop_gateway_kv_engine_stale",
            "1 while the KV cache index has lost events of an engine (its entries were dropped), else 0.",
            ["engine"], registry=r, multiprocess_mode="livemax",
        )

    def child(self, metric: M, *values: str) -> M:
        """`metric.labels(*values)`, found in a dict: `labels()` checks and converts its arguments
        on every call (~3 µs, ~15 calls a request). Holds no more children than the metric
        itself: every label value on a request's path comes from a bounded set (the config's
        names, routes, statuses), never from a client's input."""
        children = self._children.get(metric)
        if children is None:
            children = self._children[metric] = {}
        found = children.get(values)
        if found is None:
            found = children[values] = metric.labels(*values)
        return found

    def render_cache(self, hits: int, tokenized: int) -> None:
        """A render's tokens from the turn cache and tokenized (`LocalRenderer(on_cache=...)`, on its threads:
        prometheus-client's values take their own lock)."""
        if hits:
            self._cache_hits.inc(hits)
        if tokenized:
            self._cache_misses.inc(tokenized)

    def kv_ignored(self, engine: str, reason: str) -> None:
        """A stored event the KV cache index did not index (`KVIndex(on_ignored=...)`)."""
        self.kv_event_errors.labels(engine, reason).inc()

    def record(self, outcome: Outcome) -> None:
        """A request's outcome: its count, duration, disconnect or stream error, and tokens
        (subscribed in `gateway.serving.app`)."""
        model, endpoint, route = outcome.model or "none", outcome.endpoint, outcome.route
        child = self.child
        child(self.requests, endpoint, route, model, str(outcome.status)).inc()
        child(self.e2e, route).observe(outcome.duration_s)
        if outcome.client_gone:
            self.disconnects.labels(route).inc()
        if outcome.stream_error:
            self.stream_errors.labels(endpoint, route, outcome.error or "unknown").inc()
        tokens = outcome.tokens
        if tokens is not None:
            for kind, count in (
                ("prompt", tokens.prompt),
                ("cached", tokens.cached),
                ("completion", tokens.completion),
                ("reasoning", tokens.reasoning),
            ):
                if count:
                    child(self.tokens, model, endpoint, route, kind).inc(count)

    def tenant_label(self, tenant: str | None) -> str:
        return tenant if tenant is not None and tenant in self.tenants else OTHER_TENANTS

    def record_tenant(self, outcome: Outcome) -> None:
        """A request's usage by tenant (subscribed in `gateway.serving.app`)."""
        label = self.tenant_label(outcome.tenant)
        self.child(self.tenant_requests, label).inc()
        tokens = outcome.tokens
        if tokens is not None:
            kinds = (("prompt", tokens.prompt), ("cached", tokens.cached), ("completion", tokens.completion))
            for kind, count in kinds:
                if count:
                    self.child(self.tenant_tokens, label, kind).inc(count)

    def circuit(self, engine: str, is_open: bool) -> None:
        """An engine's circuit changed (or the engine joined the pool: closed), so dashboards see zeros, not gaps."""
        self.engine_retries.labels(engine)
        self.circuit_open.labels(engine).set(1 if is_open else 0)

    def render(self) -> bytes:
        folder = os.environ.get(_MULTIPROCESS_ENV)
        if folder is None:
            own = generate_latest(self.registry)
        else:
            every_worker = CollectorRegistry()
            MultiProcessCollector(every_worker, path=folder)  # type: ignore[no-untyped-call]  # unannotated upstream
            own = generate_latest(every_worker)
        return b"".join([own, *(render() for render in self.also)]) if self.also else own


class LocalHistogram:
    """One stream's observations of a histogram, kept as bucket counts and flushed once.

    A per-write `Histogram.observe` takes the metric's lock and walks its buckets
    on the hot path; here a write costs one bisection, and the stream's counts
    reach the shared histogram when it ends (through the same per-bucket values
    `observe` updates, so a scrape sees the same series either way).
    """

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = list(bounds)  # upper bounds, +Inf last, as the histogram's
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    @classmethod
    def like(cls, child: Histogram) -> LocalHistogram:
        return cls(child._upper_bounds)  # prometheus-client keeps the bounds there

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # `value <= bound`, as Histogram.observe
        self._sum += value

    def flush(self, child: Histogram) -> None:
        """Add what was observed to `child` (a labelled histogram), then start again from zero."""
        counts = self._counts
        if not any(counts):
            return
        for index, count in enumerate(counts):
            if count:
                child._buckets[index].inc(count)
        child._sum.inc(self._sum)
        self._counts = [0] * len(counts)
        self._sum = 0.0


class AdmissionSignals:
    """The admission gate's reports (`gateway.edge.admission.Signals`) as metrics. Priorities
    are labels, at most `PRIORITY_LABELS` distinct ones: a client may ask for any value."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._labels: dict[int, str] = {}

    def _label(self, priority: int) -> str:
        label = self._labels.get(priority)
        if label is None:
            if len(self._labels) >= PRIORITY_LABELS:
                return "_other"  # not kept: the map stays bounded too
            label = self._labels[priority] = str(priority)
        return label

    def rejected(self, reason: str) -> None:
        self._metrics.admission_rejections.labels(reason).inc()

    def queued(self, priority: int, waiting: int) -> None:
        metrics = self._metrics
        metrics.child(metrics.admission_waiting, self._label(priority)).set(waiting)

    def waited(self, priority: int, seconds: float) -> None:
        metrics = self._metrics
        metrics.child(metrics.admission_wait, self._label(priority)).observe(seconds)

    def in_use(self, used: int, capacity: int | None) -> None:
        self._metrics.admission_in_use.set(used)
        self._metrics.admission_capacity.set(capacity or 0)
