"""The route objects (`gateway.relay.routes`) against a scripted engine on a loopback port.

Each route makes one leg's client stream (`frames`), its whole answer (`body`), and the same
as objects for a fan-out or a presenter (`chunks`, `answer`). Here each is driven the way
the pipeline drives it, against a real aiohttp engine that writes a scripted answer in
pieces (`tests/support/sse_engine.py`), with the Qwen3 vocabulary for the gateway's own
derender. What a whole request does through the pipeline is the integration tests'.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.vocab import TokenVocab
from engine.qwen3.vocab import IM_END_ID
from gateway.config import Timeouts
from gateway.edge.errors import EngineFailed, EngineUnavailable
from gateway.flow.endpoints import Answer, Endpoint
from gateway.observe.outcome import Tally, Tokens
from gateway.relay.engine import Derender
from derender.responses import ResponsesAssembler
from gateway.apis.responses import ResponsesPresenter
from gateway.relay.engine import Presenting
from gateway.relay.routes import Leg, Parsed, Relayed, Upstream, VllmForm
from tests.support.sse_engine import Script, split_at, sse_engine
from wire.openai_schema import (
    CHAT_COMPLETION_CHUNK_DECODER,
    CHAT_COMPLETION_DECODER,
    ChatCompletion,
    ChatCompletionChunk,
)
from wire.protocol import SUMMARY_COMMENT, EngineSummary, ResponsesPresent
from wire.responses import FINAL_TYPES

SUMMARY = EngineSummary(finish_reasons=["stop"], prompt_tokens=5, completion_tokens=2)
CHUNKS = [
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
]
EVENTS = b"".join(b"data: " + msgspec.json.encode(chunk) + b"\n\n" for chunk in CHUNKS)
RELAYED_STREAM = EVENTS + SUMMARY_COMMENT + msgspec.json.encode(SUMMARY) + b"\n\n" + b"data: [DONE]\n\n"
COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}
TIMEOUTS = Timeouts(first_token_s=5, idle_s=5)


class FakeEndpoint:
    """The two decoders `Relayed` takes from the chat endpoint (the real ones)."""

    chunk_decoder = CHAT_COMPLETION_CHUNK_DECODER
    answer_decoder = CHAT_COMPLETION_DECODER


def relayed(url: str, tally: Tally | None = None) -> Relayed:
    """The derender route in front of the engine at `url`, with the chat endpoint's decoders."""
    return Relayed(upstream(url, Tally() if tally is None else tally), cast("Endpoint[Any]", FakeEndpoint()))


def upstream(url: str, tally: Tally) -> Upstream:
    """Legs sent to the scripted engine at `url` with the gateway's default answer bound."""

    @asynccontextmanager
    async def open_leg(leg: Leg) -> AsyncIterator[aiohttp.ClientResponse]:
        async with aiohttp.ClientSession() as session, session.post(url + "/stream", data=b"{}") as response:
            leg.sent_to = url
            yield response

    return Upstream(open_leg, TIMEOUTS, 1 << 20, tally)


def leg() -> Leg:
    return Leg(0, "chatcmpl-1#abort", [1, 2, 3], "unset")


async def collect(frames: AsyncGenerator[bytes, Any]) -> bytes:
    """What the responder would write: every frame, the client's stream never handed in."""
    out = []
    async for frame in frames:
        out.append(frame)
    return b"".join(out)


async def objects(chunks: AsyncGenerator[Any, None]) -> list[Any]:
    return [chunk async for chunk in chunks]


# ------------------------------------------------------------ derender: the engine's own answer


async def test_relayed_stream_is_the_engines_events_but_its_comments_and_the_summary_is_tallied() -> None:
    tally = Tally()
    async with sse_engine(Script(split_at(RELAYED_STREAM, [7, 40, 200]))) as url:
        route = relayed(url, tally)
        sent = await collect(route.frames(leg()))
    assert sent == EVENTS + b"data: [DONE]\n\n"
    assert route.ends_itself
    assert tally.finish_reasons == ("stop",) and tally.tokens == Tokens(prompt=5, completion=2)


async def test_relayed_chunks_and_answer_are_the_client_apis_objects() -> None:
    async with sse_engine(Script([RELAYED_STREAM])) as url:
        route = relayed(url)
        chunks = await objects(route.chunks(leg()))
    assert [chunk.choices[0].finish_reason for chunk in chunks] == [None, "stop"]
    assert chunks[0].choices[0].delta.content == "Hi"
    async with sse_engine(Script([msgspec.json.encode(COMPLETION)], content_type="application/json")) as url:
        answer = await relayed(url).answer(leg())
    assert answer.choices[0].message.content == "Hi" and answer.usage.total_tokens == 7


