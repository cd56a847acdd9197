"""The derender route's check of engine SSE (`EngineEvents`) and the readers of engine answers, on real bytes.

`EngineEvents` is fed a real engine stream cut at every byte offset (and in
random pieces); the readers (`engine_payloads`, `read_answer`) read from a real
aiohttp engine on a loopback port that writes its answer in scripted pieces.
"""

from __future__ import annotations

import random

import aiohttp
import msgspec
import pytest

from derender.errors import DerenderError
from wire.protocol import SUMMARY_COMMENT, EngineSummary
from gateway.config import Timeouts
from gateway.edge.errors import EngineFailed, EngineTimeout, InvalidRequest
from gateway.observe.outcome import Tally, Tokens
from gateway.relay.engine import EngineEvents, engine_payloads, read_answer, stream_error
from gateway.relay.responder import openai_error_end
from tests.support.sse_engine import Script, split_at, sse_engine

CHUNKS = [
    {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
    {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "lo 世界"}}]},
    {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
]
SUMMARY = EngineSummary(finish_reasons=["stop"], prompt_tokens=7, completion_tokens=3, reasoning_tokens=1)
DATA = b"".join(b"data: " + msgspec.json.encode(chunk) + b"\n\n" for chunk in CHUNKS)
SUMMARY_EVENT = SUMMARY_COMMENT + msgspec.json.encode(SUMMARY) + b"\n\n"
CLIENT_COMMENT = b": keep-alive\n\n"
BODY = CLIENT_COMMENT + DATA + SUMMARY_EVENT + b"data: [DONE]\n\n"
# What the client gets: every event but the engine's own comment, byte for byte.
RELAYED = CLIENT_COMMENT + DATA + b"data: [DONE]\n\n"


# A 1-byte read (cut 1, seed 6 and one byte at a time below) once passed for a whole event:
# `find` answers -1 and so does `len(data) - 2`.


def fed(events: EngineEvents, pieces: list[bytes]) -> bytes:
    return b"".join(events.feed(piece) for piece in pieces)


@pytest.mark.parametrize("cut", range(1, len(BODY)))
async def test_events_pass_whole_events_at_any_split(cut: int) -> None:
    tally = Tally()
    events = EngineEvents(tally)
    assert fed(events, [BODY[:cut], BODY[cut:]]) == RELAYED
    assert events.done and events.summary == SUMMARY
    assert await events.tail() == b""
    assert tally.finish_reasons == ("stop",)
    assert tally.tokens == Tokens(prompt=7, cached=0, completion=3, reasoning=1)


@pytest.mark.parametrize("seed", range(20))
def test_events_pass_whole_events_in_random_pieces(seed: int) -> None:
    rng = random.Random(seed)
    pieces = split_at(BODY, rng.sample(range(1, len(BODY)), rng.randint(2, 30)))
    events = EngineEvents()
    out = [events.feed(piece) for piece in pieces]
    assert b"".join(out) == RELAYED
    # Nothing partial ever goes out: every non-empty output ends on an event boundary.
    assert all(chunk.endswith(b"\n\n") for chunk in out if chunk)


def test_events_one_byte_at_a_time() -> None:
    events = EngineEvents()
    assert fed(events, [BODY[i : i + 1] for i in range(len(BODY))]) == RELAYED


def test_events_one_byte_read_inside_an_event() -> None:
    events = EngineEvents()  # a 1-byte read after a partial event is joined as it should be
    assert fed(events, [CLIENT_COMMENT[:3], CLIENT_COMMENT[3:4], CLIENT_COMMENT[4:] + b"data: [DONE]\n\n"]) == (
        CLIENT_COMMENT + b"data: [DONE]\n\n"
    )


def test_events_after_done_are_not_sent() -> None:
    events = EngineEvents()
    assert events.feed(DATA + b"data: [DONE]\n\n" + b"data: {}\n\n") == DATA + b"data: [DONE]\n\n"
    assert events.feed(b"data: {}\n\n") == b""


