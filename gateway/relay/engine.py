"""The engine side of an answer: reading an engine's bytes, checked, within their timeouts.

- `pieces`: an engine stream's reads, under one read deadline (`ReadDeadline`).
- `EngineEvents`: the derender route's check of the engine's SSE (whole events,
  JSON chunks, `[DONE]`, the engine's own comments kept from the client); with
  `Presenting`, another API's named events (Responses, Messages), counted.
- `Derendered`: the text and token routes' stateful derender of the engine's
  events into OpenAI chunks (the engine's own `derender/` code).
- `spliced`: either of those, through to the client: on the request's task up to
  the first output, then from the engine's socket to the client's (`gateway.relay.splice`).
- `stream_error`: what a failure while reading means to the client.

The routes (`gateway.relay.routes`) are made of these; the client side is `gateway.relay.responder`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, Protocol

import aiohttp
import msgspec

from derender.errors import DerenderError
from derender.text import OutputFinished
from wire.openai_schema import Usage
from wire.protocol import (
    SUMMARY_COMMENT,
    EngineError,
    EngineSummary,
    ProtocolError,
    decode_generate_response,
    decode_generate_stream_chunk,
    decode_summary,
)
from gateway.config import Timeouts as StreamTimeouts
from gateway.upstream.engine_stream import EngineAnswer, EngineResponse
from gateway.edge.errors import (
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    GatewayError,
    status_error,
)
from gateway.observe.spans import DerenderWork
from gateway.observe.outcome import Tally, Tokens
from gateway.upstream.remote import RemoteServiceError
from gateway.relay.splice import ClientSink, splice, spliceable
from gateway.relay.sse import DONE, MAX_EVENT_BYTES, SSEError, SSEReader, frame

_encode = msgspec.json.Encoder().encode


class Derender(Protocol):
    """What the text and token routes need: ChatDerender and CompletionsDerender both fit."""

    cached_tokens: int | None
    """The prompt tokens the engine's prefix cache held, from its usage (for the answer's)."""

    def start(self) -> list[Any]: ...

    def step(
        self, index: int, token_ids: Any, logprobs: Any = None, *, finish_reason: Any = None, stop_reason: Any = None
    ) -> Any: ...

    def step_text(
        self,
        index: int,
        text: str,
        token_ids: Any = (),
        logprobs: Any = None,
        *,
        finish_reason: Any = None,
        stop_reason: Any = None,
    ) -> Any: ...

    def usage_chunk(self) -> Any: ...

    def response(self) -> Any: ...


def stream_error(exc: Exception) -> GatewayError:
    """What the client is told about a failure while its answer was being made."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, RemoteServiceError):
        return remote_error(exc)
    if isinstance(exc, TimeoutError):
        return EngineTimeout(f"the engine stream stalled: {exc}")
    if isinstance(exc, aiohttp.ClientError):
        return EngineFailed(f"the engine stream broke: {exc}")
    if isinstance(exc, _ENGINE_DATA_ERRORS):  # a token id the tokenizer lacks, output after the finish
        return EngineFailed(f"the engine's answer broke the protocol: {exc}")
    # Anything else came from making the answer out of what the engine sent (a token id the
    # tokenizer lacks, tokens after a finish): the engine broke the protocol, the client gets a 502.
    return EngineFailed(f"the engine's answer could not be used: {type(exc).__name__}: {exc}")


def unexpected(exc: Exception) -> Exception | None:
    """The traceback is worth logging only for errors no step of ours raised on purpose."""
    expected = (GatewayError, RemoteServiceError, TimeoutError, aiohttp.ClientError, *_ENGINE_DATA_ERRORS)
    return None if isinstance(exc, expected) else exc


_ENGINE_DATA_ERRORS = (DerenderError, OutputFinished)
"""What the derender raises for engine output that breaks the protocol."""


async def pieces(engine: EngineAnswer, timeouts: StreamTimeouts) -> AsyncGenerator[bytes, None]:
    """Raw bytes of an engine stream: the first within `first_token_s` of the request,
    each later one within `idle_s` of the one before. Only the reads are timed: a client
    that is slow to take what was read is not the engine's stall."""
    content = engine.content
    watch = ReadDeadline(timeouts.first_token_s, timeouts.idle_s)
    try:
        piece = await watch.read(content)
        while piece:
            watch.pause()
            yield piece
            watch.resume()
            piece = await watch.read(content)
    finally:
        watch.close()


