"""One object per route: how an engine request's answer becomes the client's.

    Relayed      derender         the engine answers in the client's API (chat,
                                  completions, Responses, Messages): its bytes,
                                  checked, go through untouched
    VllmForm     derender         a stock vLLM ≥ 0.33 (its own form): parse_context
                                  in, GenerateDerenderResponse out (whole chat only)
    Parsed       text / tokens    the engine sends text or token ids; the gateway's
                                  stateful derender parses them into chunks
    Remote       tokens-remote    token ids through vLLM's stateless derender service

Each knows four things about one `Leg` (one engine request): its client stream
(`frames`), its whole answer as the client's JSON (`body`), and the same as objects
for whoever reshapes them (`chunks`, `answer`: the fan-out that merges several legs,
a presenter that answers in another API's shape). The pipeline picks one per
request (`route_for`) and never asks which it has.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from wire.openai_schema import ChatCompletion
from wire.protocol import SUMMARY_HEADER, decode_summary
from gateway.upstream import vllm_derender
from gateway.config import Route
from gateway.config import Timeouts as StreamTimeouts
from gateway.flow.endpoints import Answer, Endpoint, RemoteDerender
from gateway.upstream.engine_stream import EngineAnswer
from gateway.edge.errors import EngineFailed, EngineUnavailable, GatewayError
from gateway.observe.spans import DerenderWork
from gateway.observe.outcome import Tally, Tokens
from gateway.relay.engine import (
    Derender,
    Derendered,
    EngineEvents,
    Presenting,
    check_answer,
    derendered_batches,
    engine_payloads,
    feed_choice,
    read_answer,
    remote_error,
    spliced,
    stream_error,
    whole_choices,
)
from gateway.upstream.remote import RemoteServiceError
from gateway.relay.responder import Frames
from gateway.relay.sse import frame

_encode = msgspec.json.Encoder().encode


@dataclass
class Leg:
    """One engine request: one prompt's generation (all its `n` choices)."""

    index: int
    request_id: str
    """The engine request's id: the answer's id, then `#` and an abort handle drawn here
    (`wire.protocol.ABORT_HANDLE_SEPARATOR`): only the whole id aborts it, and the gateway
    logs only the answer's id, so whoever reads the logs or the answer cannot."""
    prompt: Sequence[int]
    sent_to: str
    """The engine that holds the generation (after any retries): aborts go there."""
    prefilled_on: list[str] = field(default_factory=list)
    """The prefill engine, when disaggregated: aborts go there too."""
    kv: dict[str, Any] | None = None
    body: bytes = b""
    """The engine request, made once the prefill (if any) has handed its KV over."""

    def engines(self) -> list[str]:
        return [self.sent_to, *self.prefilled_on]


Open = Callable[[Leg], AbstractAsyncContextManager[EngineAnswer]]
"""Sends a leg's engine request; the answer is read inside, the connection closed after."""


@dataclass(frozen=True, slots=True)
class Upstream:
    """What every route needs of the engine side of one request."""

    open: Open
    timeouts: StreamTimeouts
    max_answer_bytes: int
    tally: Tally
    """Where a route that sees the whole answer records its tokens for the outcome."""

    async def read(self, leg: Leg) -> tuple[bytes, EngineAnswer]:
        """A leg's whole (non-streamed) engine answer, and the response it came on (its headers)."""
        async with self.open(leg) as engine:
            return await read_answer(engine, self.max_answer_bytes), engine


class EngineRoute(Protocol):
    name: Route
    ends_itself: bool
    """Whether `frames` carry the stream's own end (`[DONE]`): the engine's relayed stream does."""

    def frames(self, leg: Leg) -> Frames:
        """The client's stream of one leg, as SSE frames."""
        ...

    async def body(self, leg: Leg) -> bytes:
        """The client's whole answer of one leg, as JSON."""
        ...

    def chunks(self, leg: Leg) -> AsyncGenerator[Any, None]:
        """One leg's chunk objects (its usage chunk included), for merging or presenting."""
        ...

    async def answer(self, leg: Leg) -> Any:
        """One leg's whole answer object, for merging or presenting."""
        ...

    def finish(self) -> None:
        """The request is over (answered or not): record what only the route knows."""
        ...


class Relayed:
    """The derender route: the engine's own answer in the client's API, checked as it passes;
    with `presenting`, in the API the client's chat request was translated from (Responses,
    Messages: the engine assembled its events or its object)."""

    name: Route = "derender"
    ends_itself = True

    def __init__(self, upstream: Upstream, endpoint: Endpoint[Any], presenting: Presenting | None = None) -> None:
        self._up = upstream
        self._endpoint = endpoint
        self._presenting = presenting

    def frames(self, leg: Leg) -> Frames:
        up = self._up
        return spliced(up.open(leg), up.timeouts, EngineEvents(up.tally, self._presenting))

    async def body(self, leg: Leg) -> bytes:
        raw, engine = await self._up.read(leg)
        check_answer(raw, presented=self._presenting is not None)
        header = engine.headers.get(SUMMARY_HEADER)
        summary = decode_summary(header) if header is not None else None
        if summary is not None:
            self._up.tally.record(summary.finish_reasons, Tokens.of_summary(summary))
        if self._presenting is not None:
            await self._presenting.keep(raw)
        return raw

    async def chunks(self, leg: Leg) -> AsyncGenerator[Any, None]:
        decoder = self._endpoint.chunk_decoder
        async with self._up.open(leg) as engine, aclosing(engine_payloads(engine, self._up.timeouts)) as payloads:
            async for payload in payloads:
                yield decoded(decoder, payload, "the engine")

    async def answer(self, leg: Leg) -> Any:
        raw, _ = await self._up.read(leg)
        return decoded_answer(self._endpoint.answer_decoder, raw)

    def finish(self) -> None:
        pass


