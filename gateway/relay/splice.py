"""The steady state of a streamed answer: engine bytes to the client's socket from the engine socket's own callback.

Once the client's headers and first events are out, the rest of an engine
stream needs no task, future or generator per chunk: the engine's answer
(`engine_stream.EngineResponse`) gives each decoded piece to a `Tap`, which
checks or derenders it (`Events.feed`) and writes the result to the client's
transport in the same callback.

Only when the client falls behind does the request's task write
(`ClientStream.send`: a client that takes nothing is cut off by its stream's
watch), with the engine's socket not read until that write is out: nothing
piles up in the gateway. That pause ends once the write is out, also when the
engine's answer ended in the read that paused it: the answer's connection goes
back to the pool, where nothing would read it. An engine that sends nothing for `idle_s` (the time the client holds
the stream up not counted) ends the stream with `EngineTimeout`, as the task's
reads would.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from gateway.upstream.engine_stream import EngineResponse
from gateway.edge.errors import EngineTimeout


class Events(Protocol):
    """The check or derender of the engine's bytes: what of `data` goes to the client."""

    def feed(self, data: bytes) -> bytes: ...


class ClientSink(Protocol):
    """The client's stream, as a splice writes to it (`relay.ClientStream`)."""

    def write_now(self, data: bytes) -> bool:
        """Write `data` at once if the client keeps up; False when it is behind."""
        ...

    async def send(self, data: bytes) -> None:
        """Write `data`, waiting for the client."""
        ...


class Tap:
    """The sink of one spliced engine answer."""

    __slots__ = (
        "_engine", "_events", "_idle_s", "_last", "_loop", "_paused", "_stream", "_timer",
        "failure", "finished", "pending", "wake",
    )

    def __init__(self, engine: EngineResponse, events: Events, stream: ClientSink, idle_s: float) -> None:
        self._engine = engine
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
        self._timer = self._loop.call_at(self._last + self._idle_s, self._check)
        self._engine.splice(self._piece, self._end)

    def detach(self) -> None:
        self._engine.unsplice()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.failure = None  # unraised (the task was cancelled): its traceback holds this tap

    def resume(self) -> None:
        """The pending write is out: read the engine again."""
        self.pending = b""
        self.wake = self._loop.create_future()
        self._paused = False
        self._last = self._loop.time()
        self._engine.resume_reading()

    # ------------------------------------------------------------ the engine's side

    def _piece(self, piece: bytes) -> None:
        self._last = self._loop.time()
        if self.finished:
            return
        try:
            out = self._events.feed(piece)
            if not out:
                return
            if self._paused:  # arrived with the piece the client is behind on
                self.pending += out
            elif not self._stream.write_now(out):
                self.pending = out
                self._paused = True
                self._engine.pause_reading()
                self.wake.set_result(None)
        except Exception as exc:
            self._end(exc)

    def _end(self, failure: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        self.failure = failure
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


def spliceable(engine: object) -> EngineResponse | None:
    """The answer if it can be spliced: those read by this module's client can; aiohttp's
    (TLS engines) are read on the task, so None."""
    return engine if isinstance(engine, EngineResponse) else None


async def splice(engine: EngineResponse, events: Events, stream: ClientSink, idle_s: float) -> None:
    """The rest of `engine`'s body to `stream`, from the engine connection's callbacks; returns at
    its end, raises what broke it."""
    tap = Tap(engine, events, stream, idle_s)
    tap.attach()
    try:
        while True:
            await tap.wake
            if tap.pending:  # the client's write first, even when the engine's answer ended meanwhile
                await stream.send(tap.pending)
                # Read again even when the answer ended in the read that paused it: its
                # connection goes back to the pool, where nothing would read it (issue #27).
                tap.resume()
                if not tap.finished:
                    continue
            if tap.finished:
                failure, tap.failure = tap.failure, None
                if failure is None:
                    return
                # Neither the tap nor this frame keeps the failure once raised: its traceback
                # holds both, and either holding it back is a cycle that keeps the request.
                try:
                    raise failure
                finally:
                    del failure
    finally:
        tap.detach()
