"""What the gateway records about each request: its spans and its stream timings.

    chat {model}                server span (GenAI conventions), opened by the middleware
    ├── render                  chat template + tokenize
    ├── policy                  route decision, with the rule or cost comparison
    ├── engine.generate         client span; `traceparent` → the engine's server span
    └── derender                text and token routes: the stateful derender's work

Spans are explicit (each helper takes the span it writes to), so code that
runs inside the engine request never writes to the wrong one. With tracing
off every span is OpenTelemetry's no-op span and `is_recording()` is False.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from plumbing.telemetry import record_error
from gateway.edge.context import Edge
from gateway.observe.metrics import GatewayMetrics, LocalHistogram
from gateway.observe.outcome import Outcome, Tally, Tokens
from gateway.serving.state import GatewayState

OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat", "messages": "chat"}
"""gen_ai.operation.name of each endpoint."""


@contextmanager
def stage(tracer: trace.Tracer, name: str, parent: Span, *, kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
    """A child span of `parent` for one step of the request; failures set `error.type`."""
    span = tracer.start_span(name, context=trace.set_span_in_context(parent), kind=kind)
    try:
        yield span
    except asyncio.CancelledError:
        span.set_attribute("onehop.client_disconnected", True)
        raise
    except Exception as exc:
        record_error(span, exc)
        raise
    finally:
        span.end()


@contextmanager
def measured(state: GatewayState, name: str, parent: Span) -> Iterator[Span]:
    """A `stage` span that also feeds `onehop_gateway_stage_seconds{stage=name}` when it succeeds."""
    started = time.perf_counter()
    with stage(state.tracing.tracer, name, parent) as span:
        yield span
    state.metrics.stage_seconds.labels(name).observe(time.perf_counter() - started)


def describe_model(span: Span, operation: str, model: str | None) -> None:
    """The model the request names, on the server span (GenAI: named `{operation} {model}`)."""
    if span.is_recording() and model is not None:
        span.update_name(f"{OPERATIONS[operation]} {model}")
        span.set_attribute("gen_ai.request.model", model)


def describe_request(
    span: Span,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    n: int | None,
    seed: int | None,
    stream: bool,
) -> None:
    if not span.is_recording():
        return
    attributes: dict[str, Any] = {"onehop.stream": stream}
    for key, value in (
        ("gen_ai.request.max_tokens", max_tokens),
        ("gen_ai.request.temperature", temperature),
        ("gen_ai.request.top_p", top_p),
        ("gen_ai.request.choice.count", n),
        ("gen_ai.request.seed", seed),
    ):
        if value is not None:
            attributes[key] = value
    span.set_attributes(attributes)


def describe_outcome(outcome: Outcome) -> None:
    """The outcome on the request's server span: GenAI usage and finish reasons, route, status."""
    span = outcome.span
    if not span.is_recording():
        return
    attributes: dict[str, Any] = {"onehop.route": outcome.route}
    if outcome.client_gone:
        attributes["onehop.client_disconnected"] = True
    else:
        attributes["http.response.status_code"] = outcome.status
    if outcome.tokens is not None:
        attributes["gen_ai.response.finish_reasons"] = [reason or "" for reason in outcome.finish_reasons]
        attributes["gen_ai.usage.input_tokens"] = outcome.tokens.prompt
        attributes["gen_ai.usage.output_tokens"] = outcome.tokens.completion
        if outcome.tokens.cached:
            attributes["gen_ai.usage.cache_read.input_tokens"] = outcome.tokens.cached
        if outcome.tokens.reasoning:
            attributes["onehop.usage.reasoning_tokens"] = outcome.tokens.reasoning
    if outcome.error is not None:
        attributes["error.type"] = outcome.error
        if outcome.status >= 500 and not outcome.client_gone:
            span.set_status(Status(StatusCode.ERROR))
    span.set_attributes(attributes)


def record_derender(tally: Tally, derender: Any) -> None:
    """The outcome of the gateway's own derender (text and token routes): what the client saw."""
    reasons = [choice.finish_reason for choice in derender.choices]
    tally.record(reasons, Tokens.of_usage(derender.usage()))


