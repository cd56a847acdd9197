"""What the gateway records about each request: its spans and its stream timings.

    chat {model}                server span, opened by the middleware: the request's one LLM
    │                           call (GenAI conventions and OpenInference's `LLM` kind)
    ├── render                  chat template + tokenize
    ├── policy                  route decision, with the rule or cost comparison
    └── engine.generate         client span; `traceparent` → the engine's server span (a `CHAIN`)

The server span is named by the served model (a bounded set: a name the client made up is
not a span name) and described from the request's outcome: its usage, finish reasons and
status, in both conventions, so an LLM trace UI counts each request's tokens once. The text
and token routes' derender work, interleaved with the stream, is `onehop.derender.*` on it.

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
from gateway.observe.content import output_messages
from gateway.observe.metrics import GatewayMetrics, LocalHistogram
from gateway.observe.outcome import Outcome, Tally, Tokens
from gateway.serving.state import GatewayState

OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat", "messages": "chat"}
"""gen_ai.operation.name of each endpoint."""
PROVIDER = "onehop"
"""`gen_ai.provider.name` and OpenInference's `llm.provider`: who answered (the conventions'
well-known values name hosted services; a self-hosted gateway names itself)."""


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
    metrics = state.metrics
    metrics.child(metrics.stage_seconds, name).observe(time.perf_counter() - started)


def describe_arrival(span: Span, operation: str, method: str, path: str) -> None:
    """A request's server span as it opens: the LLM call it is, in both conventions."""
    if span.is_recording():
        span.set_attributes(
            {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER,
                "openinference.span.kind": "LLM",
                "llm.provider": PROVIDER,
                "http.request.method": method,
                "url.path": path,
            }
        )


def describe_model(span: Span, model: str | None) -> None:
    """The model the request names, as sent (the span's name waits for a served one: `describe_outcome`)."""
    if span.is_recording() and model is not None:
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
    attributes: dict[str, Any] = {"onehop.stream": stream, "gen_ai.request.stream": stream}
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
    """The outcome on the request's server span: its name (by the served model), the model, usage
    and finish reasons in GenAI's and OpenInference's names, route, status."""
    span = outcome.span
    if not span.is_recording():
        return
    attributes: dict[str, Any] = {"onehop.route": outcome.route}
    if outcome.model is not None:  # a served model's name: bounded, unlike what a client may send
        span.update_name(f"{OPERATIONS[outcome.endpoint]} {outcome.model}")
        attributes["gen_ai.response.model"] = attributes["llm.model_name"] = outcome.model
    if outcome.client_gone:
        attributes["onehop.client_disconnected"] = True
    else:
        attributes["http.response.status_code"] = outcome.status
    if outcome.tokens is not None:
        attributes["gen_ai.response.finish_reasons"] = [reason or "" for reason in outcome.finish_reasons]
        attributes.update(usage_attributes(outcome.tokens))
    if outcome.content is not None and outcome.status < 400:  # `tracing.record_content`
        reasons = outcome.finish_reasons
        attributes["gen_ai.output.messages"] = output_messages(outcome.endpoint, outcome.content, reasons)
    if outcome.error is not None:
        attributes["error.type"] = outcome.error
        if outcome.stream_error:
            attributes["onehop.stream_error"] = True
        if outcome.status >= 500 and not outcome.client_gone:
            span.set_status(Status(StatusCode.ERROR))
    span.set_attributes(attributes)


def usage_attributes(tokens: Tokens) -> dict[str, int]:
    """A request's tokens in GenAI's names and OpenInference's (which trace UIs such as Phoenix
    sum per project: only this span carries them, so each request counts once)."""
    attributes = {
        "gen_ai.usage.input_tokens": tokens.prompt,
        "gen_ai.usage.output_tokens": tokens.completion,
        "llm.token_count.prompt": tokens.prompt,
        "llm.token_count.completion": tokens.completion,
        "llm.token_count.total": tokens.prompt + tokens.completion,
    }
    if tokens.cached:
        attributes["gen_ai.usage.cache_read.input_tokens"] = tokens.cached
        attributes["llm.token_count.prompt_details.cache_read"] = tokens.cached
    if tokens.reasoning:
        attributes["onehop.usage.reasoning_tokens"] = tokens.reasoning
        attributes["llm.token_count.completion_details.reasoning"] = tokens.reasoning
    return attributes


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
        self._ttft = metrics.child(metrics.time_to_first_token, route)
        self._itl = metrics.child(metrics.inter_token_latency, route)
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
    mean. `finish()` puts it on the stage histogram, the per-route counter and the server
    span (`onehop.derender.*`: the work is spread over the stream, so a span of its own would
    time the stream, not the derender), and the client-visible answer on the tally.
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
        self._span = ctx.span

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
        if self._span.is_recording():
            self._span.set_attributes({"onehop.derender.cpu_s": cpu_s, "onehop.derender.chunks": self.chunks})
