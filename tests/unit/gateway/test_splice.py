"""The splice: engine bytes to the client from the engine socket's callbacks, against a scripted engine.

The engine is a raw HTTP/1.1 server on a loopback port (an aiohttp server frames
and flushes its own writes, and these tests need to say which bytes arrive in
which read: a chunk cut in two, an answer's last event and its end in one
write). The gateway side is its real client (`engine_stream.StreamPool`) and the
derender route's real check (`relay.EngineEvents`); the client is a sink that
records what it was written and can fall behind, as `relay.ClientStream` does
when its socket's buffer is full.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
from aiohttp import web

from wire.protocol import SUMMARY_COMMENT, EngineSummary
from gateway.upstream.engine_stream import EngineResponse, StreamPool
from gateway.edge.errors import ClientGone, EngineDied, EngineFailed, EngineTimeout
from gateway.observe.outcome import Tally, Tokens
from gateway.relay.engine import EngineEvents
from gateway.relay.splice import splice
from tests.support.sse_engine import split_at
from tests.support.waiting import wait_until

EVENTS = [
    b"data: "
    + msgspec.json.encode({"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})
    + b"\n\n"
    for delta in ({"content": "Hel"}, {"content": "lo 世界"}, {"content": "!"})
]
SUMMARY = EngineSummary(finish_reasons=["stop"], prompt_tokens=7, completion_tokens=3)
SUMMARY_EVENT = SUMMARY_COMMENT + msgspec.json.encode(SUMMARY) + b"\n\n"
CLIENT_COMMENT = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
BODY_EVENTS = [CLIENT_COMMENT, *EVENTS, SUMMARY_EVENT, DONE]
RELAYED = CLIENT_COMMENT + b"".join(EVENTS) + DONE
"""What the client gets of the body: every event but the engine's own comment, byte for byte."""
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"
IDLE_S = 5.0
"""The engine's idle limit where a test is not about it: far above anything on loopback."""
WAIT_S = 5.0


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked HTTP body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


FRAMED = b"".join(chunk(event) for event in BODY_EVENTS) + END
"""The whole answer's body on the wire: one chunk per event, as an engine writes it."""


