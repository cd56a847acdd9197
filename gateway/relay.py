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
    EngineError,
    ProtocolError,
    decode_generate_response,
    decode_generate_stream_chunk,
)
from gateway.errors import EngineFailed, EngineUnavailable, GatewayError, error_json
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


class ClientGone(Exception):
    """The client closed the connection while its stream was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


async def send(response: web.StreamResponse, data: bytes) -> None:
    """Write to the client; a reset means it left, which is not an engine failure."""
    try:
        await response.write(data)
    except ConnectionResetError as exc:
        raise ClientGone(response) from exc


async def write_eof(response: web.StreamResponse) -> None:
    try:
        await response.write_eof()
    except ConnectionResetError as exc:
        raise ClientGone(response) from exc


async def open_stream(http: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await response.prepare(http)
    except ConnectionResetError as exc:  # it left before the headers went out
        raise ClientGone(response) from exc
    return response


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
    response = await open_stream(http)
    try:
        async for piece in pieces(engine, first_timeout):
            await send(response, piece)
    except ClientGone:
        raise
    except GatewayError as exc:
        await send(response, frame(error_json(exc)) + DONE_FRAME)
    except (aiohttp.ClientError, TimeoutError) as exc:
        await send(response, frame(error_json(EngineFailed(f"the engine stream broke: {exc}"))) + DONE_FRAME)
    await write_eof(response)
    return response


async def relay_json(engine: aiohttp.ClientResponse) -> web.Response:
    return web.Response(body=await engine.read(), content_type="application/json")


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
    response = await open_stream(http)
    try:
        for chunk in derender.start():
            await send(response, frame(_encode(chunk)))
        async for payload in engine_payloads(engine, first_timeout):
            for chunk in feed_chunk(derender, mode, payload):
                await send(response, frame(_encode(chunk)))
        usage = derender.usage_chunk()
        if usage is not None:
            await send(response, frame(_encode(usage)))
    except ClientGone:
        raise
    except GatewayError as exc:
        await send(response, frame(error_json(exc)))
    except (aiohttp.ClientError, TimeoutError) as exc:
        await send(response, frame(error_json(EngineFailed(f"the engine stream broke: {exc}"))))
    await send(response, DONE_FRAME)
    await write_eof(response)
    return response


def whole_choices(body: bytes, mode: str) -> list[Any]:
    try:
        return list(decode_generate_response(body, "tokens" if mode == "tokens" else "text").choices)
    except (EngineError, ProtocolError) as exc:
        raise EngineFailed(f"the engine sent an invalid answer: {exc}") from exc


async def derender_json(engine: aiohttp.ClientResponse, derender: Derender, mode: str) -> web.Response:
    """The text and token routes, non-streaming: all of each choice in one step."""
    for choice in whole_choices(await engine.read(), mode):
        feed_choice(derender, mode, choice)
    return web.Response(body=_encode(derender.response()), content_type="application/json")


async def remote_stream(
    http: web.Request, engine: aiohttp.ClientResponse, remote: RemoteChatDerender, first_timeout: float
) -> web.StreamResponse:
    """The tokens-remote route: every engine chunk goes through vLLM's stateless derender."""
    response = await open_stream(http)
    try:
        async for payload in engine_payloads(engine, first_timeout):
            if payload.startswith(b'{"error"'):
                raise EngineFailed(f"the engine failed mid-stream: {payload[:300].decode('utf-8', 'replace')}")
            chunk = await remote.chunk(payload)
            if chunk is not None:
                await send(response, frame(chunk))
    except ClientGone:
        raise
    except GatewayError as exc:
        await send(response, frame(error_json(exc)))
    except RemoteServiceError as exc:
        await send(response, frame(error_json(remote_error(exc))))
    except (aiohttp.ClientError, TimeoutError) as exc:
        await send(response, frame(error_json(EngineFailed(f"the engine stream broke: {exc}"))))
    await send(response, DONE_FRAME)
    await write_eof(response)
    return response


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