async def test_relayed_body_is_relayed_as_it_came_and_a_broken_one_is_the_engines_failure() -> None:
    whole = msgspec.json.encode(COMPLETION)
    async with sse_engine(Script(split_at(whole, [10]), content_type="application/json")) as url:
        assert await relayed(url).body(leg()) == whole
    async with sse_engine(Script([b"<html>502</html>"], content_type="text/html")) as url:
        with pytest.raises(EngineFailed, match="invalid answer"):
            await relayed(url).body(leg())


async def test_relayed_stream_cut_short_fails_after_what_was_whole() -> None:
    async with sse_engine(Script([EVENTS[:-10]])) as url:
        frames = relayed(url).frames(leg())
        first = await frames.asend(None)
        assert first == EVENTS[: EVENTS.index(b"\n\n") + 2]
        with pytest.raises(EngineFailed, match="before \\[DONE\\]"):
            await frames.asend(None)


# ------------------------------------------------------------ derender, presented: another API's events

STARTED = {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "model": "m", "output": []}
USAGE_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def responses_events() -> bytes:
    """A Responses stream's events as the engine writes them: its assembler over the chat chunks."""
    assembler = ResponsesAssembler(ResponsesPresent(response=STARTED))
    chunks = [msgspec.convert(chunk, ChatCompletionChunk) for chunk in [*CHUNKS, USAGE_CHUNK]]
    return b"".join(assembler.feed(chunk) for chunk in chunks) + assembler.end()


def wire_end() -> bytes:
    return SUMMARY_COMMENT + msgspec.json.encode(SUMMARY) + b"\n\n" + b"data: [DONE]\n\n"


def presented(url: str, kept: list[bytes], tally: Tally | None = None) -> tuple[Relayed, Presenting]:
    async def keep(final: bytes) -> None:
        kept.append(final)

    presenting = Presenting(FINAL_TYPES, keep)
    endpoint = cast("Endpoint[Any]", FakeEndpoint())
    return Relayed(upstream(url, Tally() if tally is None else tally), endpoint, presenting), presenting


async def test_presented_stream_is_the_engines_events_counted_without_done_and_its_final_one_kept() -> None:
    events, kept, tally = responses_events(), list[bytes](), Tally()
    cuts = [5, 40, events.index(b"event: response.output_text.delta") + 3, len(events) - 9, len(events) + 30]
    async with sse_engine(Script(split_at(events + wire_end(), cuts))) as url:
        route, presenting = presented(url, kept, tally)
        sent = await collect(route.frames(leg()))
    assert sent == events  # byte for byte: nothing re-encoded, the engine's [DONE] kept from the client
    assert presenting.events == events.count(b"event: ") > 5
    final = msgspec.json.decode(kept[0])
    assert len(kept) == 1 and final["type"] == "response.completed"
    assert final["response"]["output"][0]["content"][0]["text"] == "Hi" and final["response"]["usage"]["total_tokens"] == 7
    assert tally.finish_reasons == ("stop",) and tally.tokens == Tokens(prompt=5, completion=2)


async def test_presented_stream_cut_short_gets_the_gateways_error_numbered_after_the_engines_events() -> None:
    events = responses_events()
    first_three = events[: events.index(b"\n\n", events.index(b"event: response.output_item.added")) + 2]
    async with sse_engine(Script([first_three, b"event: response.output_text.delta\ndata: {"])) as url:
        route, presenting = presented(url, [])
        frames = route.frames(leg())
        assert await frames.asend(None) == first_three
        with pytest.raises(EngineFailed, match="before \\[DONE\\]") as failed:
            await frames.asend(None)
    assert presenting.events == 3
    error = ResponsesPresenter(None, "tenant").error_frame(failed.value, presenting.events)
    assert error.startswith(b"event: error\ndata: ") and msgspec.json.decode(error[19:])["sequence_number"] == 3


async def test_presented_body_is_the_engines_answer_object_as_it_came_and_kept() -> None:
    completion = msgspec.convert(COMPLETION, ChatCompletion)
    whole = msgspec.json.encode(ResponsesAssembler(ResponsesPresent(response=STARTED)).whole(completion))
    kept: list[bytes] = []
    async with sse_engine(Script(split_at(whole, [10]), content_type="application/json")) as url:
        assert await presented(url, kept)[0].body(leg()) == whole
    assert kept == [whole]


@pytest.mark.parametrize(
    ("event", "error"),
    [
        (b"event: response.created\n\n", "without data"),
        (b"event: response.created\ndata: {not json}\n\n", "invalid chunk"),
        (b"<html>502</html>\n\n", "not SSE"),
    ],
)
async def test_a_presented_event_that_breaks_the_protocol_is_the_engines_failure(event: bytes, error: str) -> None:
    async with sse_engine(Script([event + wire_end()])) as url:
        with pytest.raises(EngineFailed, match=error):
            await collect(presented(url, [])[0].frames(leg()))


