"""The engine's Prometheus metrics, one registry per app (no global state).

Names are documented in the README. `onehop_engine_output_cpu_seconds_total`
is the number the gateway's cost policy reads: CPU the engine spent turning
ids into text or OpenAI objects, by output mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_GAP_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_CPU_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1)


@dataclass
class EngineMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "onehop_engine_requests", "Generate requests by output mode and HTTP status.", ["mode", "status"], registry=r
        )
        self.in_flight = Gauge("onehop_engine_in_flight_requests", "Generate requests running now.", ["mode"], registry=r)
        self.output_tokens = Counter(
            "onehop_engine_output_tokens", "Generated tokens by output mode.", ["mode"], registry=r
        )
        self.output_cpu = Counter(
            "onehop_engine_output_cpu_seconds",
            "Engine CPU spent detokenizing, parsing and formatting output, by output mode.",
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
        self.inter_token_latency = Histogram(
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
