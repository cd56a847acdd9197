"""APIs that are another shape of a chat completion: the Responses API, Anthropic's Messages.

Such an endpoint translates its request into the chat request the pipeline
already runs (render, route, engine, derender: one implementation), and a
`Presenter` gives the answer its own shape: it says what the API's assembler
(`derender.responses`, `derender.messages`) needs of the request (`present`),
which the engine runs on the `derender` route (the gateway relays its events
and keeps what the API stores: `relayed`), and the gateway runs here on the
others, over the chat chunks (`stream`) or the chat completion (`whole`).
No second parser: reasoning and tool calls were parsed once, by the chat
derender (on the engine or in the gateway), whatever the route.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from wire.openai_schema import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, StreamOptions
from wire.protocol import Present
from gateway.edge.errors import GatewayError

F = TypeVar("F")
_encode_chat = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Turn(Generic[F]):
    """A foreign request and the chat request it runs as."""

    original: F
    chat: ChatCompletionRequest
    chat_body: bytes
    """`chat` as JSON: what a derender engine and vLLM's render service receive."""
    report: object = None
    """What the translation did that the answer reports (Messages: the context edits applied)."""

    @property
    def model(self) -> str | None:
        return self.chat.model

    @property
    def stream(self) -> bool:
        return bool(self.chat.stream)

    @property
    def stream_options(self) -> StreamOptions | None:
        return self.chat.stream_options


def turn(original: F, chat: ChatCompletionRequest, report: object = None) -> Turn[F]:
    """The chat request always asks for usage: every foreign shape reports it at the end."""
    if chat.stream:
        chat = msgspec.structs.replace(chat, stream_options=StreamOptions(include_usage=True))
    return Turn(original, chat, _encode_chat(chat), report)


@dataclass(frozen=True, slots=True)
class Presented:
    """What a presenter knows of the answer besides the chat objects."""

    response_id: str
    model: str
    """The name the answer carries (the client's, which may be an alias)."""
    created: int
    prompt_tokens: int


class Presenter(Protocol[F]):
    final_events: tuple[str, ...]
    """The stream events whose data holds the whole answer (for `relayed`)."""

    def present(self, turn: Turn[F], meta: Presented) -> Present:
        """What the API's assembler needs of the request, sent to a derender engine."""
        ...

    async def relayed(self, turn: Turn[F], meta: Presented, final: bytes) -> None:
        """The engine assembled the answer: `final` is its whole answer, or the data of its
        final event (one of `final_events`); the API keeps what it stores of it."""
        ...

    def stream(
        self, turn: Turn[F], meta: Presented, chunks: AsyncGenerator[ChatCompletionChunk, None]
    ) -> AsyncGenerator[bytes, object]:
        """The chat chunks of one choice (the usage chunk last) as this API's SSE frames,
        its closing event included (no `[DONE]` unless the API sends one)."""
        ...

    async def whole(self, turn: Turn[F], meta: Presented, completion: ChatCompletion) -> Any:
        """A whole chat completion as this API's answer object (JSON-encodable)."""
        ...

    def error_frame(self, error: GatewayError, sequence: int | None = None) -> bytes:
        """The frame that ends a stream that failed after its first byte; `sequence`: how many
        events the engine wrote before it (None: `stream` wrote them)."""
        ...
