"""The gateway's Prometheus metrics, one registry per app. Names are in the README."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STAGE_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "onehop_gateway_requests", "OpenAI requests by endpoint, route, model and HTTP status.",
            ["endpoint", "route", "model", "status"], registry=r,
        )
        self.in_flight = Gauge("onehop_gateway_in_flight_requests", "Requests being served now.", ["endpoint"], registry=r)
        self.render_seconds = Histogram(
            "onehop_gateway_render_seconds", "Render (chat template + tokenize) time per request.", buckets=_STAGE_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "onehop_gateway_request_duration_seconds", "From request arrival to the last byte, by route.",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.disconnects = Counter(
            "onehop_gateway_client_disconnects", "Clients that left before the answer was complete, by route.", ["route"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
