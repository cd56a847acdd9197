"""The derender route's steady state: engine bytes to the client's socket from the engine socket's own callback.

Once the client's headers and first events are out, the rest of an engine
stream needs no task, future or generator per chunk. While the stream lasts, a
`Tap` stands in for aiohttp's protocol on the engine connection: each arrival
goes through aiohttp's own protocol and HTTP parser (chunked framing, errors,
the connection's release at the end are all aiohttp's), what that parsed is
taken from the response's buffer at once, checked (`Events.feed`) and written
to the client's transport in the same callback.

Only when the client falls behind does the request's task write (the timed
`ClientStream.send`, which cuts off a client that takes nothing), with the
engine's reads paused until that write is out: nothing piles up in the gateway.
An engine that sends nothing for `idle_s` (the time the client holds the
stream up not counted) ends the stream with `EngineTimeout`, as the task's
reads would.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from gateway.errors import EngineTimeout

if TYPE_CHECKING:
    from gateway.relay import ClientStream


class Events(Protocol):
    """The check of the engine's bytes (`relay.EngineEvents`): what of `data` goes to the client."""

    def feed(self, data: bytes) -> bytes: ...


class Tap(asyncio.Protocol):
    """The engine connection's protocol while a stream is spliced: aiohttp's underneath, the relay on top."""

    __slots__ = (
        "_content", "_events", "_handler", "_idle_s", "_last", "_loop", "_paused", "_stream", "_timer",
        "_transport", "failure", "finished", "pending", "wake",
    )

    def __init__(self, engine: aiohttp.ClientResponse, events: Events, stream: ClientStream, idle_s: float) -> None:
        connection = engine.connection
        assert connection is not None and connection.transport is not None
        self._handler: Any = connection.protocol
        self._transport = connection.transport
        self._content = engine.content
        self._events = events
        self._stream = stream
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.wake: asyncio.Future[None] = self._loop.create_future()
        """Set when the task has something to do: a write the client is behind on, or the end."""
        self.pending = b""
        self.finished = False
        self.failure: BaseException | None = None

    # ------------------------------------------------------------ the task's side

    def attach(self) -> None:
        self._transport.set_protocol(self)
        self._timer = self._loop.call_at(self._last + self._idle_s, self._check)
        self._drain()  # what aiohttp already buffered

    def detach(self) -> None:
        if self._transport.get_protocol() is self:
            self._transport.set_protocol(self._handler)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def resume(self) -> None:
        """The pending write is out: read the engine again."""
        self.pending = b""
        self.wake = self._loop.create_future()
        self._paused = False
        self._last = self._loop.time()
        self._handler.resume_reading()
        self._drain()

    # ------------------------------------------------------------ the transport's side

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)
        self._last = self._loop.time()
        if not self._paused:
            self._drain()

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()  # type: ignore[no-any-return]

    def connection_lost(self, exc: Exception | None) -> None:
        self._handler.connection_lost(exc)
        self._drain()  # the content's exception, or its end

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    # ------------------------------------------------------------ the relay

    def _drain(self) -> None:
        if self.wake.done():
            return
        content = self._content
        try:
            piece = content.read_nowait(-1)
            out = self._events.feed(piece) if piece else b""
            if out and not self._stream.write_now(out):
                self.pending = out
                self._paused = True
                self._handler.pause_reading()
                self.wake.set_result(None)
                return
        except Exception as exc:
            self._end(exc)
            return
        if content.at_eof():
            self._end(None)

    def _end(self, failure: BaseException | None) -> None:
        self.finished = True
        self.failure = failure
        self.detach()  # before anything else reads this connection: it may be back in aiohttp's pool
        if not self.wake.done():
            self.wake.set_result(None)

    def _check(self) -> None:
        now = self._loop.time()
        if self._paused:
            self._timer = self._loop.call_at(now + self._idle_s, self._check)
        elif now < self._last + self._idle_s:
            self._timer = self._loop.call_at(self._last + self._idle_s, self._check)
        else:
            self._timer = None
            self._end(EngineTimeout(f"the engine stream stalled: nothing for idle_s={self._idle_s} s"))


async def splice(engine: aiohttp.ClientResponse, events: Events, stream: ClientStream, idle_s: float) -> None:
    """The rest of `engine`'s body to `stream`, in the engine connection's callbacks; returns at its end."""
    if engine.connection is None or engine.connection.transport is None:
        # aiohttp already has the whole body (and let the connection go): it is all buffered.
        piece = engine.content.read_nowait(-1)
        out = events.feed(piece) if piece else b""
        if out:
            await stream.send(out)
        return
    tap = Tap(engine, events, stream, idle_s)
    tap.attach()
    try:
        while True:
            await tap.wake
            if tap.finished:
                if tap.failure is not None:
                    raise tap.failure
                return
            await stream.send(tap.pending)
            tap.resume()
    finally:
        tap.detach()
