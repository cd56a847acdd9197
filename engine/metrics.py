"""The engine's Prometheus metrics, one registry per app (no global state).

Names are documented in docs/engine.md. `onehop_engine_output_cpu_seconds_total`
is the number the gateway's cost policy reads: CPU the engine spent turning
ids into text or OpenAI objects and writing them, by output mode (how it is
measured: `engine.generate._Times.output_s`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.backends.base import PrefixCacheStats

# Finer from 10 to 50 ms: typical times to first token and decode steps fall there (issue #33).
_LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_GAP_BUCKETS = (
    1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1,
    2.5,
)
_CPU_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1)


class StepBuckets:
    """One label set of a `StepHistogram`: plain bucket counts, no lock.

    Hot path: `observe` runs once per generated token. prometheus_client's
    `Histogram.observe` takes a lock and walks the buckets (about 0.7 µs here,
    a fifth of a token's derender); a C-level bisect and a list increment cost
    about a tenth of that. The engine serves from one event-loop thread, and
    scrapes run on it too, so nothing else writes these counts meanwhile.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # `le` is inclusive, as bisect_left finds it
        self.sum += value

    def merge(self, counts: Sequence[int], total: float) -> None:
        """Add the per-bucket counts (not cumulative) and the sum of many observations."""
        mine = self.counts
        for i, count in enumerate(counts):
            mine[i] += count
        self.sum += total


class StepHistogram(Collector):
    """A histogram with prometheus_client's name, labels, buckets and exposition, for per-token samples."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(float(bound) for bound in buckets)
        self._children: dict[tuple[str, ...], StepBuckets] = {}
        registry.register(self)

    def labels(self, *values: str) -> StepBuckets:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = StepBuckets(self._bounds)
        return child

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        # prometheus-client leaves floatToGoString unannotated.
        edges = [floatToGoString(bound) for bound in self._bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for values, child in self._children.items():
            total = 0
            cumulative: list[tuple[str, float]] = []
            for edge, count in zip(edges, child.counts, strict=True):
                total += count
                cumulative.append((edge, total))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


class PrefixCacheCollector(Collector):
    """vLLM's prefix-cache metrics, under vLLM's names and labels, so what reads a vLLM
    engine's /metrics (a router's cache-aware policy, a dashboard) reads this one too.
    Read from the backend at each scrape; nothing is written while serving."""

    def __init__(self, stats: Callable[[], PrefixCacheStats | None], model: Callable[[], str]) -> None:
        self._stats = stats
        self._model = model
        """The model's name, asked at collection (a backend knows it once started)."""
        self._labels = ["model_name", "engine"]

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        return []  # what the backend has is known only at collection: skip the registry's name checks

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        labels = self._labels
        families: list[CounterMetricFamily | GaugeMetricFamily] = [
            CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens.", labels=labels),
            CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens.", labels=labels),
            GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1 (1 is full).", labels=labels),
            GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be started.", labels=labels),
        ]
        for family, value in zip(families, (stats.queries, stats.hits, stats.usage, stats.waiting), strict=True):
            family.add_metric([self._model(), "0"], value)
            yield family
        if stats.blocks:
            # vLLM's info gauge: the cache config as labels, the value 1 (a router reads the size).
            info = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                labels=["block_size", "num_gpu_blocks", "engine"],
            )
            info.add_metric([str(stats.block_size), str(stats.blocks), "0"], 1)
            yield info


@dataclass
class EngineMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "onehop_engine_requests",
            "Generate requests by output mode and HTTP status.",
            ["mode", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "onehop_engine_in_flight_requests", "Generate requests running now.", ["mode"], registry=r
        )
        self.output_tokens = Counter(
            "onehop_engine_output_tokens", "Generated tokens by output mode.", ["mode"], registry=r
        )
        self.output_cpu = Counter(
            "onehop_engine_output_cpu_seconds",
            "Engine CPU spent on output (detokenizing, parsing, serializing, writing), by output mode.",
            ["mode"],
            registry=r,
        )
        self.output_cpu_per_request = Histogram(
            "onehop_engine_request_output_cpu_seconds",
            "Output-processing CPU of one request, by output mode.",
            ["mode"],
            buckets=_CPU_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "onehop_engine_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = StepHistogram(
            "onehop_engine_inter_token_latency_seconds",
            "Gap between two backend outputs of one request (a decode step, plus any wait).",
            ["mode"],
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "onehop_engine_queue_seconds",
            "From request arrival to the backend starting it (the batch had room).",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "onehop_engine_request_duration_seconds",
            "From request arrival to the last byte.",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.aborts = Counter(
            "onehop_engine_aborts",
            "Requests ended early: client_disconnect or abort_request.",
            ["reason"],
            registry=r,
        )

    def watch_prefix_cache(self, stats: Callable[[], PrefixCacheStats | None], model: Callable[[], str]) -> None:
        """Expose a backend's prefix-cache counters under vLLM's names (when it has a cache)."""
        self.registry.register(PrefixCacheCollector(stats, model))

    def render(self) -> bytes:
        return generate_latest(self.registry)