# ------------------------------------------------------------ vLLM's derender form: whole answers only


async def test_vllm_form_answers_whole_and_refuses_a_stream(qwen3_vocab: TokenVocab) -> None:
    answer = Answer(
        model=None, model_name="m", response_id="chatcmpl-1", created=1,  # type: ignore[arg-type]
        include_usage=False, continuous_usage=False,
    )
    route = VllmForm(upstream("http://127.0.0.1:9", Tally()), answer, return_token_ids=False)
    with pytest.raises(EngineUnavailable):
        route.frames(leg())
    with pytest.raises(EngineUnavailable):
        route.chunks(leg())


# ------------------------------------------------------------ text and tokens: derendered here


def tokens_stream(pieces: Sequence[Sequence[int]], finish: str = "stop") -> bytes:
    """The engine's tokens-mode stream: one chunk per piece of ids, the last with the finish
    (a `stop` finish ends on the EOS token, which the client never sees)."""
    events = []
    for i, ids in enumerate(pieces):
        choice: dict[str, Any] = {"index": 0, "token_ids": list(ids)}
        if i == len(pieces) - 1:
            choice["finish_reason"] = finish
        events.append(b"data: " + msgspec.json.encode({"request_id": "r", "choices": [choice]}) + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"


class Work:
    """`DerenderWork`'s surface, counting what the route asked of it (its own tests are `test_observe.py`'s)."""

    def __init__(self) -> None:
        self.reads = 0
        self.finished: list[Any] = []

    def begin(self) -> bool:
        self.reads += 1
        return False

    def end(self) -> None:
        raise AssertionError("never timed here")

    def finish(self, derender: Any | None) -> None:
        self.finished.append(derender)


def parsed(url: str, vocab: TokenVocab, legs: int = 1) -> tuple[Parsed, Work]:
    def make(leg: Leg) -> Derender:
        return ChatDerender(
            vocab, ChatOptions(), model="m", prompt_token_ids=leg.prompt, response_id="chatcmpl-1", created=1,
            include_usage=True, keep_answer=True,
        )

    work = Work()
    return Parsed(upstream(url, Tally()), "tokens", make, work, legs), work  # type: ignore[arg-type]


async def test_parsed_stream_is_the_derendered_chunks_then_done(qwen3_vocab: TokenVocab, enc: Callable[[str], list[int]]) -> None:
    ids = enc("Hello there, world")
    async with sse_engine(Script(split_at(tokens_stream([ids[:2], [*ids[2:], IM_END_ID]]), [5, 60]))) as url:
        route, work = parsed(url, qwen3_vocab)
        sent = await collect(route.frames(leg()))
    assert not route.ends_itself  # the responder adds [DONE]
    payloads = [msgspec.json.decode(event[6:]) for event in sent.split(b"\n\n") if event]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p["choices"])
    assert text == "Hello there, world"
    assert payloads[-1]["usage"]["completion_tokens"] == len(ids) + 1  # the usage chunk closes the stream
    route.finish()
    assert work.reads >= 1 and work.finished[0] is not None  # one leg: its derender describes the outcome


async def test_parsed_answer_and_chunks_agree(qwen3_vocab: TokenVocab, enc: Callable[[str], list[int]]) -> None:
    ids = [*enc("one two three"), IM_END_ID]
    whole = {"request_id": "r", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop"}]}
    async with sse_engine(Script([msgspec.json.encode(whole)], content_type="application/json")) as url:
        route, _ = parsed(url, qwen3_vocab)
        answer = await route.answer(leg())
    assert answer.choices[0].message.content == "one two three"
    async with sse_engine(Script([tokens_stream([ids])])) as url:
        route, work = parsed(url, qwen3_vocab, legs=2)
        chunks = await objects(route.chunks(leg()))
        route.finish()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three"
    assert work.finished == [None]  # several legs: the merged answer is tallied by the fan-out


async def test_parsed_engine_failure_mid_stream_is_raised_after_the_good_chunks(
    qwen3_vocab: TokenVocab, enc: Callable[[str], list[int]]
) -> None:
    good = tokens_stream([[*enc("fine"), IM_END_ID]]).split(b"data: [DONE]")[0].replace(b',"finish_reason":"stop"', b"")
    async with sse_engine(Script([good, b'data: {"error": {"message": "boom", "type": "x", "code": 500}}\n\n'])) as url:
        route, _ = parsed(url, qwen3_vocab)
        frames = route.frames(leg())
        assert b"fine" in await frames.asend(None)
        with pytest.raises(EngineFailed, match="boom"):
            await frames.asend(None)


@pytest.fixture
def enc(qwen3_tokenizer: Any) -> Callable[[str], list[int]]:
    return lambda text: list(qwen3_tokenizer.encode(text, add_special_tokens=False))