class VllmForm:
    """The derender route on a stock vLLM ≥ 0.33, in its own form: routing offers it for
    non-streaming chat only, so it answers whole or not at all."""

    name: Route = "derender"
    ends_itself = True

    def __init__(self, upstream: Upstream, answer: Answer, return_token_ids: bool) -> None:
        self._up = upstream
        self._answer = answer
        self._return_token_ids = return_token_ids

    def frames(self, leg: Leg) -> Frames:
        raise EngineUnavailable("a stock vLLM's derender answers non-streaming chat only")

    async def body(self, leg: Leg) -> bytes:
        return _encode(await self.answer(leg))

    def chunks(self, leg: Leg) -> AsyncGenerator[Any, None]:
        raise EngineUnavailable("a stock vLLM's derender answers non-streaming chat only")

    async def answer(self, leg: Leg) -> ChatCompletion:
        """vLLM's derender answer as the client's ChatCompletion (its outcome recorded)."""
        raw, _ = await self._up.read(leg)
        answer = self._answer
        completion = vllm_derender.chat_completion(
            raw,
            response_id=answer.response_id,
            model=answer.model_name,
            created=answer.created,
            reasoning_field=answer.model.reasoning_field,
            return_token_ids=self._return_token_ids,
        )
        reasons = [choice.finish_reason for choice in completion.choices]
        self._up.tally.record(reasons, Tokens.of_usage(completion.usage))
        return completion

    def finish(self) -> None:
        pass


class Parsed:
    """The text and token routes: the engine's text deltas or token ids, derendered here."""

    ends_itself = False

    def __init__(
        self,
        upstream: Upstream,
        name: Route,
        make: Callable[[Leg], Derender],
        work: DerenderWork,
        legs: int,
    ) -> None:
        self.name = name
        self._up = upstream
        self._mode = "tokens" if name == "tokens" else "text"
        self._make = make
        self._work = work
        self._single = legs == 1
        self._derender: Derender | None = None
        """The one derender that saw the whole answer (one leg): it describes the outcome."""

    def _new(self, leg: Leg) -> Derender:
        derender = self._make(leg)
        if self._single:
            self._derender = derender
        return derender

    def frames(self, leg: Leg) -> Frames:
        events = Derendered(self._new(leg), self._mode, self._work)
        return spliced(self._up.open(leg), self._up.timeouts, events)

    async def body(self, leg: Leg) -> bytes:
        return _encode(await self.answer(leg))

    async def chunks(self, leg: Leg) -> AsyncGenerator[Any, None]:
        derender = self._new(leg)
        async with self._up.open(leg) as engine:
            batches = derendered_batches(engine, derender, self._mode, self._up.timeouts, self._work)
            async with aclosing(batches):
                async for batch in batches:
                    for chunk in batch:
                        yield chunk

    async def answer(self, leg: Leg) -> Any:
        """All of each choice in one step."""
        raw, _ = await self._up.read(leg)
        derender, work = self._new(leg), self._work
        timed = work.begin()
        try:
            for choice in whole_choices(raw, self._mode, derender):
                feed_choice(derender, self._mode, choice)
            return derender.response()
        except GatewayError:
            raise
        except Exception as exc:  # what the engine sent could not be made into an answer: a 502
            raise stream_error(exc) from exc
        finally:
            if timed:
                work.end()

    def finish(self) -> None:
        self._work.finish(self._derender)


class Remote:
    """The tokens-remote route: every engine chunk through vLLM's stateless derender service."""

    name: Route = "tokens-remote"
    ends_itself = False

    def __init__(self, upstream: Upstream, endpoint: Endpoint[Any], make: Callable[[Leg], RemoteDerender]) -> None:
        self._up = upstream
        self._endpoint = endpoint
        self._make = make

    async def _payloads(self, leg: Leg) -> AsyncGenerator[bytes, None]:
        remote = self._make(leg)
        async with self._up.open(leg) as engine, aclosing(engine_payloads(engine, self._up.timeouts)) as payloads:
            async for payload in payloads:
                if payload.startswith(b'{"error"'):
                    raise EngineFailed(f"the engine failed mid-stream: {payload[:300].decode('utf-8', 'replace')}")
                chunk = await remote.chunk(payload)
                if chunk is not None:
                    yield chunk

    async def frames(self, leg: Leg) -> Frames:
        async with aclosing(self._payloads(leg)) as payloads:
            async for chunk in payloads:
                yield frame(chunk)

    async def body(self, leg: Leg) -> bytes:
        raw, _ = await self._up.read(leg)
        try:
            return await self._make(leg).whole(raw)
        except RemoteServiceError as exc:
            raise remote_error(exc) from exc

    async def chunks(self, leg: Leg) -> AsyncGenerator[Any, None]:
        decoder = self._endpoint.chunk_decoder
        async with aclosing(self._payloads(leg)) as payloads:
            async for payload in payloads:
                yield decoded(decoder, payload, "the derender service")

    async def answer(self, leg: Leg) -> Any:
        return decoded_answer(self._endpoint.answer_decoder, await self.body(leg))

    def finish(self) -> None:
        pass


def decoded(decoder: msgspec.json.Decoder[Any], payload: bytes, sender: str) -> Any:
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EngineFailed(f"{sender} sent an invalid chunk: {exc}: {payload[:120]!r}") from exc


def decoded_answer(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise EngineFailed(f"the engine sent an invalid answer: {exc}: {raw[:120]!r}") from exc
