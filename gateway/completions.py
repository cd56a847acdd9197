"""`/v1/completions`: one engine request per prompt, merged into one answer.

Choices are numbered `prompt_index * n + i` as OpenAI does. A single prompt on
the derender route is relayed byte for byte; several prompts are merged
chunk by chunk under one id, with usage summed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from opentelemetry.trace import Span

from engine.derender.completion import CompletionDerender, CompletionOptions
from engine.openai_schema import (
    COMPLETION_CHUNK_DECODER,
    COMPLETION_DECODER,
    Completion,
    CompletionChunk,
    CompletionRequest,
    Usage,
)
from gateway.config import Route
from gateway.engine_request import completion_sampling, generate_body
from gateway.errors import EngineFailed, GatewayError, InvalidRequest, error_json
from gateway.disagg import prefill
from gateway.engine_client import Target
from gateway.observe import SPAN_KEY, DerenderWork, describe_outcome
from gateway.relay import (
    ClientGone,
    engine_payloads,
    feed_choice,
    feed_chunk,
    open_stream,
    relay_json,
    relay_stream,
    whole_choices,
)
from gateway.sse import DONE_FRAME, frame
from gateway.state import GATEWAY, GatewayState

_encode = msgspec.json.Encoder().encode


class CompletionsDerender(CompletionDerender):
    """CompletionDerender with the chat-derender surface the relay expects (no role chunks)."""

    def start(self) -> list[Any]:
        return []


class _Call:
    """One prompt's engine request."""

    def __init__(self, request_id: str, body: bytes, route: Route, derender: CompletionsDerender | None) -> None:
        self.request_id = request_id
        self.body = body
        self.route = route
        self.url: str | None = None
        """The engine that answered (after any retries): aborts go there."""
        self.engines: list[str] = []
        """The prefill engine, when disaggregated: aborts go there too."""
        self.mode = "tokens" if route in ("tokens", "tokens-remote") else "text"
        self.derender = derender


def _sum_usage(usages: list[Usage]) -> Usage:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens or 0 for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def serve_completion(
    http: web.Request,
    state: GatewayState,
    request: CompletionRequest,
    body: bytes,
    prompts: list[list[int]],
    target: Target,
) -> web.StreamResponse:
    route, engines, endpoint = target.route, target.engines, target.endpoint
    if route == "tokens-remote":
        raise InvalidRequest("the tokens-remote route serves chat completions only", param="onehop-route")
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    sampling = completion_sampling(request)
    stream = bool(request.stream)
    options = request.stream_options
    include_usage = bool(options and options.include_usage)

    def body_of(i: int, prompt: list[int], kv: dict[str, Any] | None = None) -> bytes:
        return generate_body(
            request_id=_request_id(response_id, i, len(prompts)),
            model=None,
            prompt_ids=prompt,
            sampling=sampling,
            route=route,
            stream=stream,
            include_usage=include_usage,
            completion_request=body,
            prompt_index=i,
            kv_transfer_params=kv,
        )

    calls = [
        _Call(
            _request_id(response_id, i, len(prompts)),
            body_of(i, prompt),
            route,
            None if route == "derender" else _derender(state, request, prompt, i, response_id, created),
        )
        for i, prompt in enumerate(prompts)
    ]
    server = http[SPAN_KEY]
    server.set_attribute("gen_ai.response.id", response_id)
    try:
        if state.prefill is not None:
            # Disaggregated: every prompt is prefilled (concurrently), then decoded with its KV hand-off.
            handovers = await asyncio.gather(
                *(
                    prefill(state.prefill, state.tracing.tracer, prompt, call.request_id, server, call.engines.append)
                    for call, prompt in zip(calls, prompts, strict=True)
                )
            )
            for i, (call, kv) in enumerate(zip(calls, handovers, strict=True)):
                call.body = body_of(i, prompts[i], kv)
        if route == "derender" and len(calls) == 1:
            call = calls[0]
            async with engines.open(endpoint, call.body, stream=stream, request_id=call.request_id, parent=server) as (
                call.url,
                engine,
            ):
                return await (relay_stream(http, engine, engines.first_event_timeout(), call.request_id) if stream else relay_json(http, engine))
        work = None if route == "derender" else DerenderWork(http, route)
        try:
            if stream:
                return await _stream(http, state, target, calls, response_id, created, include_usage, work)
            return await _json(http, state, target, calls, response_id, created, work)
        finally:
            if work is not None:
                work.finish(None)
    except (asyncio.CancelledError, ClientGone) as gone:
        for call in calls:
            for url in [call.url or endpoint.url, *call.engines]:
                state.abort(url, call.request_id)
        if isinstance(gone, ClientGone):
            return gone.response
        raise


def _request_id(response_id: str, index: int, prompts: int) -> str:
    return response_id if prompts == 1 else f"{response_id}-{index}"


