"""What the engine knows beyond a request, for the writers that turn its outputs into bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from derender.chat import ReasoningField
from derender.vocab import TokenVocab
from engine.backends.base import BackendOutput
from engine.errors import EngineHTTPError, error_body


@dataclass(frozen=True, slots=True)
class WriterContext:
    """What the engine knows beyond the request: its model, tokenizer and parsers."""

    model: str
    vocab: TokenVocab | None
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    reasoning_field: ReasoningField = "reasoning"


class DataFrames:
    """SSE framing of the engine's own answers: each payload a `data:` event, a failure after the
    first byte an OpenAI error object in one. A writer that answers in another API's events
    frames them itself."""

    def frame(self, payload: bytes) -> bytes:
        return b"data: " + payload + b"\n\n"

    def error_frame(self, error: EngineHTTPError) -> bytes:
        return b"data: " + error_body(error) + b"\n\n"


class CachedTokens(Protocol):
    """A writer's usage source: its tokens or derender state."""

    cached_tokens: int | None


def note_cached(output: BackendOutput, holder: CachedTokens) -> None:
    """Keep the prefix-cache hit a backend reports on a request's first output, for usage."""
    if output.num_cached_tokens is not None and holder.cached_tokens is None:
        holder.cached_tokens = output.num_cached_tokens
