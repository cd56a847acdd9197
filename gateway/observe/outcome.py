"""One event per request: where it went, what it produced, how it ended.

The pipeline writes what the client was answered into the request's `Tally` (finish reasons
and tokens, from whichever of the routes produced them). When the request is over (answered
whole, streamed to its end, refused, or cut by a client that left), the observe middleware
turns the tally and the request's facts into one frozen `Outcome` and emits it, once.
Whoever needs "this request ended with these tokens" subscribes to `Outcomes`: the server
span's attributes and the request and token metrics do (`gateway.serving.app`); a limiter or an
accounting sink will. Nobody re-derives usage from the wire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import msgspec
from opentelemetry.trace import Span

from wire.openai_schema import Usage
from wire.protocol import EngineSummary

log = logging.getLogger(__name__)

CLIENT_GONE = 499
"""The status an outcome carries when its client left before the answer was complete."""


class Tokens(msgspec.Struct, frozen=True):
    """What a request cost, in tokens: its prompt (and the part served from the engine's
    prefix cache), its completion (and the part of that which was reasoning)."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0
    reasoning: int = 0

    @classmethod
    def of_usage(cls, usage: Usage) -> Tokens:
        prompt_details, completion_details = usage.prompt_tokens_details, usage.completion_tokens_details
        return cls(
            prompt=usage.prompt_tokens,
            cached=(prompt_details.cached_tokens or 0) if prompt_details is not None else 0,
            completion=usage.completion_tokens or 0,
            reasoning=completion_details.reasoning_tokens if completion_details is not None else 0,
        )

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(
            prompt=self.prompt + other.prompt,
            cached=self.cached + other.cached,
            completion=self.completion + other.completion,
            reasoning=self.reasoning + other.reasoning,
        )

    @classmethod
    def of_summary(cls, summary: EngineSummary) -> Tokens:
        return cls(
            prompt=summary.prompt_tokens,
            cached=summary.cached_tokens,
            completion=summary.completion_tokens,
            reasoning=summary.reasoning_tokens,
        )


class Tally:
    """What one request became so far; the pipeline writes it, the observe middleware reads it.

    Its id, model and route as they are settled, the client leaving, and the answer's
    account: a later `record` replaces an earlier one, each being the whole answer's (a
    fan-out records its merged sum, not its legs).
    """

    __slots__ = (
        "client_gone",
        "content",
        "cut",
        "engine",
        "finish_reasons",
        "model",
        "reason",
        "request_id",
        "route",
        "stream_error",
        "tokens",
    )

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.model: str | None = None
        """The served model's name, once the request named a known one (a bounded metrics label)."""
        self.route: str | None = None
        self.reason: str | None = None
        """Why the policy (or the override header) chose the route."""
        self.engine: str | None = None
        """The engine routing chose (a retry may have moved the request after it)."""
        self.client_gone = False
        """The client left mid-answer (counted as a 499 and a disconnect, not as the status it was sent)."""
        self.finish_reasons: tuple[str | None, ...] = ()
        self.tokens: Tokens | None = None
        self.cut: asyncio.Future[Tokens | None] | None = None
        """When the client left and its engine requests were aborted: what they used, as the
        engines' abort answers say (None inside when one did not)."""
        self.stream_error: tuple[int, str] | None = None
        """The status and type of the error a stream ended with after its 200 headers (in-band)."""
        self.content: list[bytes] | None = None
        """Under `tracing.record_content` only: the answer's bytes as they went to the client."""

    def record(self, finish_reasons: Sequence[str | None], tokens: Tokens) -> None:
        self.finish_reasons = tuple(finish_reasons)
        self.tokens = tokens

    def fail(self, status: int, error: str) -> None:
        """The stream broke after its first byte: the client got an error event, not the end of its
        answer, so the outcome is a failure with that error's status, not the 200 its headers said."""
        self.stream_error = (status, error)


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """How one request to an API endpoint ended. Emitted once, after its last byte."""

    request_id: str | None
    """The answer's id (`x-request-id`), None when the request was refused before it had one."""
    endpoint: str
    """chat, completions, responses or messages."""
    model: str | None
    """The served model's name, None when the request named none that is served."""
    tenant: str | None
    route: str
    """The route taken (derender, text, tokens, tokens-remote) or `none` when none was."""
    status: int
    """The HTTP status sent; `CLIENT_GONE` when the client left before the answer was complete; the
    error's status when a stream ended with an error event after its 200 headers (`stream_error`)."""
    error: str | None
    """The error's type (`error.type`) when the answer was an error."""
    stream_error: bool = False
    """The error came in-band, after the stream's 200 headers (a client that left is not one)."""
    finish_reasons: tuple[str | None, ...]
    tokens: Tokens | None
    """None when no answer was produced (a refusal, or a cut before the engine said)."""
    duration_s: float
    content: bytes | None = None
    """The answer as the client got it (body or SSE stream), kept only under `tracing.record_content`."""
    span: Span
    cut: asyncio.Future[Tokens | None] | None = None
    """A client cut's engine usage, known once the aborts are answered (`Tally.cut`): a
    subscriber that must charge it (the quota's settle) waits for it, bounded."""
    """The request's server span, for the subscriber that describes it."""

    @property
    def client_gone(self) -> bool:
        return self.status == CLIENT_GONE


Subscriber = Callable[[Outcome], None]


class Outcomes:
    """The subscribers to request outcomes, called in the order they subscribed.

    A subscriber that raises is logged and skipped: one broken consumer must not cost the
    others their event, nor the client its answer.
    """

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def emit(self, outcome: Outcome) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(outcome)
            except Exception:
                log.exception("an outcome subscriber failed (%r); the others still run", subscriber)
