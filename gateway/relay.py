"""Engine answers → client answers, per route.

- `derender`: the engine already sent OpenAI objects: bytes are relayed
  untouched (no decode, no re-encode).
- `text` / `tokens`: the engine sends text deltas or token ids; one stateful
  derender (the engine's own `engine/derender/` code) per request turns them
  into OpenAI chunks here.

Streams end with `[DONE]`. An error after the first byte goes in-band: an
OpenAI error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import msgspec
from aiohttp import web

from engine.protocol import (
    SUMMARY_HEADER,
    EngineError,
    EngineSummary,
    ProtocolError,
    decode_generate_response,
    decode_generate_stream_chunk,
    decode_summary,
    find_summary,
)
from gateway.errors import (
    ClientGone,
    EngineFailed,
    EngineUnavailable,
    GatewayError,
    error_json,
)
from gateway.observe import SPAN_KEY, DerenderWork, StreamTimer, describe_outcome
from gateway.remote import RemoteChatDerender, RemoteServiceError
from gateway.sse import DONE, DONE_FRAME, SSEReader, frame

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_encode = msgspec.json.Encoder().encode


class Derender(Protocol):
    """What the text and token routes need: ChatDerender and CompletionsDerender both fit."""

    def start(self) -> list[Any]: ...

    def step(self, index: int, token_ids: Any, logprobs: Any = None, *, finish_reason: Any = None, stop_reason: Any = None) -> Any: ...

    def step_text(self, index: int, text: str, token_ids: Any = (), logprobs: Any = None, *, finish_reason: Any = None, stop_reason: Any = None) -> Any: ...

    def usage_chunk(self) -> Any: ...

    def response(self) -> Any: ...


class ClientStream:
    """The SSE answer to the client: a reset means it left (`ClientGone`); content writes are timed."""

    __slots__ = ("_timer", "response")

    def __init__(self, response: web.StreamResponse, timer: StreamTimer) -> None:
        self.response = response
        self._timer = timer

    async def send(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError as exc:
            raise ClientGone(self.response) from exc
        self._timer.wrote()

    async def close(self, tail: bytes = DONE_FRAME) -> web.StreamResponse:
        """Write the last frames (an error event, `[DONE]`) and end the stream."""
        try:
            await self.response.write(tail)
            await self.response.write_eof()
        except ConnectionResetError as exc:
            raise ClientGone(self.response) from exc
        return self.response


async def open_stream(http: web.Request, route: str) -> ClientStream:
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await response.prepare(http)
    except ConnectionResetError as exc:  # it left before the headers went out
        raise ClientGone(response) from exc
    return ClientStream(response, StreamTimer(http, route))


async def pieces(engine: aiohttp.ClientResponse, first_timeout: float) -> AsyncIterator[bytes]:
    """Raw bytes of an engine stream; the first must come within `first_timeout` (later ones: idle_s)."""
    try:
        async with asyncio.timeout(first_timeout):
            first = await engine.content.readany()
    except TimeoutError as exc:
        raise EngineUnavailable(f"the engine sent nothing within {first_timeout} s") from exc
    if not first:
        return
    yield first
    async for piece in engine.content.iter_any():
        yield piece


async def relay_stream(http: web.Request, engine: aiohttp.ClientResponse, first_timeout: float) -> web.StreamResponse:
    """The derender route: the engine's SSE bytes, as they come."""
    stream = await open_stream(http, "derender")
    tail = b""
    previous = b""
    try:
        async for piece in pieces(engine, first_timeout):
            await stream.send(piece)
            previous, tail = tail, piece
    except ClientGone:
        raise
    except GatewayError as exc:
        return await stream.close(frame(error_json(exc)) + DONE_FRAME)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return await stream.close(frame(error_json(EngineFailed(f"the engine stream broke: {exc}"))) + DONE_FRAME)
    # The engine's summary comment rides just before [DONE], in the last piece or two.
    _describe_summary(http, find_summary(previous + tail))
    return await stream.close(b"")


def _describe_summary(http: web.Request, summary: EngineSummary | None) -> None:
    span = http.get(SPAN_KEY)
    if summary is not None and span is not None:
        describe_outcome(span, summary.finish_reasons, summary.prompt_tokens, summary.completion_tokens)


async def relay_json(http: web.Request, engine: aiohttp.ClientResponse) -> web.Response:
    body = await engine.read()
    header = engine.headers.get(SUMMARY_HEADER)
    if header is not None:
        _describe_summary(http, decode_summary(header))
    return web.Response(body=body, content_type="application/json")


async def engine_payloads(engine: aiohttp.ClientResponse, first_timeout: float) -> AsyncIterator[bytes]:
    reader = SSEReader()
    async for piece in pieces(engine, first_timeout):
        for payload in reader.feed(piece):
            if payload == DONE:
                return
            yield payload
    for payload in reader.flush():
        if payload != DONE:
            yield payload