def _derender(
    state: GatewayState,
    request: CompletionRequest,
    prompt: list[int],
    index: int,
    response_id: str,
    created: int,
) -> CompletionsDerender:
    # The text options come from the same request fields the engine's sampling params were built from.
    assert state.vocab is not None
    options = CompletionOptions.from_request(request)
    n = request.n or 1
    return CompletionsDerender(
        state.vocab,
        options,
        model=request.model or state.config.model,
        n=n,
        first_index=index * n,
        prompt_token_ids=prompt,
        response_id=response_id,
        created=created,
        include_usage=True,
    )


async def _chunks_of(
    state: GatewayState, target: Target, call: _Call, parent: Span, work: DerenderWork | None
) -> AsyncIterator[CompletionChunk]:
    async with target.engines.open(target.endpoint, call.body, stream=True, request_id=call.request_id, parent=parent) as (
        call.url,
        engine,
    ):
        async for payload in engine_payloads(engine, target.engines.first_event_timeout()):
            if call.derender is None or work is None:
                try:
                    yield COMPLETION_CHUNK_DECODER.decode(payload)
                except msgspec.DecodeError as exc:
                    raise EngineFailed(f"the engine sent an invalid chunk: {payload[:200]!r}") from exc
                continue
            work.begin()
            chunks = feed_chunk(call.derender, call.mode, payload)
            work.end()
            for out in chunks:
                yield out
    if call.derender is not None:
        usage = call.derender.usage_chunk()
        if usage is not None:
            yield usage


async def _stream(
    http: web.Request,
    state: GatewayState,
    target: Target,
    calls: list[_Call],
    response_id: str,
    created: int,
    include_usage: bool,
    work: DerenderWork | None,
) -> web.StreamResponse:
    stream = await open_stream(http, "derender" if work is None else calls[0].route)
    server = http[SPAN_KEY]
    queue: asyncio.Queue[CompletionChunk | BaseException | None] = asyncio.Queue()

    async def pump(call: _Call) -> None:
        try:
            async for chunk in _chunks_of(state, target, call, server, work):
                await queue.put(chunk)
        except BaseException as exc:  # handed to the writer, which reports it in-band
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(call)) for call in calls]
    usages: list[Usage] = []
    reasons: dict[int, str | None] = {}
    open_calls = len(calls)
    tail = DONE_FRAME
    try:
        while open_calls:
            item = await queue.get()
            if item is None:
                open_calls -= 1
                continue
            if isinstance(item, BaseException):
                error = item if isinstance(item, GatewayError) else EngineFailed(f"the engine stream broke: {item}")
                tail = frame(error_json(error)) + DONE_FRAME
                break
            if not item.choices:
                if item.usage not in (None, msgspec.UNSET):
                    usages.append(item.usage)  # type: ignore[arg-type]
                continue
            for choice in item.choices:
                if choice.finish_reason is not None:
                    reasons[choice.index] = choice.finish_reason
            item.id, item.created = response_id, created
            await stream.send(frame(_encode(item)))
        if include_usage and usages:
            usage = CompletionChunk(id=response_id, created=created, model=_model(http), choices=[], usage=_sum_usage(usages))
            await stream.send(frame(_encode(usage)))
    finally:
        for task in tasks:
            task.cancel()
    if usages:
        total = _sum_usage(usages)
        describe_outcome(server, [reasons[i] for i in sorted(reasons)], total.prompt_tokens, total.completion_tokens or 0)
    return await stream.close(tail)


def _model(http: web.Request) -> str:
    return http.app[GATEWAY].config.model


async def _json(
    http: web.Request,
    state: GatewayState,
    target: Target,
    calls: list[_Call],
    response_id: str,
    created: int,
    work: DerenderWork | None,
) -> web.Response:
    server = http[SPAN_KEY]

    async def one(call: _Call) -> Completion:
        async with target.engines.open(target.endpoint, call.body, stream=False, request_id=call.request_id, parent=server) as (
            call.url,
            engine,
        ):
            raw = await engine.read()
        if call.derender is None or work is None:
            return COMPLETION_DECODER.decode(raw)
        work.begin()
        for choice in whole_choices(raw, call.mode):
            feed_choice(call.derender, call.mode, choice)
        answer = call.derender.response()
        work.end()
        return answer

    answers = await asyncio.gather(*(one(call) for call in calls))
    merged = Completion(
        id=response_id,
        created=created,
        model=answers[0].model,
        choices=[choice for answer in answers for choice in answer.choices],
        usage=_sum_usage([answer.usage for answer in answers]),
    )
    usage = merged.usage
    describe_outcome(server, [c.finish_reason for c in merged.choices], usage.prompt_tokens, usage.completion_tokens or 0)
    return web.Response(body=_encode(merged), content_type="application/json")
