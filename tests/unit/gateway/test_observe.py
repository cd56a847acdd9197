"""What the gateway records of a request (`gateway.observe.spans`): stage spans, stream timings, derender work, the outcome's span.

Spans go to OpenTelemetry's SDK with its in-memory exporter; metrics are the
gateway's own registry, read as a scrape reads it. The helpers take a request's
context (`gateway.edge.context.Edge`), as the pipeline hands them: no aiohttp request. What a whole request records end to end
(one outcome per request, the span tree across gateway and engine) is
`tests/integration/test_outcome.py`'s and `test_tracing.py`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, SpanKind, StatusCode

from wire.openai_schema import CompletionTokensDetails, PromptTokensDetails, Usage
from plumbing.telemetry import Tracing, TracingConfig
from gateway.edge.admission import Gate
from gateway.config import Admission, EngineEndpoint, GatewayConfig
from gateway.edge.errors import EngineFailed
from gateway.routing.feedback import EngineFeedback
from gateway.edge.context import Edge
from gateway.observe.spans import (
    CPU_SAMPLE_EVERY,
    DerenderWork,
    StreamTimer,
    describe_arrival,
    describe_model,
    describe_outcome,
    describe_request,
    measured,
    record_derender,
)
from gateway.observe.outcome import CLIENT_GONE, Outcome, Tally, Tokens
from gateway.serving.state import GatewayState

BURN_S = 0.005
"""CPU one timed derender read spends (busy, on this thread), so its sample is measurable."""


@dataclass
class Observed:
    state: GatewayState
    spans: InMemorySpanExporter
    tracer: trace.Tracer

    def sample(self, name: str, **labels: str) -> float:
        return self.state.metrics.registry.get_sample_value(name, labels) or 0.0

    def finished(self, name: str) -> ReadableSpan:
        (span,) = [span for span in self.spans.get_finished_spans() if span.name == name]
        return span

    def attributes(self, name: str) -> dict[str, Any]:
        return dict(self.finished(name).attributes or {})


@pytest.fixture
def observed() -> Iterator[Observed]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(TracingConfig(), "onehop-gateway")
    tracing.tracer = provider.get_tracer("onehop")
    config = GatewayConfig(model="m", tokenizer="unused", engines=[EngineEndpoint(url="http://127.0.0.1:9")])
    state = GatewayState(
        config=config, gate=Gate(Admission()), clients=[], feedback=EngineFeedback(lambda: [], 1.0), tracing=tracing
    )
    yield Observed(state, exporter, tracing.tracer)
    provider.shutdown()


def edge(span: Span = trace.INVALID_SPAN, started: float | None = None) -> Edge:
    """A request's edge as the pipeline hands it to these helpers: no aiohttp request needed."""
    return Edge(
        request_id="chatcmpl-1", endpoint="chat", tenant=None, owner="anonymous", headers={}, span=span,
        started=time.perf_counter() if started is None else started, deadline=None, tally=Tally(),
    )


def server_span(observed: Observed) -> Span:
    return observed.tracer.start_span("chat m", kind=SpanKind.SERVER)


@dataclass
class Choice:
    finish_reason: str | None


@dataclass
class Derendered:
    """What the gateway's derender hands over at the end: its choices and its usage."""

    choices: list[Choice]
    usage_: Usage

    def usage(self) -> Usage:
        return self.usage_


ANSWER = Derendered(
    [Choice("stop"), Choice("length")],
    Usage(
        prompt_tokens=12,
        completion_tokens=9,
        total_tokens=21,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=8),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=4),
    ),
)


def test_a_derender_is_tallied_as_the_client_was_told() -> None:
    answered = Tally()
    record_derender(answered, ANSWER)
    assert answered.finish_reasons == ("stop", "length")
    assert answered.tokens == Tokens(prompt=12, cached=8, completion=9, reasoning=4)


# ------------------------------------------------------------ stream timings


def test_stream_timer_first_content_from_the_requests_arrival_and_gaps_at_the_end(observed: Observed) -> None:
    ttft = "onehop_gateway_time_to_first_token_seconds"
    gaps = "onehop_gateway_inter_token_latency_seconds"
    span = server_span(observed)
    arrived = edge(span, started=time.perf_counter() - 1.0)  # the request arrived a second ago
    timer = StreamTimer(arrived, observed.state.metrics, "tokens")
    for _ in range(4):
        timer.wrote()
    span.end()
    assert observed.sample(ttft + "_count", route="tokens") == 1
    assert 1.0 <= observed.sample(ttft + "_sum", route="tokens") < 60
    assert observed.sample(gaps + "_count", route="tokens") == 0  # kept by the stream until it ends
    timer.flush()
    assert observed.sample(gaps + "_count", route="tokens") == 3
    timer.flush()  # what was flushed is not added twice
    assert observed.sample(gaps + "_count", route="tokens") == 3
    assert observed.sample(ttft + "_count", route="derender") == 0
    assert observed.attributes("chat m")["onehop.time_to_first_token_s"] >= 1.0