class Engine:
    """An engine answering one streamed request per connection: the head, then what the test hands
    it, one socket write per item (`pace_s` apart); None closes the connection."""

    def __init__(self, pace_s: float = 0.0) -> None:
        self.writes: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.written = 0
        self.pace_s = pace_s
        """A pause after each write: an engine that takes this long to generate its next piece."""

    def answer(self, *writes: bytes | None) -> None:
        for data in writes:
            self.writes.put_nowait(data)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(HEAD)
            while (data := await self.writes.get()) is not None:
                writer.write(data)
                await writer.drain()
                self.written += 1
                if self.pace_s:
                    await asyncio.sleep(self.pace_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class Recorded:
    """The real check of the engine's events, recording each piece the splice fed it."""

    def __init__(self, events: EngineEvents) -> None:
        self.events = events
        self.fed: list[bytes] = []

    def feed(self, data: bytes) -> bytes:
        self.fed.append(data)
        return self.events.feed(data)


class Client:
    """The client's stream as the splice writes to it. `behind`: its socket's buffer is full, so
    `write_now` declines and the splice `send`s, which waits until `drained` is set."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.sent: list[bytes] = []
        """What the splice had to wait for the client to take."""
        self.behind = False
        self.drained = asyncio.Event()
        self.drained.set()
        self.sending = False
        self.hold_s = 0.0
        """How long a `send` takes once drained: a client that reads its stream slowly."""
        self.fails: BaseException | None = None
        """Raised by the next write: the client left."""

    def write_now(self, data: bytes) -> bool:
        if self.fails is not None:
            raise self.fails
        if self.behind:
            return False
        self.received.append(data)
        return True

    async def send(self, data: bytes) -> None:
        self.sending = True
        try:
            await self.drained.wait()
            if self.hold_s:
                await asyncio.sleep(self.hold_s)
            if self.fails is not None:
                raise self.fails
        finally:
            self.sending = False
        self.received.append(data)
        self.sent.append(data)

    @property
    def body(self) -> bytes:
        return b"".join(self.received)


class Spliced:
    """One engine answer, its check, and the client it is spliced to."""

    def __init__(self, engine: Engine, answer: EngineResponse) -> None:
        self.engine = engine
        self.answer = answer
        self.tally = Tally()
        self.events = Recorded(EngineEvents(self.tally))
        self.client = Client()

    def start(self, idle_s: float = IDLE_S) -> asyncio.Task[None]:
        return asyncio.ensure_future(splice(self.answer, self.events, self.client, idle_s))


@asynccontextmanager
async def spliced(pace_s: float = 0.0) -> AsyncIterator[Spliced]:
    """A scripted engine on a loopback port, and its answer to one request, its head read."""
    engine = Engine(pace_s)
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = StreamPool(connect_s=2, keepalive_s=5)
    try:
        answer = await pool.post(f"http://127.0.0.1:{port}/inference/v1/generate", b"{}", {})
        try:
            yield Spliced(engine, answer)
        finally:
            answer.close()
    finally:
        engine.answer(None)  # a handler still waiting for writes ends
        pool.close()
        server.close()
        await server.wait_closed()


async def assert_relayed_whole(s: Spliced) -> None:
    """The client got every event whole, the engine's comment left out; the check saw [DONE] and the summary."""
    assert s.client.body == RELAYED
    assert all(piece.endswith(b"\n\n") for piece in s.client.received)
    assert await s.events.events.tail() == b""
    assert s.tally.finish_reasons == ("stop",) and s.tally.tokens == Tokens(prompt=7, completion=3)
    assert s.answer.complete


# ------------------------------------------------------------ whatever the reads


@pytest.mark.parametrize("seed", range(8))
async def test_the_client_gets_every_event_whole_whatever_the_engines_reads(seed: int) -> None:
    rng = random.Random(seed)
    # A millisecond between writes: each most often arrives in a read of its own.
    async with spliced(pace_s=0.001) as s:
        s.engine.answer(*split_at(FRAMED, rng.sample(range(1, len(FRAMED)), rng.randint(1, 40))))
        await asyncio.wait_for(s.start(), WAIT_S)
        await assert_relayed_whole(s)


async def test_each_event_goes_out_in_the_read_that_completes_it() -> None:
    async with spliced() as s:
        task = s.start()
        cut = len(EVENTS[0]) // 2
        s.engine.answer(chunk(CLIENT_COMMENT) + chunk(EVENTS[0][:cut]))
        await wait_until(lambda: len(s.events.fed) == 1, WAIT_S, what="the first read was fed")
        assert s.client.received == [CLIENT_COMMENT]  # the half event waits for its end
        s.engine.answer(chunk(EVENTS[0][cut:]))
        await wait_until(lambda: len(s.client.received) == 2, WAIT_S, what="the event's end went out")
        assert s.client.received[1] == EVENTS[0]
        s.engine.answer(b"".join(chunk(event) for event in BODY_EVENTS[2:]) + END)
        await asyncio.wait_for(task, WAIT_S)
        await assert_relayed_whole(s)


async def test_nothing_after_done_goes_out_and_the_answer_is_read_to_its_end() -> None:
    """After [DONE] the client's answer is complete; the engine's answer is still read to its
    end, so that its connection can carry the next one."""
    async with spliced() as s:
        task = s.start()
        s.engine.answer(chunk(RELAYED))
        await wait_until(lambda: s.client.body == RELAYED, WAIT_S, what="the answer up to [DONE] went out")
        s.engine.answer(chunk(b"data: {}\n\n") + chunk(b": late\n\n"), END)
        await asyncio.wait_for(task, WAIT_S)
        assert s.client.body == RELAYED
        assert s.answer.complete
        assert await s.events.events.tail() == b""


# ------------------------------------------------------------ a client that falls behind


async def test_a_client_that_falls_behind_holds_the_engine_until_its_write_is_out() -> None:
    async with spliced() as s:
        task = s.start()
        s.engine.answer(chunk(CLIENT_COMMENT + EVENTS[0]))
        await wait_until(lambda: len(s.client.received) == 1, WAIT_S, what="the first write went out")
        s.client.behind = True
        s.client.drained.clear()
        s.engine.answer(chunk(EVENTS[1]))
        await wait_until(lambda: s.client.sending, WAIT_S, what="the splice waits for the client")
        # The engine goes on; its socket is not read while the client's write is pending.
        s.engine.answer(chunk(EVENTS[2]), chunk(SUMMARY_EVENT) + chunk(DONE) + END)
        await wait_until(lambda: s.engine.written == 4, WAIT_S, what="the engine wrote the rest")
        assert len(s.events.fed) == 2 and not task.done()
        s.client.behind = False
        s.client.drained.set()
        await asyncio.wait_for(task, WAIT_S)
        assert s.client.sent == [EVENTS[1]]
        await assert_relayed_whole(s)


async def test_the_write_the_client_is_behind_on_goes_out_when_the_answer_ended_with_it() -> None:
    """The answer's last events and its end in one read, the client behind on them: the splice
    still writes them before it returns."""
    async with spliced() as s:
        s.client.behind = True
        s.client.drained.clear()
        task = s.start()
        s.engine.answer(FRAMED)
        await wait_until(lambda: s.answer.complete, WAIT_S, what="the engine's answer was read to its end")
        assert s.client.sending and not task.done()
        s.client.drained.set()
        await asyncio.wait_for(task, WAIT_S)
        assert s.client.sent == [RELAYED]
        await assert_relayed_whole(s)


async def test_the_time_the_client_holds_the_stream_up_is_not_the_engines_silence() -> None:
    idle_s = 0.2
    async with spliced() as s:
        s.client.behind = True
        s.client.hold_s = 3 * idle_s  # the client takes its time over one write
        task = s.start(idle_s)
        s.engine.answer(chunk(CLIENT_COMMENT + EVENTS[0]))
        await wait_until(lambda: s.client.sending, WAIT_S, what="the splice waits for the client")
        s.client.behind = False  # it catches up after this write
        s.engine.answer(b"".join(chunk(event) for event in BODY_EVENTS[2:]) + END)
        await asyncio.wait_for(task, WAIT_S)
        await assert_relayed_whole(s)


# ------------------------------------------------------------ how a splice ends otherwise


async def test_an_engine_cut_mid_answer_ends_the_splice_after_the_events_before_it_went_out() -> None:
    async with spliced() as s:
        task = s.start()
        s.engine.answer(chunk(CLIENT_COMMENT + EVENTS[0]), chunk(EVENTS[1])[:10], None)
        with pytest.raises(EngineDied, match="mid-answer"):
            await asyncio.wait_for(task, WAIT_S)
        assert s.client.body == CLIENT_COMMENT + EVENTS[0]


async def test_an_engine_silent_for_idle_s_ends_the_splice() -> None:
    async with spliced() as s:
        task = s.start(idle_s=0.2)
        s.engine.answer(chunk(CLIENT_COMMENT + EVENTS[0]))
        with pytest.raises(EngineTimeout, match=r"idle_s=0\.2"):
            await asyncio.wait_for(task, WAIT_S)
        assert s.client.body == CLIENT_COMMENT + EVENTS[0]


async def test_an_engine_that_keeps_sending_is_not_idle_however_long_its_answer() -> None:
    """`idle_s` bounds the silence since the last piece, not the answer's length."""
    idle_s, pieces = 0.3, [chunk(event) for event in BODY_EVENTS]
    async with spliced(pace_s=idle_s / 3) as s:
        task = s.start(idle_s)
        s.engine.answer(*pieces, END)  # in all about 2 × idle_s
        await asyncio.wait_for(task, WAIT_S)
        await assert_relayed_whole(s)


async def test_a_broken_event_ends_the_splice_after_the_good_ones_went_out() -> None:
    async with spliced() as s:
        task = s.start()
        s.engine.answer(chunk(CLIENT_COMMENT + EVENTS[0] + b"<html>502 Bad Gateway</html>\n\n"))
        await wait_until(lambda: len(s.events.fed) == 1, WAIT_S, what="the broken read was fed")
        s.engine.answer(chunk(DONE) + END)
        with pytest.raises(EngineFailed, match="not SSE"):
            await asyncio.wait_for(task, WAIT_S)
        assert s.client.body == CLIENT_COMMENT + EVENTS[0]


@pytest.mark.parametrize("where", ["write_now", "send"])
async def test_a_client_that_left_ends_the_splice_and_lets_go_of_the_engine(where: str) -> None:
    gone = ClientGone(web.StreamResponse())
    async with spliced() as s:
        s.client.behind = where == "send"
        s.client.fails = gone
        task = s.start()
        s.engine.answer(chunk(CLIENT_COMMENT + EVENTS[0]))
        with pytest.raises(ClientGone) as raised:
            await asyncio.wait_for(task, WAIT_S)
        assert raised.value is gone and s.client.received == []
        # Unspliced: what the engine sends next is the reader's again, not the splice's.
        s.engine.answer(chunk(EVENTS[1]))
        assert await asyncio.wait_for(s.answer.readany(), WAIT_S) == EVENTS[1]
        assert len(s.events.fed) == 1


async def test_a_cancelled_splice_lets_go_of_the_engine() -> None:
    """The handler is cancelled when its client leaves: the splice stops taking the engine's pieces."""
    async with spliced() as s:
        task = s.start()
        s.engine.answer(chunk(CLIENT_COMMENT + EVENTS[0]))
        await wait_until(lambda: len(s.client.received) == 1, WAIT_S, what="the first write went out")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        s.engine.answer(chunk(EVENTS[1]))
        assert await asyncio.wait_for(s.answer.readany(), WAIT_S) == EVENTS[1]
        assert len(s.events.fed) == 1 and s.client.body == CLIENT_COMMENT + EVENTS[0]