async def test_events_bad_event_raised_after_the_good_ones_went_out() -> None:
    events = EngineEvents()
    out = events.feed(DATA + b"<html>502 Bad Gateway</html>\n\n")
    assert out == DATA
    with pytest.raises(EngineFailed, match="not SSE"):
        events.feed(b"data: [DONE]\n\n")
    with pytest.raises(EngineFailed, match="not SSE"):
        await events.tail()


def test_events_invalid_json_chunk() -> None:
    events = EngineEvents()
    with pytest.raises(EngineFailed, match="invalid chunk"):
        events.feed(b'data: {"id": \n\n')


async def test_events_cut_before_done() -> None:
    events = EngineEvents()
    assert events.feed(DATA + b"data: {") == DATA
    with pytest.raises(EngineFailed, match=r"ended before \[DONE\]"):
        await events.tail()


def test_events_oversized_partial_event() -> None:
    from gateway.relay.sse import MAX_EVENT_BYTES

    events = EngineEvents()
    with pytest.raises(EngineFailed, match="over"):
        for _ in range(MAX_EVENT_BYTES // 65536 + 2):
            events.feed(b"data: " + b"x" * 65536)


def test_stream_error_says_whose_failure() -> None:
    given = InvalidRequest("bad", param="x")
    assert stream_error(given) is given
    assert isinstance(stream_error(TimeoutError("slow")), EngineTimeout)
    assert isinstance(stream_error(aiohttp.ClientPayloadError("cut")), EngineFailed)
    assert "broke the protocol" in str(stream_error(DerenderError("token id 99999999")))
    unknown = stream_error(ValueError("odd"))
    assert isinstance(unknown, EngineFailed) and "ValueError: odd" in str(unknown)


def test_openai_error_end_is_an_error_event_then_done() -> None:
    end = openai_error_end(EngineFailed("broke"))
    events = end.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    error = msgspec.json.decode(events[0].removeprefix(b"data: "))["error"]
    assert "broke" in error["message"] and error["type"]


TIMEOUTS = Timeouts(first_token_s=5, idle_s=5)


async def payloads_of(url: str, timeouts: Timeouts = TIMEOUTS) -> list[bytes]:
    async with aiohttp.ClientSession() as session, session.post(url + "/stream", data=b"{}") as response:
        return [payload async for payload in engine_payloads(response, timeouts)]


@pytest.mark.parametrize("seed", range(5))
async def test_engine_payloads_across_socket_splits(seed: int) -> None:
    rng = random.Random(seed)
    script = Script(split_at(BODY, rng.sample(range(1, len(BODY)), 12)))
    async with sse_engine(script) as url:
        payloads = await payloads_of(url)
    assert payloads == [msgspec.json.encode(chunk) for chunk in CHUNKS]


async def test_engine_payloads_stream_without_done_is_cut_short() -> None:
    async with sse_engine(Script([DATA[:20], DATA[20:]])) as url:
        with pytest.raises(EngineFailed, match=r"ended before \[DONE\]"):
            await payloads_of(url)


async def test_engine_payloads_first_token_deadline() -> None:
    script = Script([BODY], hold_before=0)
    async with sse_engine(script) as url:
        with pytest.raises(EngineTimeout, match=r"first_token_s=0\.2"):
            await payloads_of(url, Timeouts(first_token_s=0.2, idle_s=5))
        assert script.served == 0


async def test_engine_payloads_idle_deadline_after_first_event() -> None:
    first, rest = BODY[:40], BODY[40:]
    script = Script([first, rest], hold_before=1)
    async with sse_engine(script) as url:
        with pytest.raises(EngineTimeout, match=r"idle_s=0\.2"):
            await payloads_of(url, Timeouts(first_token_s=5, idle_s=0.2))


async def test_read_answer_whole_and_over_limit() -> None:
    body = msgspec.json.encode({"choices": [{"index": 0, "text": "x" * 1000}]})
    async with sse_engine(Script(split_at(body, [10, 500]), content_type="application/json")) as url:
        async with aiohttp.ClientSession() as session, session.post(url + "/stream", data=b"{}") as response:
            assert await read_answer(response, limit=len(body)) == body
        async with aiohttp.ClientSession() as session, session.post(url + "/stream", data=b"{}") as response:
            with pytest.raises(EngineFailed, match="max_answer_bytes=100"):
                await read_answer(response, limit=100)

