"""`POST /inference/v1/generate` and `/inference/v1/abort_requests`.

Flow of one request: decode and check it against this engine (tokenizer,
vocabulary, context length) → start the backend stream → feed each step to
the mode's writer → send JSON or SSE. The backend stream is always closed on
the way out (`aclosing`): a client that disconnects cancels the handler
(`handler_cancellation=True`), the close aborts the backend request, and the
CancelledError propagates. A stop string that ends every choice also closes
it, so the backend stops generating for text nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from aiohttp import web

from engine.backends.base import BackendOutput, BackendRequest
from engine.errors import BadRequest, Conflict, EngineHTTPError, NotFound, Unavailable, as_http_error, error_body
from engine.outputs import OutputWriter, make_writer
from engine.protocol import GenerateRequest, decode_abort_request, decode_generate_request, sampling_params_sent_keys
from engine.state import ENGINE, EngineState, RunningRequest

CPU_HEADER = "onehop-engine-cpu-us"
"""Output-processing CPU of the request in microseconds (JSON responses)."""
CPU_COMMENT = b": onehop-engine-cpu-us="
"""The same figure as an SSE comment before `[DONE]`; OpenAI clients skip comments."""
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection while its stream was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def check_request(state: EngineState, request: GenerateRequest) -> None:
    """Refuse, before any generation, what this engine cannot serve."""
    if not state.ready:
        raise Unavailable("the engine is still loading")
    if request.model is not None and request.model != state.model:
        raise NotFound(f"model {request.model!r} is not served here (this engine serves {state.model!r})")
    if request.request_id in state.running:
        raise Conflict(f"request_id {request.request_id!r} is already running")
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
    limit = info.vocab_size
    for token_id in request.token_ids:
        if token_id >= limit:
            raise BadRequest(f"token id {token_id} is out of range for a vocabulary of {limit} tokens", param="token_ids")
    if len(request.token_ids) >= info.max_model_len:
        raise BadRequest(
            f"the prompt has {len(request.token_ids)} tokens, the model's context is {info.max_model_len}",
            param="token_ids",
        )


def backend_request(state: EngineState, request: GenerateRequest) -> BackendRequest:
    return BackendRequest(
        request_id=request.request_id,
        prompt_token_ids=request.token_ids,
        sampling=request.sampling_params,
        eos_token_ids=state.backend.info.eos_token_ids,
        kv_transfer_params=request.kv_transfer_params,
    )


async def handle_generate(http: web.Request) -> web.StreamResponse:
    state = http.app[ENGINE]
    body = await http.read()
    request = decode_generate_request(body)
    if "max_tokens" not in sampling_params_sent_keys(body):
        # Not sent means "up to the context length", as in vLLM's generate API
        # (its SamplingParams default of 16 applies only to direct callers).
        request.sampling_params.max_tokens = None
    check_request(state, request)
    writer = make_writer(request, state.writer_context())
    running = RunningRequest(request_id=request.request_id, mode=request.output_mode)
    state.running[request.request_id] = running
    metrics = state.metrics
    metrics.in_flight.labels(request.output_mode).inc()
    started = time.monotonic()
    status = 200
    try:
        outputs = state.backend.generate(backend_request(state, request))
        if request.stream:
            return await _stream(http, state, request, writer, outputs, started)
        return await _json(state, request, writer, outputs, started)
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    except ClientGone as gone:
        status = 499
        return gone.response
    except Exception as exc:
        status = as_http_error(exc).status
        raise
    finally:
        del state.running[request.request_id]
        metrics.in_flight.labels(request.output_mode).dec()
        metrics.requests.labels(request.output_mode, str(status)).inc()
        metrics.output_cpu.labels(request.output_mode).inc(writer.cpu_s)
        metrics.output_cpu_per_request.labels(request.output_mode).observe(writer.cpu_s)
        metrics.e2e.labels(request.output_mode).observe(time.monotonic() - started)
        if status == 499:
            metrics.aborts.labels("client_disconnect").inc()
        elif running.aborted:
            metrics.aborts.labels("abort_request").inc()


async def _drive(
    state: EngineState,
    request: GenerateRequest,
    writer: OutputWriter,
    outputs: AsyncIterator[list[BackendOutput]],
    started: float,
) -> AsyncIterator[bytes]:
    """Payloads of the whole request, in order; closes the backend stream when done."""
    for payload in writer.head():
        yield payload
    first = True
    produced = 0
    async with contextlib.aclosing(outputs):
        async for batch in outputs:
            if first:
                state.metrics.time_to_first_token.labels(request.output_mode).observe(time.monotonic() - started)
                first = False
            for output in batch:
                produced += len(output.token_ids)
                payload = writer.step(output)
                if payload is not None:
                    yield payload
            if not writer.open_choices():
                break
    state.metrics.output_tokens.labels(request.output_mode).inc(produced)
    for index in writer.open_choices():
        # The backend stream ended without a finish for this choice: it was aborted.
        payload = writer.step(BackendOutput(index=index, token_ids=[], finish_reason="abort"))
        if payload is not None:
            yield payload
    for payload in writer.tail():
        yield payload


async def _stream(
    http: web.Request,
    state: EngineState,
    request: GenerateRequest,
    writer: OutputWriter,
    outputs: AsyncIterator[list[BackendOutput]],
    started: float,
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    payloads = _drive(state, request, writer, outputs, started)
    try:
        await response.prepare(http)  # a client that already left fails here
        try:
            async with contextlib.aclosing(payloads):
                async for payload in payloads:
                    await response.write(b"data: " + payload + b"\n\n")
        except ConnectionResetError:
            raise  # the client is gone: nothing more can be sent
        except EngineHTTPError as exc:
            await response.write(b"data: " + error_body(exc) + b"\n\n")
        except Exception as exc:  # after the first byte, errors travel in-band
            await response.write(b"data: " + error_body(as_http_error(exc)) + b"\n\n")
        await response.write(CPU_COMMENT + str(round(writer.cpu_s * 1e6)).encode() + b"\n\n" + DONE)
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
    outputs: AsyncIterator[list[BackendOutput]],
    started: float,
) -> web.Response:
    payloads = _drive(state, request, writer, outputs, started)
    async with contextlib.aclosing(payloads):
        async for _ in payloads:
            pass  # the writer keeps what the body needs
    body = writer.body()
    return web.Response(
        body=body, content_type="application/json", headers={CPU_HEADER: str(round(writer.cpu_s * 1e6))}
    )


async def handle_abort(http: web.Request) -> web.Response:
    """Abort by the ids the engine reported; unknown ids are ignored, as in vLLM."""
    state = http.app[ENGINE]
    body = decode_abort_request(await http.read())
    for request_id in body.request_ids:
        running = state.running.get(request_id)
        if running is not None:
            running.aborted = True
        await state.backend.abort(request_id)
    return web.Response(status=200)
