"""OpenTelemetry tracing for the gateway and the engine: one provider per app.

Each app owns its `TracerProvider` (no global state), so a gateway and an
embedded engine in one process export as two services. Tracing is on when an
OTLP/HTTP endpoint is known: `TracingConfig.endpoint`, else the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`
variables (`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off).
Off, the tracer is OpenTelemetry's no-op one and spans cost a few attribute
checks. Trace context crosses processes as W3C `traceparent`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, MutableMapping
from typing import Annotated

from msgspec import Meta, Struct
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = TraceContextTextMapPropagator()


class TracingConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    endpoint: str | None = None
    """OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces); else the OTEL_* variables."""
    sample_ratio: Annotated[float, Meta(ge=0, le=1)] | None = None
    """Share of new traces kept (parent-based); else OTEL_TRACES_SAMPLER(_ARG), default all."""
    service_name: str | None = None
    """Else OTEL_SERVICE_NAME, else onehop-gateway / onehop-engine."""
    record_content: bool = False
    """Put prompt and completion text on spans. Off unless set: prompts are user data."""


def _env_endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_enabled(config: TracingConfig) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(config.endpoint or _env_endpoint())


class Tracing:
    """An app's tracer and, when tracing is on, the provider that exports its spans."""

    def __init__(self, config: TracingConfig, default_service: str) -> None:
        self.config = config
        self.record_content = config.record_content
        self._provider = None
        if not tracing_enabled(config):
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        # Imported here: a process that never traces never loads the SDK or protobuf.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        service = config.service_name or os.environ.get("OTEL_SERVICE_NAME") or default_service
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio)) if config.sample_ratio is not None else None
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}), sampler=sampler)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
        self._provider = provider
        self.tracer = provider.get_tracer("onehop")

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    async def shutdown(self) -> None:
        """Export what is left. Off the loop: the exporter's HTTP call blocks, and a
        collector on this same loop (tests, sidecars in-process) must stay served."""
        if self._provider is not None:
            await asyncio.to_thread(self._provider.shutdown)


def inject(headers: MutableMapping[str, str], span: Span) -> None:
    """Add `traceparent` (and `tracestate`) naming `span` as the parent to outgoing headers."""
    TRACEPARENT.inject(headers, context=trace.set_span_in_context(span))


def extract(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from incoming headers (an empty one if absent)."""
    return TRACEPARENT.extract(headers)


def traceresponse(span: Span) -> str | None:
    """W3C Trace Context Level 2's `traceresponse` header value naming `span` (version, trace id,
    span id, flags: `00-<32 hex>-<16 hex>-<2 hex>`), so a client can find its request's trace;
    None for a span of no trace (tracing off). A span sampled out still names its trace (flags 00)."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def trace_id(span: Span) -> str | None:
    """The 32 hex digits of `span`'s trace, None for a span of no trace (tracing off)."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


def record_error(span: Span, exc: BaseException, *, kind: str | None = None) -> None:
    """Mark a span failed with OpenTelemetry's `error.type` (the exception class unless given)."""
    if not span.is_recording():
        return
    span.set_attribute("error.type", kind or type(exc).__name__)
    span.set_status(Status(StatusCode.ERROR, str(exc)[:300]))