def feed_chunk(derender: Derender, mode: str, payload: bytes) -> list[Any]:
    """One engine SSE payload → the OpenAI chunks it produces."""
    try:
        chunk = decode_generate_stream_chunk(payload, "tokens" if mode == "tokens" else "text")
    except EngineError as exc:
        raise EngineFailed(f"the engine failed mid-stream: {exc}") from exc
    except ProtocolError as exc:
        raise EngineFailed(f"the engine sent an invalid chunk: {exc}") from exc
    out = []
    for choice in chunk.choices:
        out.append(feed_choice(derender, mode, choice))
    return [c for c in out if c is not None]


def feed_choice(derender: Derender, mode: str, choice: Any) -> Any:
    logprobs = choice.logprobs.content if choice.logprobs is not None else None
    if mode == "tokens":
        return derender.step(
            choice.index,
            choice.token_ids or [],
            logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
    return derender.step_text(
        choice.index,
        choice.text,
        choice.token_ids or [],
        logprobs,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
    )


async def derender_stream(
    http: web.Request, engine: aiohttp.ClientResponse, derender: Derender, mode: str, first_timeout: float
) -> web.StreamResponse:
    """The text and token routes, streaming: engine chunks in, OpenAI chunks out."""
    stream = await open_stream(http, mode)
    work = DerenderWork(http, mode)
    tail = DONE_FRAME
    try:
        started = False
        async for payload in engine_payloads(engine, first_timeout):
            if not started:  # the role chunk goes with the first output, as the engine's does
                started = True
                for chunk in derender.start():
                    await stream.send(frame(_encode(chunk)))
            work.begin()
            chunks = feed_chunk(derender, mode, payload)
            work.end()
            for chunk in chunks:
                await stream.send(frame(_encode(chunk)))
        if not started:
            for chunk in derender.start():
                await stream.send(frame(_encode(chunk)))
        usage = derender.usage_chunk()
        if usage is not None:
            await stream.send(frame(_encode(usage)))
    except ClientGone:
        raise
    except GatewayError as exc:
        tail = frame(error_json(exc)) + DONE_FRAME
    except (aiohttp.ClientError, TimeoutError) as exc:
        tail = frame(error_json(EngineFailed(f"the engine stream broke: {exc}"))) + DONE_FRAME
    finally:
        work.finish(derender)
    return await stream.close(tail)


def whole_choices(body: bytes, mode: str) -> list[Any]:
    try:
        return list(decode_generate_response(body, "tokens" if mode == "tokens" else "text").choices)
    except (EngineError, ProtocolError) as exc:
        raise EngineFailed(f"the engine sent an invalid answer: {exc}") from exc


async def derender_json(http: web.Request, engine: aiohttp.ClientResponse, derender: Derender, mode: str) -> web.Response:
    """The text and token routes, non-streaming: all of each choice in one step."""
    raw = await engine.read()
    work = DerenderWork(http, mode)
    work.begin()
    try:
        for choice in whole_choices(raw, mode):
            feed_choice(derender, mode, choice)
        body = _encode(derender.response())
    finally:
        work.end()
        work.finish(derender)
    return web.Response(body=body, content_type="application/json")


async def remote_stream(
    http: web.Request, engine: aiohttp.ClientResponse, remote: RemoteChatDerender, first_timeout: float
) -> web.StreamResponse:
    """The tokens-remote route: every engine chunk goes through vLLM's stateless derender."""
    stream = await open_stream(http, "tokens-remote")
    tail = DONE_FRAME
    try:
        async for payload in engine_payloads(engine, first_timeout):
            if payload.startswith(b'{"error"'):
                raise EngineFailed(f"the engine failed mid-stream: {payload[:300].decode('utf-8', 'replace')}")
            chunk = await remote.chunk(payload)
            if chunk is not None:
                await stream.send(frame(chunk))
    except ClientGone:
        raise
    except GatewayError as exc:
        tail = frame(error_json(exc)) + DONE_FRAME
    except RemoteServiceError as exc:
        tail = frame(error_json(remote_error(exc))) + DONE_FRAME
    except (aiohttp.ClientError, TimeoutError) as exc:
        tail = frame(error_json(EngineFailed(f"the engine stream broke: {exc}"))) + DONE_FRAME
    return await stream.close(tail)


async def remote_json(engine: aiohttp.ClientResponse, remote: RemoteChatDerender) -> web.Response:
    try:
        body = await remote.whole(await engine.read())
    except RemoteServiceError as exc:
        raise remote_error(exc) from exc
    return web.Response(body=body, content_type="application/json")


def remote_error(exc: RemoteServiceError) -> GatewayError:
    """vLLM's render/derender service refused or failed: its 4xx is the client's, anything else a 502/503."""
    if 400 <= exc.status < 500:
        return GatewayError(f"remote service: {exc.message}", status=exc.status)
    if exc.status == 503:
        return EngineUnavailable(f"remote service: {exc.message}")
    return EngineFailed(f"remote service failed ({exc.status}): {exc.message}")