class ReadDeadline:
    """The read timeouts of one engine stream, on one timer for the stream's life.

    An `asyncio.timeout` per read arms and cancels a timer per chunk; here a read
    only moves the deadline (a clock read), and the timer, when it fires early,
    re-arms itself at the moved deadline. While the stream's reader is away (the
    piece it read is being written to the client) the deadline does not run.
    When it does pass, the reading task is cancelled and the read raises
    `EngineTimeout`, as `asyncio.timeout` would raise TimeoutError.
    """

    __slots__ = ("_deadline", "_first_s", "_handle", "_idle", "_loop", "_reading", "_started", "_task", "expired")

    def __init__(self, first_s: float, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._first_s, self._idle = first_s, idle_s
        self._started = False
        """Whether the first piece came (the first deadline is `first_s`, the later ones `idle_s`)."""
        self._deadline = self._loop.time() + first_s
        self._reading = True
        self.expired: str | None = None
        self._handle = self._loop.call_at(self._deadline, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if not self._reading:
            self._handle = self._loop.call_at(now + self._idle, self._check)
        elif now < self._deadline:
            self._handle = self._loop.call_at(self._deadline, self._check)
        else:
            self.expired = (
                f"the engine stream stalled: nothing for idle_s={self._idle} s"
                if self._started
                else f"the engine sent nothing within first_token_s={self._first_s} s"
            )
            self._task.cancel()

    async def read(self, content: aiohttp.StreamReader | EngineResponse) -> bytes:
        try:
            piece = await content.readany()
        except asyncio.CancelledError:
            if self.expired is not None and self._task.uncancel() == 0:
                raise EngineTimeout(self.expired) from None
            raise
        if not self._started:
            self._first_piece()
        return piece

    def _first_piece(self) -> None:
        """The timer, armed for `first_s`, moves to `idle_s` from now: left where it was, a
        stall after the first event went unseen until `first_s` had passed (issue #27)."""
        self._started = True
        self._handle.cancel()
        self._handle = self._loop.call_at(self._loop.time() + self._idle, self._check)

    def pause(self) -> None:
        self._reading = False

    def resume(self) -> None:
        self._reading = True
        self._deadline = self._loop.time() + self._idle

    def close(self) -> None:
        self._handle.cancel()


ENGINE_COMMENT = b": onehop-engine-"
"""Comments the engine writes for the gateway (its summary, its CPU time): never the client's."""


class Presenting:
    """The derender route answering in another API's events (`wire.protocol.Present`): the
    engine wrote them, the gateway counts them (an error event it adds is numbered after
    them), hands the data of the final one to `keep`, and ends the stream without `[DONE]`.

    The final event is held back until `keep` returns: a client that saw it may at once ask for
    what was kept (`previous_response_id`), and a store that failed ends the stream with an
    error event instead."""

    __slots__ = ("events", "final", "held", "keep")

    def __init__(self, final_events: tuple[str, ...], keep: Callable[[bytes], Awaitable[None]]) -> None:
        self.final = tuple(b"event: " + name.encode() + b"\n" for name in final_events)
        self.keep = keep
        self.events = 0
        """How many events went to the client."""
        self.held: bytes | None = None
        """The final event, until what it holds is kept."""

    async def release(self) -> bytes:
        """The held final event, once its data is kept (raises what keeping it raised)."""
        held, self.held = self.held, None
        if held is None:
            return b""
        await self.keep(held[held.find(b"\ndata: {") + 7 :])
        self.events += 1
        return held + b"\n\n"


class EngineEvents:
    """The derender route's check of the engine's SSE bytes, as they pass.

    `feed` returns the whole events of what arrived (a partial one waits for its
    end), minus the engine's internal comments. An event that breaks the protocol
    (not SSE, not JSON: an HTML page, a stack trace) is raised at the next call,
    after the good events before it went out: nothing valid is held back. Chat and
    completion chunks are `data:` events; another API's (`presenting`) name their
    type in an `event:` line first.
    """

    __slots__ = ("_broken", "_parts", "_presenting", "_size", "_tally", "done", "summary")

    def __init__(self, answered: Tally | None = None, presenting: Presenting | None = None) -> None:
        self._tally = answered if answered is not None else Tally()
        """Where the engine's summary (finish reasons, tokens) is recorded for the request's outcome."""
        self._presenting = presenting
        self._parts: list[bytes] = []
        """A partial event, as it arrived: joined once, when its end comes (never re-scanned)."""
        self._size = 0
        self._broken: EngineFailed | None = None
        self.done = False
        self.summary: EngineSummary | None = None

    def feed(self, data: bytes) -> bytes:
        if self._broken is not None:
            raise self._broken
        parts = self._parts
        if not parts and len(data) > 1 and data.find(b"\n\n") == len(data) - 2:  # one whole event (usual)
            if data.startswith(b"data: {") and not self.done:  # a chunk (its trailing \n\n is JSON whitespace)
                try:
                    _JSON_OBJECT.decode(data[6:])
                except msgspec.DecodeError as exc:
                    raise _invalid_chunk(exc, data) from exc
                return data
            return data if self._passes(data[:-2]) else b""
        if data.rfind(b"\n\n") < 0 and not (parts and parts[-1].endswith(b"\n") and data.startswith(b"\n")):
            parts.append(data)
            self._size += len(data)
            if self._size > MAX_EVENT_BYTES:
                raise EngineFailed(f"the engine sent an event over {MAX_EVENT_BYTES} bytes")
            return b""
        buffer = b"".join((*parts, data)) if parts else data
        end = buffer.rfind(b"\n\n")
        whole, rest = buffer[: end + 2], buffer[end + 2 :]
        self._parts, self._size = ([rest], len(rest)) if rest else ([], 0)
        if self.done:
            return b""  # the client's answer is complete: whatever follows is not sent
        events = whole.split(b"\n\n")
        events.pop()  # the empty rest after the last separator
        kept = []
        for event in events:
            try:
                if self._passes(event):
                    kept.append(event)
            except EngineFailed as exc:
                self._broken = exc
                break
        if len(kept) == len(events):
            return whole  # the usual case: every event goes out as it came
        return b"".join(event + b"\n\n" for event in kept)

    def _passes(self, event: bytes) -> bool:
        """Whether `event` goes to the client; raises for one that breaks the protocol."""
        if self.done:
            return False
        if event.startswith(b"event: ") and self._presenting is not None:
            return self._named(event, self._presenting)
        if event.startswith(b"data: "):
            self.done = event == DONE_EVENT
            if self.done and self._presenting is not None:
                return False  # its API's stream ends with its own last event
            if not self.done:
                try:
                    _JSON_OBJECT.decode(event[6:])  # parses (and so checks) every field, keeps none
                except msgspec.DecodeError as exc:
                    raise _invalid_chunk(exc, event) from exc
            return True
        if event.startswith(ENGINE_COMMENT):
            if event.startswith(SUMMARY_COMMENT):
                self.summary = decode_summary(event[len(SUMMARY_COMMENT) :])
            return False
        if event.startswith(b":"):
            return True
        raise EngineFailed(f"the engine's stream is not SSE: {event[:120]!r}")

    def _named(self, event: bytes, presenting: Presenting) -> bool:
        """Check an `event:`-named event (one line naming its type, one `data:` line); the
        final one is held back (`Presenting.release`)."""
        start = event.find(b"\ndata: {")
        if start < 0:
            raise EngineFailed(f"the engine sent an event without data: {event[:120]!r}")
        data = event[start + 7 :]
        try:
            _JSON_OBJECT.decode(data)
        except msgspec.DecodeError as exc:
            raise _invalid_chunk(exc, event) from exc
        if event.startswith(presenting.final):
            presenting.held = event
            return False
        presenting.events += 1
        return True

    async def tail(self) -> bytes:
        """Nothing more to send (the engine's `[DONE]` went out) but a held final event; raises
        for a stream cut short."""
        if self._broken is not None:
            raise self._broken
        if not self.done:
            raise EngineFailed("the engine stream ended before [DONE]")
        summary = self.summary
        if summary is not None:
            self._tally.record(summary.finish_reasons, Tokens.of_summary(summary))
            if summary.error_status is not None:  # its error event went to the client as it came
                self._tally.fail(EngineFailed.status, EngineFailed.__name__)
        return await self._presenting.release() if self._presenting is not None else b""


DONE_EVENT = b"data: " + DONE
_JSON_OBJECT = msgspec.json.Decoder(msgspec.Struct)


def _invalid_chunk(exc: msgspec.DecodeError, event: bytes) -> EngineFailed:
    return EngineFailed(f"the engine sent an invalid chunk: {exc}: {event[:120]!r}")


class Events(Protocol):
    """What `spliced` needs of the check or derender of an engine stream."""

    def feed(self, data: bytes) -> bytes: ...

    async def tail(self) -> bytes: ...


async def spliced(
    opening: AbstractAsyncContextManager[EngineAnswer], timeouts: StreamTimeouts, events: Events
) -> AsyncGenerator[bytes, ClientSink | None]:
    """An engine stream, opened here and closed when this ends, through `events` to the client:
    up to the first output on the request's task (a failure before it is still a status), the
    rest spliced from the engine's socket to the client's, then the `tail`."""
    async with opening as engine:
        direct = spliceable(engine)
        stream: ClientSink | None = None
        async with aclosing(pieces(engine, timeouts)) as reads:
            async for piece in reads:
                out = events.feed(piece)
                if out:
                    sent = yield out
                    if sent is not None and direct is not None:
                        stream = sent
                        break
        if stream is not None and direct is not None:  # after [DONE] too: read to its end, the connection is reused
            await splice(direct, events, stream, timeouts.idle_s)
    tail = await events.tail()
    if tail:
        yield tail


class _EngineAnswer(msgspec.Struct):
    """Just enough of a non-streamed engine answer to know it is one (the rest is relayed as is)."""

    choices: list[msgspec.Raw]


_ENGINE_ANSWER = msgspec.json.Decoder(_EngineAnswer)


async def read_answer(engine: EngineAnswer, limit: int) -> bytes:
    """A non-streamed engine answer's body; a stall or a broken connection is the engine's failure,
    and so is an answer over `limit` bytes (`limits.max_answer_bytes`): it is buffered whole, so
    reading stops there (closing the connection aborts the engine's request)."""
    reader = engine.content if isinstance(engine, aiohttp.ClientResponse) else engine
    parts: list[bytes] = []
    size = 0
    try:
        while piece := await reader.readany():
            size += len(piece)
            if size > limit:
                raise EngineFailed(
                    f"the engine's answer is over limits.max_answer_bytes={limit} bytes; stream the request"
                    " (stream: true), or lower n, max_tokens or top_logprobs"
                )
            parts.append(piece)
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise stream_error(exc) from exc
    return b"".join(parts)


def check_answer(body: bytes, presented: bool = False) -> None:
    """A non-streamed engine answer is JSON of one (msgspec parses the fields it skips too:
    the whole body is checked), else the engine broke the protocol. `presented`: it is
    another API's answer object (a Response, a Message), not a choice list."""
    try:
        (_JSON_OBJECT if presented else _ENGINE_ANSWER).decode(body)
    except msgspec.DecodeError as exc:
        raise EngineFailed(f"the engine sent an invalid answer: {exc}: {body[:120]!r}") from exc


async def engine_batches(engine: EngineAnswer, timeouts: StreamTimeouts) -> AsyncGenerator[list[bytes], None]:
    """The `data:` payloads of an engine stream, up to its `[DONE]`, in the batches they
    arrived in (one read: when the gateway is behind, several events); a stream that ends
    without `[DONE]` was cut short (an empty or partial answer must not pass for a whole one)."""
    reader = SSEReader()
    try:
        async for piece in pieces(engine, timeouts):
            payloads = reader.feed(piece)
            if DONE in payloads:
                if payloads[0] != DONE:
                    yield payloads[: payloads.index(DONE)]
                return
            if payloads:
                yield payloads
        payloads = reader.flush()
        if payloads:
            if payloads[0] != DONE:
                yield payloads
            return
    except SSEError as exc:
        raise EngineFailed(f"the engine's stream is not SSE: {exc}") from exc
    raise EngineFailed("the engine stream ended before [DONE]")


async def engine_payloads(engine: EngineAnswer, timeouts: StreamTimeouts) -> AsyncGenerator[bytes, None]:
    """`engine_batches`, one payload at a time."""
    async with aclosing(engine_batches(engine, timeouts)) as batches:
        async for batch in batches:
            for payload in batch:
                yield payload


def feed_chunk(derender: Derender, mode: str, payload: bytes) -> list[Any]:
    """One engine SSE payload → the OpenAI chunks it produces."""
    try:
        chunk = decode_generate_stream_chunk(payload, "tokens" if mode == "tokens" else "text")
    except EngineError as exc:
        raise EngineFailed(f"the engine failed mid-stream: {exc}") from exc
    except ProtocolError as exc:
        raise EngineFailed(f"the engine sent an invalid chunk: {exc}") from exc
    if isinstance(chunk.usage, Usage):  # the engine's usage chunk: its cached tokens are the answer's
        note_cached(derender, chunk.usage)
    out = []
    for choice in chunk.choices:
        made = feed_choice(derender, mode, choice)
        if made is not None:
            out.append(made)
    return out


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


class Derendered:
    """The text and token routes' derender of one engine stream, fed its bytes as they arrive.

    `chunks` turns what one read brought into OpenAI chunk objects (the role
    chunks with the first output, as the engine's own derender sends them), up
    to the engine's `[DONE]`; `finish` checks the stream was whole and gives the
    last ones (the usage chunk). An event that cannot be derendered is raised
    after the chunks of the events before it went out: nothing valid is held back.
    """

    __slots__ = ("_broken", "_derender", "_mode", "_reader", "_started", "_work", "done")

    def __init__(self, derender: Derender, mode: str, work: DerenderWork) -> None:
        self._derender = derender
        self._mode = mode
        self._work = work
        self._reader = SSEReader()
        self._started = False
        self._broken: Exception | None = None
        self.done = False

    def feed(self, piece: bytes) -> bytes:
        """`chunks` as SSE frames, in one write."""
        chunks = self.chunks(piece)
        if len(chunks) == 1:  # the usual read: one event, one chunk (`_frames`, inline)
            return b"data: " + _encode(chunks[0]) + b"\n\n"
        return _frames(chunks)

    def chunks(self, piece: bytes) -> list[Any]:
        if self._broken is not None:
            raise self._broken
        if self.done:
            return []  # the client's answer is complete: whatever follows is not derendered
        try:
            payloads = self._reader.feed(piece)
        except SSEError as exc:
            raise EngineFailed(f"the engine's stream is not SSE: {exc}") from exc
        return self._derendered(payloads)

    def _derendered(self, payloads: list[bytes]) -> list[Any]:
        if DONE in payloads:
            self.done = True
            payloads = payloads[: payloads.index(DONE)]
        if not payloads:
            return []
        chunks: list[Any] = []
        timed = self._work.begin()
        try:
            for payload in payloads:
                chunks += feed_chunk(self._derender, self._mode, payload)
        except Exception as exc:  # what the events before it made still goes out, then the error
            if not chunks:
                raise
            self._broken = exc
        finally:
            if timed:
                self._work.end()
        if not self._started:
            self._started = (
                True  # the role chunk goes with the first output (once it is known good), as the engine's does
            )
            chunks = [*self._derender.start(), *chunks]
        return chunks

    def finish(self) -> list[Any]:
        """The last chunks of a stream that ended whole; raises for one cut short."""
        if self._broken is not None:
            raise self._broken
        last: list[Any] = []
        if not self.done:
            try:
                payloads = self._reader.flush()
            except SSEError as exc:
                raise EngineFailed(f"the engine's stream is not SSE: {exc}") from exc
            if not payloads:  # an empty or partial answer must not pass for a whole one
                raise EngineFailed("the engine stream ended before [DONE]")
            last = self._derendered(payloads)
            self.done = True
        if not self._started:
            self._started = True
            last = [*self._derender.start(), *last]
        usage = self._derender.usage_chunk()
        if usage is not None:
            last.append(usage)
        return last

    async def tail(self) -> bytes:
        return _frames(self.finish())


def _frames(chunks: list[Any]) -> bytes:
    return b"".join([b"data: " + _encode(chunk) + b"\n\n" for chunk in chunks])


async def derendered_batches(
    engine: EngineAnswer, derender: Derender, mode: str, timeouts: StreamTimeouts, work: DerenderWork
) -> AsyncGenerator[list[Any], None]:
    """The text and token routes as chunk objects, one list per engine read (for merging or presenting)."""
    events = Derendered(derender, mode, work)
    async with aclosing(pieces(engine, timeouts)) as reads:
        async for piece in reads:
            chunks = events.chunks(piece)
            if chunks:
                yield chunks
    last = events.finish()
    if last:
        yield last


async def encoded(chunks: AsyncGenerator[Any, None]) -> AsyncGenerator[bytes, object]:
    """OpenAI chunk objects → SSE frames (closing `chunks` when closed, so what feeds them stops at once)."""
    async with aclosing(chunks):
        async for chunk in chunks:
            yield frame(_encode(chunk))


def note_cached(derender: Derender, usage: Usage) -> None:
    details = usage.prompt_tokens_details
    if details is not None and details.cached_tokens is not None:
        derender.cached_tokens = details.cached_tokens


def whole_choices(body: bytes, mode: str, derender: Derender) -> list[Any]:
    """A whole engine answer's choices (its cached tokens noted on `derender`)."""
    try:
        answer = decode_generate_response(body, "tokens" if mode == "tokens" else "text")
    except (EngineError, ProtocolError) as exc:
        raise EngineFailed(f"the engine sent an invalid answer: {exc}") from exc
    if answer.usage is not None:
        note_cached(derender, answer.usage)
    return list(answer.choices)


def remote_error(exc: RemoteServiceError) -> GatewayError:
    """vLLM's render/derender service refused or failed: its 4xx is the client's, anything else a 502/503."""
    if 400 <= exc.status < 500:
        return status_error(exc.status, f"remote service: {exc.message}")
    if exc.status == 503:
        return EngineUnavailable(f"remote service: {exc.message}")
    return EngineFailed(f"remote service failed ({exc.status}): {exc.message}")