class StreamTimer:
    """Time to first content and the gaps between writes of one client stream.

    The gaps are counted locally and reach the histogram when the stream ends
    (`flush`): a write costs one clock read and one bisection.
    """

    __slots__ = ("_first", "_gaps", "_itl", "_last", "_span", "_started", "_ttft")

    def __init__(self, ctx: Edge, metrics: GatewayMetrics, route: str) -> None:
        self._started = ctx.started
        self._span = ctx.span
        self._ttft = metrics.time_to_first_token.labels(route)
        self._itl = metrics.inter_token_latency.labels(route)
        self._gaps = LocalHistogram.like(self._itl)
        self._first = True
        self._last = 0.0

    def wrote(self) -> None:
        now = time.perf_counter()
        if self._first:
            self._first = False
            self._ttft.observe(now - self._started)
            if self._span.is_recording():
                self._span.set_attribute("onehop.time_to_first_token_s", now - self._started)
        else:
            self._gaps.observe(now - self._last)
        self._last = now

    def flush(self) -> None:
        self._gaps.flush(self._itl)


CPU_SAMPLE_EVERY = 16
"""One engine read in this many has the derender's thread CPU read (as the engine samples its
steps): a `thread_time` read is a system call, and two a read were 40% of the text route's
derender of a one-token chunk."""


class DerenderWork:
    """The gateway's derender work for one request (text and token routes).

    CPU is thread time over `begin()`/`end()` pairs around the engine reads it
    times: the first read is timed whole (it carries the head), the second and then one in
    `CPU_SAMPLE_EVERY` are samples, and the reads between count at the samples'
    mean. `finish()` puts it on the `derender` span, the stage histogram and the
    per-route counter, and the client-visible outcome on the server span.
    """

    __slots__ = (
        "_countdown",
        "_first",
        "_first_s",
        "_mark",
        "_metrics",
        "_route",
        "_sampled",
        "_sampled_s",
        "_span",
        "_tally",
        "_untimed",
    )

    def __init__(self, ctx: Edge, state: GatewayState, route: str) -> None:
        self._metrics = state.metrics
        self._tally = ctx.tally
        self._route = route
        self._first = True
        self._first_s = self._sampled_s = self._mark = 0.0
        self._sampled = self._untimed = self._countdown = 0
        self._span: Span | None = None
        if ctx.span.is_recording():
            self._span = state.tracing.tracer.start_span("derender", context=trace.set_span_in_context(ctx.span))

    def begin(self) -> bool:
        """A read's derender starts; True when it is timed (`end()` then follows it)."""
        if self._countdown:
            self._countdown -= 1
            self._untimed += 1
            return False
        self._mark = time.thread_time()
        return True

    def end(self) -> None:
        spent = time.thread_time() - self._mark
        if self._first:
            self._first = False
            self._first_s = spent
        else:
            self._sampled_s += spent
            self._sampled += 1
            self._countdown = CPU_SAMPLE_EVERY - 1

    @property
    def chunks(self) -> int:
        """The engine reads derendered."""
        return (0 if self._first else 1) + self._sampled + self._untimed

    @property
    def cpu_s(self) -> float:
        if not self._sampled:
            return self._first_s
        return self._first_s + self._sampled_s / self._sampled * (self._sampled + self._untimed)

    def finish(self, derender: Any | None) -> None:
        """Record the work; `derender` (when one object saw the whole answer) describes the outcome."""
        metrics = self._metrics
        cpu_s = self.cpu_s
        metrics.derender_cpu.labels(self._route).inc(cpu_s)
        metrics.stage_seconds.labels("derender").observe(cpu_s)
        if derender is not None:
            record_derender(self._tally, derender)
        if self._span is not None:
            self._span.set_attributes(
                {"onehop.route": self._route, "onehop.derender.cpu_s": cpu_s, "onehop.derender.chunks": self.chunks}
            )
            self._span.end()
