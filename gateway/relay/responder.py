"""The client side of an answer: the one way a stream or a whole answer reaches the client.

A `Responder` belongs to one request. Its `stream` writes the frames a route or
presenter makes: the client's headers go out with the first frame, so a failure
before it is an error response with its status (502 for an engine answer that
breaks the protocol, 504 for an engine that is too slow); after it, a failure of
any kind is the API's error event (OpenAI's: an error event, then `[DONE]`),
logged once with the request id. The `ClientStream` it writes through watches the
client: one that leaves raises `ClientGone`, one that takes nothing for
`client_write_s` is cut off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from functools import partial

import msgspec
from aiohttp import web
from aiohttp.http_writer import StreamWriter

from gateway.relay.client_watch import ClientWatch
from gateway.config import Timeouts
from gateway.edge.context import RequestContext
from gateway.edge.errors import ClientGone, GatewayError, StreamDeadline, error_json
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.spans import StreamTimer
from gateway.relay.engine import stream_error, unexpected
from gateway.relay.sse import DONE_FRAME, frame

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_encode = msgspec.json.Encoder().encode


class ClientStream:
    """The SSE answer to the client: a reset means it left (`ClientGone`); a client that takes
    nothing of its stream for `client_write_s` is cut off as if it had left (`ClientWatch`:
    measured at its socket, not by how long a write waits, which the kernel's send buffer
    hides)."""

    __slots__ = (
        "_chunked",
        "_direct",
        "_high",
        "_kept",
        "_protocol",
        "_timer",
        "_transport",
        "_watch",
        "_writer",
        "response",
    )

    def __init__(self, http: web.Request, response: web.StreamResponse, timer: StreamTimer, stall_s: float) -> None:
        self.response = response
        self._timer = timer
        self._transport = http.transport
        self._protocol = http.protocol
        self._high = http.transport.get_write_buffer_limits()[1] if http.transport is not None else 0
        writer = http.writer
        assert isinstance(writer, StreamWriter)  # the server's; the abstract writer has no `chunked`
        self._writer = writer
        self._chunked = writer.chunked
        self._direct = 0
        """Bytes `write_now` put on the transport itself (aiohttp's writer counts them at the end)."""
        transport = http.transport
        # Not a method of this stream: the watch is the stream's, and a watch holding its stream
        # is a reference cycle (the request's objects left to the cyclic collector).
        self._watch: ClientWatch | None = None
        if transport is not None:
            self._watch = ClientWatch(transport, stall_s, partial(_cut_stalled, transport, stall_s))
        self._kept: list[bytes] | None = None
        """Every write, under `tracing.record_content` (`keep`)."""

    def keep(self, kept: list[bytes] | None) -> None:
        """Append everything written from now on to `kept` (None: keep nothing)."""
        self._kept = kept

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError as exc:
            raise ClientGone(self.response) from exc

    async def send(self, data: bytes) -> None:
        await self._write(data)
        self._timer.wrote()
        if self._kept is not None:
            self._kept.append(data)

    def write_now(self, data: bytes) -> bool:
        """Write `data` without waiting, framed as aiohttp's writer would (the response is never
        compressed), when the client keeps up; False when it is behind (the caller `send`s it)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ClientGone(self.response)
        if self._protocol.writing_paused or transport.get_write_buffer_size() + len(data) >= self._high:
            return False  # the transport's buffer is full, or this write fills it: `send` waits for it
        if self._chunked:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            transport.write(data)
        self._direct += len(data)
        self._timer.wrote()
        if self._kept is not None:
            self._kept.append(data)
        return True

    def finished(self) -> None:
        """The stream is over, whole or not: its timings go to the metrics, its watch stops."""
        if self._watch is not None:
            self._watch.stop()
        self._timer.flush()

    async def close(self, tail: bytes = DONE_FRAME) -> web.StreamResponse:
        """Write the last frames (an error event, `[DONE]`) and end the stream."""
        self._writer.output_size += self._direct  # the access log's body size
        self._direct = 0
        await self._write(tail)
        if self._kept is not None:
            self._kept.append(tail)
        try:
            await self.response.write_eof()  # waits for the client too, under the watch
        except ConnectionResetError as exc:
            raise ClientGone(self.response) from exc
        return self.response


def _cut_stalled(transport: asyncio.Transport, stall_s: float) -> None:
    """A client that took nothing of its stream for `stall_s` holds a slot and an engine request:
    let both go. The abort cancels the handler; a write the task is waiting on, or its next,
    raises ClientGone."""
    log.warning("client took nothing of its stream for client_write_s=%s s: the stream is closed", stall_s)
    transport.abort()


def openai_error_end(error: GatewayError) -> bytes:
    return frame(error_json(error)) + DONE_FRAME


Frames = AsyncGenerator[bytes, "ClientStream | None"]
"""What a stream is made of: SSE frames; each `yield` after the first receives the client's
stream, so a relay may write to it directly (`gateway.relay.splice`); the others ignore it."""


class Responder:
    """Answers one request: `stream` for SSE, `json` for a whole answer."""

    __slots__ = ("_ctx", "_http", "_metrics", "_timeouts")

    def __init__(self, http: web.Request, ctx: RequestContext, timeouts: Timeouts, metrics: GatewayMetrics) -> None:
        self._http = http
        self._ctx = ctx
        self._timeouts = timeouts
        self._metrics = metrics

    @staticmethod
    def json(body: bytes) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async def stream(
        self, frames: Frames, *, done: bool = True, end: Callable[[GatewayError], bytes] = openai_error_end
    ) -> web.StreamResponse:
        """`frames` written as they come, then `[DONE]` (unless `done` is False: the frames
        carry their own end, as the engine's relayed stream and the other APIs' events do).

        Nothing is sent before the first frame, so a failure before it raises (the
        error middleware answers with its status); a failure after it, of any type,
        ends the stream with `end(error)` instead of breaking the chunked body.
        """
        stream: ClientStream | None = None
        tail = DONE_FRAME if done else b""
        limit_s = self._timeouts.stream_deadline_s
        deadline = asyncio.timeout_at(self._deadline())
        try:
            try:
                async with deadline, aclosing(frames):  # a client that leaves closes them at once, not at collection
                    while True:
                        try:
                            data = await frames.asend(stream)
                        except StopAsyncIteration:
                            break
                        if stream is None:
                            stream = await self._open()
                        await stream.send(data)
            except ClientGone:
                raise
            except Exception as exc:
                if isinstance(exc, TimeoutError) and deadline.expired():
                    exc = StreamDeadline(f"the stream ran past timeouts.stream_deadline_s={limit_s:g} s")
                error = stream_error(exc)
                if stream is None:
                    raise error from exc
                rid = self._ctx.request_id
                log.error("stream %s failed after its first byte: %s", rid, error.message, exc_info=unexpected(exc))
                self._ctx.tally.fail(error.status, type(error).__name__)
                tail = end(error)
            if stream is None:
                stream = await self._open()
            return await stream.close(tail)
        finally:
            if stream is not None:
                stream.finished()

    async def _open(self) -> ClientStream:
        response = web.StreamResponse(headers=SSE_HEADERS)
        assert not response.compression  # `write_now` frames bytes itself
        try:
            await response.prepare(self._http)
        except ConnectionResetError as exc:  # it left before the headers went out
            raise ClientGone(response) from exc
        timer = StreamTimer(self._ctx, self._metrics, self._ctx.routed.route)
        stream = ClientStream(self._http, response, timer, self._timeouts.client_write_s)
        stream.keep(self._ctx.tally.content)
        return stream

    def _deadline(self) -> float | None:
        """The request's deadline (`stream_deadline_s` from its arrival) on the loop's clock."""
        if self._ctx.deadline is None:
            return None
        return asyncio.get_running_loop().time() + self._ctx.deadline - time.perf_counter()