def test_stream_timer_of_a_request_without_a_recording_span(observed: Observed) -> None:
    """Tracing off (the no-op span): the timings still reach the metrics, no span is written."""
    before = time.perf_counter()
    timer = StreamTimer(edge(started=before), observed.state.metrics, "text")
    timer.wrote()
    assert 0 <= observed.sample("onehop_gateway_time_to_first_token_seconds_sum", route="text") <= time.perf_counter() - before
    assert observed.spans.get_finished_spans() == ()


# ------------------------------------------------------------ the gateway's derender work


def burn(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU: the work of one derendered read."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def derender_reads(work: DerenderWork, reads: int) -> list[bool]:
    """`reads` engine reads derendered as the relay times them; whether each was timed."""
    timed = []
    for _ in range(reads):
        timed.append(work.begin())
        if timed[-1]:
            burn(BURN_S)
            work.end()
    return timed


def test_derender_cpu_times_the_first_read_then_samples_one_in_n(observed: Observed) -> None:
    n = CPU_SAMPLE_EVERY

    derender = DerenderWork(edge(), observed.state, "text")
    assert (derender.chunks, derender.cpu_s) == (0, 0.0)
    timed = derender_reads(derender, 2 + 2 * n)
    assert timed == [True, True] + [False] * (n - 1) + [True] + [False] * (n - 1) + [True]
    assert derender.chunks == 2 + 2 * n
    # The untimed reads count at the samples' mean: about one BURN_S each, not nothing.
    assert derender.cpu_s >= (2 + 2 * n) * BURN_S * 0.9


def test_derender_work_is_recorded_on_the_server_span_and_metrics_and_the_outcome(observed: Observed) -> None:
    span = server_span(observed)
    ctx = edge(span)
    work = DerenderWork(ctx, observed.state, "tokens")
    derender_reads(work, 3)
    work.finish(ANSWER)
    span.end()
    cpu_s = work.cpu_s
    assert observed.sample("onehop_gateway_derender_cpu_seconds_total", route="tokens") == pytest.approx(cpu_s)
    assert observed.sample("onehop_gateway_stage_seconds_count", stage="derender") == 1
    assert observed.sample("onehop_gateway_stage_seconds_sum", stage="derender") == pytest.approx(cpu_s)
    assert ctx.tally.finish_reasons == ("stop", "length")
    # On the server span: the work is spread over the stream, a span of its own would time the stream.
    assert observed.attributes("chat m") == {"onehop.derender.cpu_s": cpu_s, "onehop.derender.chunks": 3}
    assert [s.name for s in observed.spans.get_finished_spans()] == ["chat m"]


def test_derender_work_of_a_request_without_a_recording_span_or_whole_answer(observed: Observed) -> None:
    ctx = edge(trace.INVALID_SPAN)  # tracing off
    derender = DerenderWork(ctx, observed.state, "text")
    derender_reads(derender, 1)
    derender.finish(None)  # several legs: the merged answer is tallied elsewhere
    assert observed.sample("onehop_gateway_derender_cpu_seconds_total", route="text") == pytest.approx(derender.cpu_s)
    assert ctx.tally.tokens is None
    assert observed.spans.get_finished_spans() == ()


# ------------------------------------------------------------ stages


async def test_a_measured_stage_is_a_child_span_and_a_histogram_sample(observed: Observed) -> None:
    parent = server_span(observed)
    with measured(observed.state, "render", parent) as span:
        span.set_attribute("onehop.prompt_tokens", 3)
    parent.end()
    render = observed.finished("render")
    assert render.parent is not None and render.parent.span_id == parent.get_span_context().span_id
    assert observed.attributes("render") == {"onehop.prompt_tokens": 3} and render.status.status_code == StatusCode.UNSET
    assert observed.sample("onehop_gateway_stage_seconds_count", stage="render") == 1


async def test_a_failed_stage_is_marked_and_not_timed(observed: Observed) -> None:
    parent = server_span(observed)
    with pytest.raises(EngineFailed), measured(observed.state, "policy", parent):
        raise EngineFailed("no")
    policy = observed.finished("policy")
    assert observed.attributes("policy")["error.type"] == "EngineFailed"
    assert policy.status.status_code == StatusCode.ERROR
    assert observed.sample("onehop_gateway_stage_seconds_count", stage="policy") == 0


async def test_a_stage_whose_client_left_says_so_and_is_not_timed(observed: Observed) -> None:
    parent = server_span(observed)
    entered = asyncio.Event()

    async def render() -> None:
        with measured(observed.state, "render", parent):
            entered.set()
            await asyncio.Event().wait()  # never set: the client leaves first

    task = asyncio.ensure_future(render())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stage = observed.finished("render")
    assert observed.attributes("render") == {"onehop.client_disconnected": True}
    assert stage.status.status_code == StatusCode.UNSET
    assert observed.sample("onehop_gateway_stage_seconds_count", stage="render") == 0


# ------------------------------------------------------------ the server span


SERVED = {"onehop.route": "tokens", "gen_ai.response.model": "m", "llm.model_name": "m"}
"""What every outcome of a served model puts on its span."""


def outcome(span: Span, **fields: Any) -> Outcome:
    """A chat answered whole on the token route, but for `fields`."""
    answered = Outcome(
        request_id="chatcmpl-1", endpoint="chat", model="m", tenant=None, route="tokens", status=200, error=None,
        finish_reasons=(), tokens=None, duration_s=0.5, span=span,
    )
    return msgspec.structs.replace(answered, **fields)


@pytest.mark.parametrize(
    ("fields", "attributes", "status"),
    [
        (
            {"finish_reasons": ("stop", None), "tokens": Tokens(prompt=5, completion=2)},
            {
                **SERVED, "http.response.status_code": 200, "gen_ai.response.finish_reasons": ("stop", ""),
                "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 2,
                "llm.token_count.prompt": 5, "llm.token_count.completion": 2, "llm.token_count.total": 7,
            },
            StatusCode.UNSET,
        ),
        (
            {"finish_reasons": ("stop",), "tokens": Tokens(prompt=5, cached=4, completion=2, reasoning=1)},
            {
                **SERVED, "http.response.status_code": 200, "gen_ai.response.finish_reasons": ("stop",),
                "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 2,
                "gen_ai.usage.cache_read.input_tokens": 4, "onehop.usage.reasoning_tokens": 1,
                "llm.token_count.prompt": 5, "llm.token_count.completion": 2, "llm.token_count.total": 7,
                "llm.token_count.prompt_details.cache_read": 4, "llm.token_count.completion_details.reasoning": 1,
            },
            StatusCode.UNSET,
        ),
        (
            {"route": "none", "model": None, "status": 400, "error": "InvalidRequest"},
            {"onehop.route": "none", "http.response.status_code": 400, "error.type": "InvalidRequest"},
            StatusCode.UNSET,
        ),
        (
            {"status": 502, "error": "EngineFailed"},
            {**SERVED, "http.response.status_code": 502, "error.type": "EngineFailed"},
            StatusCode.ERROR,
        ),
        (
            {"status": 502, "error": "EngineFailed", "stream_error": True, "tokens": Tokens(prompt=5, completion=2)},
            {
                **SERVED, "http.response.status_code": 502, "error.type": "EngineFailed", "onehop.stream_error": True,
                "gen_ai.response.finish_reasons": (), "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 2,
                "llm.token_count.prompt": 5, "llm.token_count.completion": 2, "llm.token_count.total": 7,
            },
            StatusCode.ERROR,
        ),
        (
            {"status": CLIENT_GONE, "error": "EngineFailed"},
            {**SERVED, "onehop.client_disconnected": True, "error.type": "EngineFailed"},
            StatusCode.UNSET,
        ),
    ],
    ids=["answered", "cached and reasoning tokens", "refused", "engine failed", "stream broken", "client gone"],
)
def test_the_outcome_on_the_server_span(
    observed: Observed, fields: dict[str, object], attributes: dict[str, object], status: StatusCode
) -> None:
    span = observed.tracer.start_span("chat", kind=SpanKind.SERVER)  # as the middleware opens it
    describe_outcome(outcome(span, **fields))
    span.end()
    # Named by the served model once there is one; a request that named none keeps the fixed name.
    name = "chat" if fields.get("model", "m") is None else "chat m"
    assert observed.attributes(name) == attributes
    assert observed.finished(name).status.status_code == status



def test_describing_a_span_that_does_not_record_is_a_no_op() -> None:
    describe_outcome(outcome(trace.INVALID_SPAN, status=502, error="EngineFailed"))
    describe_arrival(trace.INVALID_SPAN, "chat", "POST", "/v1/chat/completions")
    describe_model(trace.INVALID_SPAN, "m")
    describe_request(trace.INVALID_SPAN, max_tokens=1, temperature=None, top_p=None, n=None, seed=None, stream=False)


def test_the_request_on_the_server_span_names_what_it_set(observed: Observed) -> None:
    span = observed.tracer.start_span("text_completion", kind=SpanKind.SERVER)
    describe_arrival(span, "text_completion", "POST", "/v1/completions")
    describe_model(span, None)
    describe_model(span, "made-up-by-the-client")  # an attribute, never the span's name
    describe_request(span, max_tokens=16, temperature=None, top_p=0.5, n=None, seed=7, stream=True)
    span.end()
    assert observed.attributes("text_completion") == {
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "onehop",
        "openinference.span.kind": "LLM", "llm.provider": "onehop",
        "http.request.method": "POST", "url.path": "/v1/completions",
        "gen_ai.request.model": "made-up-by-the-client", "onehop.stream": True, "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 16, "gen_ai.request.top_p": 0.5, "gen_ai.request.seed": 7,
    }
