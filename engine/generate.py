"""`POST /inference/v1/generate` and `/inference/v1/abort_requests`.

Flow of one request: decode and check it against this engine (tokenizer,
vocabulary, context length, the counts bounded by `EngineLimits`) → start
the backend stream → feed each step to the mode's writer → send JSON or SSE.
The backend stream is always closed on the way out (`aclosing`): a client
that disconnects cancels the handler (`handler_cancellation=True`), the
close aborts the backend request, and the CancelledError propagates. A stop
string that ends every choice also closes it, so the backend stops
generating for text nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from bisect import bisect_left
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.trace import Span, SpanKind

from engine.backends.base import BackendInfo, BackendOutput, BackendRequest
from engine.backends.checks import first_out_of_vocab
from engine.config import EngineLimits
from derender.parsers import REASONING_PARSERS
from derender.parsers.base import ParseOptions
from derender.parsers.choice import ParserSet, bind_parsers
from engine.errors import (
    BadRequest,
    Conflict,
    REQUEST_ID_KEY,
    EngineHTTPError,
    NotFound,
    PayloadTooLarge,
    Unavailable,
    as_http_error,
    log_failure,
)
from wire.grammar_limits import GrammarTooLarge, check_grammar
from engine.metrics import EngineMetrics
from engine.outputs import OutputWriter, make_writer
from wire.protocol import (
    SUMMARY_COMMENT,
    AbortAnswer,
    EngineSummary,
    SUMMARY_HEADER,
    GenerateRequest,
    SamplingParams,
    decode_abort_request,
    decode_generate_request,
    encode,
    public_request_id,
    sampling_params_sent_keys,
)
from engine.state import ENGINE, EngineState, RunningRequest
from plumbing.telemetry import extract, record_error

log = logging.getLogger(__name__)

CPU_HEADER = "onehop-engine-cpu-us"
"""Output-processing CPU of the request in microseconds (JSON responses); see `_Times.output_s`."""
CPU_COMMENT = b": onehop-engine-cpu-us="
"""The same figure as an SSE comment before `[DONE]`; OpenAI clients skip comments."""
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
ABORT_USAGE_WAIT_S = 1.0
"""How long an abort's answer waits for its running requests to stop, to say what they used
(they stop at their next output; the gateway's wait for the answer is bounded too)."""
GENERATE_PATH = "/inference/v1/generate"
SPAN_NAME = f"POST {GENERATE_PATH}"
"""The engine's server span, named as OpenTelemetry's HTTP conventions say; it continues the gateway's trace."""


class ClientGone(Exception):
    """The client closed the connection while its stream was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def check_request(state: EngineState, request: GenerateRequest) -> None:
    """Refuse, before any generation, what this engine cannot serve; cap max_tokens to the context."""
    if not state.ready:
        raise Unavailable("the engine is still loading")
    if request.model is not None and request.model != state.model:
        raise NotFound(f"model {request.model!r} is not served here (this engine serves {state.model!r})")
    if request.request_id in state.running:
        # The public id: the abort handle stays out of error messages.
        raise Conflict(f"request_id {public_request_id(request.request_id)!r} is already running")
    sampling = request.sampling_params
    if state.vocab is None:
        if request.output_mode != "tokens":
            raise BadRequest(
                f"output_mode={request.output_mode!r} needs a tokenizer, and this engine runs --tokens-only",
                param="output_mode",
            )
        if sampling.stop:
            raise BadRequest("stop strings need a tokenizer, and this engine runs --tokens-only", param="stop")
    info = state.backend.info
    bad = first_out_of_vocab(request.token_ids, info.vocab_size)
    if bad is not None:
        raise BadRequest(
            f"token id {bad} is out of range for a vocabulary of {info.vocab_size} tokens", param="token_ids"
        )
    if len(request.token_ids) >= info.max_model_len:
        raise BadRequest(
            f"token_ids must hold at most {info.max_model_len - 1} tokens (max_model_len {info.max_model_len},"
            f" less one for the output), got {len(request.token_ids)}",
            param="token_ids",
        )
    room = info.max_model_len - len(request.token_ids)
    check_limits(state.config.limits, info, sampling, room)
    _check_constraint(state, sampling)
    fit_to_context(sampling, room)


def constraints(state: EngineState) -> frozenset[str]:
    """The structured-output kinds this engine enforces: its backend's, and none without a
    tokenizer (`--tokens-only`: a grammar is compiled against the vocabulary's strings)."""
    return state.backend.info.constraints if state.vocab is not None else frozenset()


def _check_constraint(state: EngineState, sampling: SamplingParams) -> None:
    constraint = sampling.structured_outputs
    if constraint is None:
        return
    try:
        check_grammar(constraint, state.config.limits.grammar)
    except GrammarTooLarge as exc:
        raise BadRequest(str(exc), param="structured_outputs") from exc
    if constraint.kind in constraints(state):
        return
    served = ", ".join(sorted(constraints(state))) or "none"
    raise BadRequest(
        f"this engine cannot enforce structured_outputs.{constraint.kind} (its {state.backend.info.name} backend"
        f"{'' if state.vocab is not None else ' without a tokenizer'} enforces: {served})",
        param="structured_outputs",
    )


# vLLM's engine core moves sampling params as MessagePack, which holds signed or
# unsigned 64-bit integers; its generate API refuses others with a 400, so does this.
_WIRE_INT_MIN = -(2**63)
_WIRE_INT_MAX = 2**64 - 1
_SCALAR_INTS = (
    "max_tokens",
    "min_tokens",
    "seed",
    "top_k",
    "stream_interval",
    "thinking_token_budget",
    "prompt_logprob_start",
    "routed_experts_prompt_start",
    "output_text_buffer_length",
)


def check_limits(limits: EngineLimits, info: BackendInfo, sampling: SamplingParams, room: int) -> None:
    """Refuse any count over this engine's limits, before anything is sized by it.

    `room` is the context the prompt leaves. Lengths are compared first, then each id
    list is scanned once: the work is O(size of the request), and nothing is allocated
    per choice or per candidate until the request has passed.
    """
    if sampling.n > limits.max_num_seqs:
        raise BadRequest(
            f"n must be at most {limits.max_num_seqs} (this engine's max_num_seqs), got {_shown(sampling.n)}",
            param="n",
        )
    for name in _SCALAR_INTS:
        value = getattr(sampling, name)
        if value is not None and not _WIRE_INT_MIN <= value <= _WIRE_INT_MAX:
            raise BadRequest(f"{name} must fit in 64 bits, got {_shown(value)}", param=name)
    if sampling.max_tokens is None and sampling.min_tokens > room:
        # vLLM's rule: an unset max_tokens becomes the room left, and min_tokens must fit it.
        raise BadRequest(
            f"min_tokens must be at most {room} (the context left after the prompt), got {_shown(sampling.min_tokens)}",
            param="min_tokens",
        )
    _check_logprobs(limits, info, sampling)
    _check_strings(limits, sampling)
    _check_token_ids(info.vocab_size, sampling)


def fit_to_context(sampling: SamplingParams, room: int) -> None:
    """Cap `max_tokens` at the context the prompt leaves, as vLLM 0.32 does.

    Its generate API takes a larger `max_tokens` as sent and its scheduler ends the
    sequence at `max_model_len` with finish_reason "length"; capping it here gives
    that answer on every backend, and no backend sees a count the model cannot reach.
    `min_tokens` is capped with it: vLLM checked it against the uncapped value.
    """
    if sampling.max_tokens is not None and sampling.max_tokens > room:
        sampling.max_tokens = room
        sampling.min_tokens = min(sampling.min_tokens, room)


def _check_logprobs(limits: EngineLimits, info: BackendInfo, sampling: SamplingParams) -> None:
    vocab = info.vocab_size
    most = vocab if limits.max_logprobs == -1 else limits.max_logprobs
    allowed = "the vocabulary size" if limits.max_logprobs == -1 else f"{most} (this engine's max_logprobs)"
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(sampling, name)
        if asked is None:
            continue
        if asked == -1 and vocab > most:
            raise BadRequest(
                f"{name}=-1 asks for the whole vocabulary ({vocab} tokens), at most {allowed} are served", param=name
            )
        if asked > most:
            raise BadRequest(f"{name} must be at most {allowed}, got {_shown(asked)}", param=name)
    ids = sampling.logprob_token_ids
    if ids is not None:
        _check_count("logprob_token_ids", len(ids), limits.max_logprob_token_ids, "this engine's max_logprob_token_ids")
        _check_in_vocab("logprob_token_ids", ids, vocab)
    rows = sampling.prompt_logprob_token_ids
    if rows is not None:
        # vLLM's bounds: one row per scored prompt position, each no wider than max_logprobs.
        _check_count("prompt_logprob_token_ids", len(rows), info.max_model_len - 1, "max_model_len - 1 rows")
        widest = max(map(len, rows), default=0)
        if widest > most:
            raise BadRequest(
                f"prompt_logprob_token_ids rows must hold at most {allowed} ids, got {widest}",
                param="prompt_logprob_token_ids",
            )
        for row in rows:
            _check_in_vocab("prompt_logprob_token_ids", row, vocab, lowest=-1)  # -1 pads a row


def _check_strings(limits: EngineLimits, sampling: SamplingParams) -> None:
    stop = sampling.stop
    stops = [stop] if isinstance(stop, str) else stop or []
    _check_count("stop", len(stops), limits.max_stop, "this engine's max_stop")
    bad_words = sampling.bad_words or []
    _check_count("bad_words", len(bad_words), limits.max_bad_words, "this engine's max_bad_words")
    for name, texts in (("stop", stops), ("bad_words", bad_words)):
        longest = max(map(len, texts), default=0)
        if longest > limits.max_string_chars:
            raise BadRequest(
                f"{name} entries must be at most {limits.max_string_chars} characters"
                f" (this engine's max_string_chars), got one of {longest}",
                param=name,
            )


def _check_token_ids(vocab: int, sampling: SamplingParams) -> None:
    # Each list indexes the logits (vLLM checks the same ranges); more entries
    # than the vocabulary can only repeat ids, so that is the bound on length.
    lists: tuple[tuple[str, Collection[int] | None], ...] = (
        ("stop_token_ids", sampling.stop_token_ids),
        ("allowed_token_ids", sampling.allowed_token_ids),
        ("logit_bias", sampling.logit_bias),  # its keys
        ("trace_decode_token_ids", sampling.trace_decode_token_ids),
    )
    for name, ids in lists:
        if ids is None:
            continue
        _check_count(name, len(ids), vocab, "the vocabulary size")
        _check_in_vocab(name, ids, vocab)
    if sampling.allowed_token_ids is not None and not sampling.allowed_token_ids:
        raise BadRequest("allowed_token_ids must hold at least 1 token id, got none", param="allowed_token_ids")


def _check_count(name: str, count: int, most: int, what: str) -> None:
    if count > most:
        raise BadRequest(f"{name} must hold at most {most} entries ({what}), got {count}", param=name)


def _check_in_vocab(name: str, ids: Collection[int], vocab: int, *, lowest: int = 0) -> None:
    if not ids:
        return
    low, high = min(ids), max(ids)  # two C-level passes, no list of offenders
    if low < lowest or high >= vocab:
        bad = low if low < lowest else high
        raise BadRequest(f"{name} holds token id {_shown(bad)}, outside the vocabulary of {vocab} tokens", param=name)


def _shown(value: int) -> str:
    """An int for a message: past 64 bits its digits are no use (and very long ones raise)."""
    return str(value) if value.bit_length() <= 64 else f"a {value.bit_length()}-bit number"


def backend_request(state: EngineState, request: GenerateRequest, session_id: str | None = None) -> BackendRequest:
    return BackendRequest(
        request_id=request.request_id,
        prompt_token_ids=request.token_ids,
        sampling=request.sampling_params,
        eos_token_ids=state.backend.info.eos_token_ids,
        kv_transfer_params=request.kv_transfer_params,
        reasoning_end_ids=_reasoning_end_ids(state, request),
        cache_salt=request.cache_salt,
        session_id=session_id,
        priority=request.priority,
    )


def _reasoning_end_ids(state: EngineState, request: GenerateRequest) -> frozenset[int] | None:
    """For a constrained request whose output starts inside reasoning (vLLM's rule: the last
    reasoning marker of the prompt, else `enable_thinking`): the ids that end it, after which
    the constraint holds. None otherwise, and for families onehop does not parse natively."""
    name = state.config.reasoning_parser
    if request.sampling_params.structured_outputs is None or state.vocab is None or name not in REASONING_PARSERS:
        return None
    parsers = bind_parsers(state.vocab, name, None)  # bound once per vocabulary, then cached
    bound = parsers.reasoning if isinstance(parsers, ParserSet) else None
    if bound is None:
        return None
    kwargs = request.chat_request.chat_template_kwargs if request.chat_request is not None else None
    options = ParseOptions(enable_thinking=bool((kwargs or {}).get("enable_thinking", True)))
    if not bound.end_ids or not bound.starts_in_reasoning(request.token_ids, options):
        return None
    return bound.end_ids


@dataclass(slots=True)
class _Times:
    """When things happened to one request (monotonic seconds), and its output work."""

    arrived: float
    first: float | None = None
    last: float | None = None
    queued_s: float | None = None
    output_s: float = 0.0
    """Thread CPU of the request's output work: each step from the backend's output to its
    bytes written (derender, serialization, SSE framing, the write, the metrics), the tail
    and the JSON body. The first step, the tail and the body are timed whole; of the other
    steps one in `CPU_SAMPLE_EVERY` is, and the rest are counted at those steps' mean. A
    write that has to wait for a slow client's socket lets other requests run inside a
    timed step, and their CPU then counts here too."""


CPU_SAMPLE_EVERY = 32
"""One step in this many has its thread CPU read. A `thread_time` read is a system call
(~0.2 µs here, 5x a monotonic read) and leaves the step after it slower: two a step were
12% of a token's derender, one pair in 16 still 5-6%, one in 32 half that. Thread CPU, not
the wall time of the step: wall time counts the time the OS gives other threads, which
doubled this figure on a busy 2-core machine."""


def _read_cost() -> float:
    """What a sample reads with nothing timed (the clock reads' own share), taken off each
    sample: at one token a step it is a tenth of the step."""
    clock = time.thread_time
    least = 1.0
    for _ in range(64):
        start = clock()
        least = min(least, clock() - start)
    return least


_READ_S = _read_cost()
SESSION_HEADER = "X-Session-ID"
"""The client's conversation, as vLLM's engines read it (the gateway sends it)."""


async def handle_generate(http: web.Request) -> web.StreamResponse:
    state = http.app[ENGINE]
    tracing = state.tracing
    with tracing.tracer.start_as_current_span(
        SPAN_NAME,
        kind=SpanKind.SERVER,
        context=extract(http.headers),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        if span.is_recording():
            # The gateway's server span is the request's one LLM call; this one is a step of it
            # (OpenInference `CHAIN`, and no `gen_ai.*` names, which trace UIs map to an LLM call).
            span.set_attributes(
                {"http.request.method": "POST", "http.route": GENERATE_PATH, "openinference.span.kind": "CHAIN"}
            )
            if session := http.headers.get(SESSION_HEADER):  # the gateway's key, bounded there
                span.set_attribute("session.id", session[:128])
        try:
            response = await _generate(http, state, span)
        except asyncio.CancelledError:
            span.set_attribute("onehop.client_disconnected", True)
            raise
        except Exception as exc:
            error = as_http_error(exc)
            if span.is_recording():
                span.set_attribute("http.response.status_code", error.status)
                record_error(span, exc, kind=type(exc).__name__)
            raise
        if span.is_recording():
            span.set_attribute("http.response.status_code", response.status)
        return response


async def _generate(http: web.Request, state: EngineState, span: Span) -> web.StreamResponse:
    times = _Times(arrived=time.monotonic())
    body = await read_body(http)
    request = decode_generate_request(body)
    http[REQUEST_ID_KEY] = public_request_id(request.request_id)  # the abort handle stays out of logs
    if "max_tokens" not in sampling_params_sent_keys(body):
        # Not sent means "up to the context length", as in vLLM's generate API
        # (its SamplingParams default of 16 applies only to direct callers).
        request.sampling_params.max_tokens = None
    if span.is_recording():
        span.set_attributes(
            {
                "onehop.request_id": http[REQUEST_ID_KEY],
                "onehop.output_mode": request.output_mode,
                "onehop.engine.model": state.model,
                "onehop.priority": request.priority,
            }
        )
    check_request(state, request)
    writer = make_writer(request, state.writer_context())
    running = RunningRequest(request_id=request.request_id, mode=request.output_mode)
    state.running[request.request_id] = running
    metrics = state.metrics
    mode = request.output_mode
    metrics.in_flight.labels(mode).inc()
    status = 200
    try:
        session = http.headers.get(SESSION_HEADER) or None
        prepared = await state.backend.prepare(backend_request(state, request, session))
        outputs = state.backend.generate(prepared)
        if request.stream:
            return await _stream(http, state, request, writer, outputs, times)
        return await _json(state, request, writer, outputs, times)
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    except ClientGone as gone:
        status = 499
        span.set_attribute("onehop.client_disconnected", True)
        return gone.response
    except Exception as exc:
        status = as_http_error(exc).status
        raise
    finally:
        del state.running[request.request_id]
        state.ended.add(request.request_id, writer.summary())
        running.ended.set()
        metrics.in_flight.labels(mode).dec()
        metrics.requests.labels(mode, str(status)).inc()
        metrics.output_cpu.labels(mode).inc(times.output_s)
        metrics.output_cpu_per_request.labels(mode).observe(times.output_s)
        metrics.e2e.labels(mode).observe(time.monotonic() - times.arrived)
        if status == 499:
            metrics.aborts.labels("client_disconnect").inc()
        elif running.aborted:
            metrics.aborts.labels("abort_request").inc()
        if span.is_recording():
            _describe(span, writer, times, running.aborted)


def _describe(span: Span, writer: OutputWriter, times: _Times, aborted: bool) -> None:
    """The request's outcome and timings on its server span."""
    summary = writer.summary()
    attributes: dict[str, Any] = {
        "onehop.engine.input_tokens": summary.prompt_tokens,
        "onehop.engine.output_tokens": summary.completion_tokens,
        "onehop.engine.finish_reasons": [reason or "" for reason in summary.finish_reasons],
        "onehop.engine.output_cpu_s": times.output_s,
        "onehop.aborted": aborted,
    }
    if times.queued_s is not None:
        attributes["onehop.engine.queue_s"] = times.queued_s
    if times.first is not None:
        attributes["onehop.engine.time_to_first_token_s"] = times.first - times.arrived
        attributes["onehop.engine.generation_s"] = (times.last or times.first) - times.first
    span.set_attributes(attributes)


async def _drive(
    metrics: EngineMetrics,
    request: GenerateRequest,
    writer: OutputWriter,
    outputs: AsyncGenerator[list[BackendOutput], None],
    times: _Times,
) -> AsyncGenerator[bytes, None]:
    """Payloads of the whole request, in order; closes the backend stream when done.

    Hot loop: one pass per decode step. Its bookkeeping is one monotonic read
    (the inter-token gap), counted in a run of gaps that fall in the same
    bucket (a local increment; a bisection only when the bucket changes), and
    on one step in `CPU_SAMPLE_EVERY` two thread-CPU reads around the step,
    the write of its payload included: inside the output CPU it measures.
    Counts reach the metrics when the request ends, a client that leaves
    included; the gaps' sum is the last step's time less the first's, and the
    tokens counted are the answer's (its usage).
    """
    mode = request.output_mode
    itl = metrics.inter_token_latency.labels(mode)
    bounds = itl.bounds
    counts = [0] * len(itl.counts)
    edges = _bucket_edges(bounds)
    bucket = run = 0
    low, high = edges[0]
    clock, cpu = time.monotonic, time.thread_time
    sampled = untimed = countdown = window = 0
    sampled_s = 0.0
    last: float | None = None
    try:
        async with contextlib.aclosing(outputs):
            async for batch in outputs:
                start = clock()
                # The hot path repeats the step below rather than branch on sampling in it.
                if countdown:  # no thread-CPU read
                    countdown -= 1
                    gap = start - last  # type: ignore[operator]
                    if low < gap <= high:  # the bucket of the gap before: most are
                        run += 1
                    else:
                        counts[bucket] += run
                        bucket, run = bisect_left(bounds, gap), 1  # `le` is inclusive, as bisect_left finds it
                        low, high = edges[bucket]
                    last = start
                    for output in batch:
                        payload = writer.step(output)
                        if payload is not None:
                            yield payload
                    if not writer.open_choices():
                        break
                    continue
                began = cpu()  # timed: the first step, the second, then one in CPU_SAMPLE_EVERY
                first = last is None
                if first:
                    for payload in _first_step(metrics, mode, writer, batch, times, start):
                        yield payload
                else:
                    counts[bisect_left(bounds, start - last)] += 1  # type: ignore[operator]
                    untimed += window
                last = start
                for output in batch:
                    payload = writer.step(output)
                    if payload is not None:
                        yield payload
                finished = not writer.open_choices()
                if first:
                    times.output_s += cpu() - began  # it carries the head: not a sample of the others
                else:
                    sampled_s += cpu() - began - _READ_S
                    sampled += 1
                    window = CPU_SAMPLE_EVERY - 1
                countdown = window
                if finished:
                    break
        began = cpu()
        metrics.output_tokens.labels(mode).inc(writer.summary().completion_tokens)
        if last is None:
            for payload in writer.head():
                yield payload
        for index in writer.open_choices():
            # The backend stream ended without a finish for this choice: it was aborted.
            payload = writer.step(BackendOutput(index=index, token_ids=[], finish_reason="abort"))
            if payload is not None:
                yield payload
        for payload in writer.tail():
            yield payload
        times.output_s += cpu() - began
    finally:
        counts[bucket] += run
        untimed += window - countdown
        times.output_s += _untimed_estimate(sampled_s, sampled, untimed)
        times.last = last
        if last is not None and times.first is not None:
            itl.merge(counts, last - times.first)


def _bucket_edges(bounds: Sequence[float]) -> list[tuple[float, float]]:
    """Each bucket's (exclusive low, inclusive high), the +Inf one last."""
    lows = (-math.inf, *bounds)
    highs = (*bounds, math.inf)
    return list(zip(lows, highs, strict=True))


def _untimed_estimate(sampled_s: float, sampled: int, untimed: int) -> float:
    """CPU of the steps not timed, at the mean of the timed ones after the first (whose head
    makes it dearer than the rest). The second step is always timed, so every untimed step
    has a sample before it."""
    return sampled_s / sampled * untimed if sampled else 0.0


def _first_step(
    metrics: EngineMetrics, mode: str, writer: OutputWriter, batch: list[BackendOutput], times: _Times, now: float
) -> list[bytes]:
    """Record the first token's timings; the payloads that go before it."""
    times.first = now
    metrics.time_to_first_token.labels(mode).observe(now - times.arrived)
    times.queued_s = next((o.queued_s for o in batch if o.queued_s is not None), None)
    if times.queued_s is not None:
        metrics.queue_seconds.labels(mode).observe(times.queued_s)
    # The role chunk goes with the first token, as in vLLM's chat server:
    # a client's first byte then means the model has started answering.
    return writer.head()


async def _stream(
    http: web.Request,
    state: EngineState,
    request: GenerateRequest,
    writer: OutputWriter,
    outputs: AsyncGenerator[list[BackendOutput], None],
    times: _Times,
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    payloads = _drive(state.metrics, request, writer, outputs, times)
    try:
        await response.prepare(http)  # a client that already left fails here
        failed: EngineHTTPError | None = None
        try:
            async with contextlib.aclosing(payloads):
                async for payload in payloads:
                    await response.write(writer.frame(payload))
        except ConnectionResetError:
            raise  # the client is gone: nothing more can be sent
        except EngineHTTPError as exc:
            failed = exc
        except Exception as exc:  # after the first byte, errors travel in-band
            failed = as_http_error(exc)
            log_failure(http, failed, exc)
        if failed is not None:
            await response.write(writer.error_frame(failed))
        summary = writer.summary()
        if failed is not None:  # the gateway relaying these bytes counts the request as failed
            summary.error_status = failed.status
        trailer = (
            SUMMARY_COMMENT + encode(summary) + b"\n\n"
            + CPU_COMMENT + str(round(times.output_s * 1e6)).encode() + b"\n\n"
        )
        await response.write(trailer + DONE)
        await response.write_eof()
    except ConnectionResetError as exc:
        # It left before the headers or between two writes, before its cancellation
        # arrived; the backend stream is closed by `aclosing` (or was never started).
        raise ClientGone(response) from exc
    return response


async def _json(
    state: EngineState,
    request: GenerateRequest,
    writer: OutputWriter,
    outputs: AsyncGenerator[list[BackendOutput], None],
    times: _Times,
) -> web.Response:
    payloads = _drive(state.metrics, request, writer, outputs, times)
    async with contextlib.aclosing(payloads):
        async for _ in payloads:
            pass  # the writer keeps what the body needs
    start = time.thread_time()
    body = writer.body()
    times.output_s += time.thread_time() - start
    headers = {CPU_HEADER: str(round(times.output_s * 1e6)), SUMMARY_HEADER: encode(writer.summary()).decode()}
    return web.Response(body=body, content_type="application/json", headers=headers)


async def read_body(http: web.Request) -> bytes:
    """The body; one whose Content-Length is over `max_body_bytes` is refused from the headers
    at once (a 413), not after waiting for a body that may never come."""
    declared, most = http.content_length, http.app[ENGINE].config.max_body_bytes
    if declared is not None and declared > most:
        raise PayloadTooLarge(f"the request body is {declared} bytes; at most max_body_bytes={most} are accepted")
    return await http.read()


async def handle_abort(http: web.Request) -> web.Response:
    """Abort by the ids the engine reported; unknown ids are ignored, as in vLLM. The answer
    says what each known request used (`AbortAnswer`), once the running ones have stopped."""
    state = http.app[ENGINE]
    body = decode_abort_request(await read_body(http))
    stopping: list[asyncio.Event] = []
    for request_id in body.request_ids:
        running = state.running.get(request_id)
        if running is not None:
            running.aborted = True
            stopping.append(running.ended)
        await state.backend.abort(request_id)
    if stopping:
        waits = [asyncio.ensure_future(ended.wait()) for ended in stopping]
        _, pending = await asyncio.wait(waits, timeout=ABORT_USAGE_WAIT_S)
        for wait in pending:
            wait.cancel()
    usage: dict[str, EngineSummary] = {}
    for request_id in body.request_ids:
        summary = state.ended.get(request_id)
        if summary is not None:
            usage[request_id] = summary
    return web.Response(body=encode(AbortAnswer(usage=usage)), content_type="application/json")
