"""The parser interface: reasoning and tool-call parsers as incremental state machines.

A choice's output reaches the parsers as *pieces* `(text, token_id)` left
after stop strings (see `derender.stop`). Parsing runs in two stages:

    pieces ──ReasoningParser──> reasoning text + content pieces
    content pieces ──ToolParser──> content text + tool-call deltas

Each stage is one object per choice for the life of the request, fed only the
new pieces (O(delta)), with an explicit `finish()`. A family is described by a
*factory*: its marker strings (texts that are single tokens in the family's
tokenizer and must stay whole: stop strings never split them and the text
route recovers their ids from text) and a `build` that binds it to a
vocabulary once and then makes one parser per choice.

A marker counts only when the piece's token id is the marker's id *and* the
piece's text still ends with the marker's text: a stop string that cut into a
marker turns it back into plain text.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from derender.stop import Piece
from derender.vocab import TokenVocab


class UnknownParser(ValueError):
    """A parser name that no registry knows, or markers the tokenizer lacks."""


class MissingMarker(UnknownParser):
    """A family's marker is not a single token of this vocabulary."""


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolDelta:
    """One OpenAI `tool_calls` delta entry: a header (id, name) or an argument fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """What a parser may know of one offered tool: its name and JSON-schema parameters."""

    name: str
    parameters: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ToolCallText:
    """A call to write in a family's format: the name and its arguments as a JSON object."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ParseOptions:
    """The request's say in parsing, resolved once per request."""

    tools_enabled: bool = False
    """Tools were offered and `tool_choice` is not `none` (no tool parsing otherwise)."""
    tools: tuple[ToolSchema, ...] = ()
    parallel_tool_calls: bool = True
    enable_thinking: bool = True
    new_id: Callable[[], str] = field(default=new_tool_call_id)
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The request's template kwargs as sent: vLLM's parsers read more than `enable_thinking`
    (`thinking`, `reasoning_effort`, ...) and their own defaults when one is absent."""

    def schema_of(self, name: str) -> Mapping[str, Any] | None:
        for tool in self.tools:
            if tool.name == name:
                return tool.parameters
        return None


class Markers:
    """A family's marker strings bound to one vocabulary: id → text, text → id."""

    __slots__ = ("by_id", "by_text")

    def __init__(self, vocab: TokenVocab, texts: Sequence[str]) -> None:
        by_text: dict[str, int] = {}
        for text in texts:
            token_id = vocab.token_id(text)
            if token_id is None:
                raise MissingMarker(f"marker {text!r} is not a single token in this tokenizer")
            by_text[text] = token_id
        self.by_text = by_text
        self.by_id = {token_id: text for text, token_id in by_text.items()}

    def id(self, text: str) -> int:
        return self.by_text[text]

    def get(self, text: str) -> int:
        """The marker's id, or -1 when this family's tokenizer lacks it (optional markers)."""
        return self.by_text.get(text, -1)


def marker_of(piece: Piece, by_id: Mapping[int, str]) -> str | None:
    """The marker a piece ends with, or None for plain text."""
    marker = by_id.get(piece[1])
    if marker is None or not piece[0].endswith(marker):
        return None
    return marker


class ReasoningParser(ABC):
    """Splits one choice's pieces into reasoning text and content pieces.

    `reasoning_tokens` counts the output tokens routed to reasoning, markers
    excluded: the usage figure comes from the same machine as the text.
    """

    reasoning_tokens: int = 0

    @abstractmethod
    def feed(self, pieces: Sequence[Piece], reasoning: list[str]) -> Sequence[Piece]:
        """Append reasoning text to `reasoning`; return the pieces that are content."""

    def finish(self, reasoning: list[str]) -> Sequence[Piece]:
        """The output ended: release anything held (as reasoning or content)."""
        return ()


class ToolParser(ABC):
    """Turns one choice's content pieces into content text and tool-call deltas."""

    calls: int = 0
    """Tool calls emitted so far (a header was sent)."""

    @abstractmethod
    def feed(self, pieces: Sequence[Piece]) -> None: ...

    @abstractmethod
    def finish(self) -> None:
        """The output ended: close an open call, settle held text."""

    @abstractmethod
    def drain(self) -> tuple[str, list[ToolDelta]]:
        """(content, tool deltas) produced since the last drain."""


class BoundReasoning(ABC):
    """A reasoning family bound to one vocabulary (marker ids resolved once)."""

    markers: Markers
    strays: Mapping[int, str] = {}
    """Markers (id → text) dropped from content outside tool calls: a duplicate end marker."""
    end_ids: frozenset[int] = frozenset()
    """Output ids that end reasoning: a structured-output constraint holds from the token after
    one (vLLM's `is_reasoning_end`); empty: the family cannot tell, the constraint holds at once."""

    @abstractmethod
    def starts_in_reasoning(self, prompt_token_ids: Sequence[int], options: ParseOptions) -> bool:
        """Initial state from the rendered prompt and `enable_thinking`."""

    @abstractmethod
    def new(self, options: ParseOptions, *, in_reasoning: bool, tool_starts: Mapping[int, str]) -> ReasoningParser:
        """One choice's parser; `tool_starts` are the tool family's call-opening markers (id → text),
        empty when tools are off."""


class BoundTools(ABC):
    """A tool family bound to one vocabulary."""

    markers: Markers
    starts: Mapping[int, str]
    """The markers that open a call, id → text (reasoning families may end on them)."""

    @abstractmethod
    @abstractmethod
    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        """One choice's parser; `strays` are the reasoning family's markers to drop from content."""


@dataclass(frozen=True, slots=True)
class ReasoningFactory:
    """A reasoning family as the registry holds it."""

    name: str
    bind: Callable[[TokenVocab], BoundReasoning]
    format_reasoning: Callable[[str], str] | None = None
    """The text a model of this family writes for a reasoning block (the sim backend and
    test vectors use it)."""


@dataclass(frozen=True, slots=True)
class ToolFactory:
    """A tool-call family as the registry holds it."""

    name: str
    bind: Callable[[TokenVocab], BoundTools]
    format_calls: Callable[[Sequence[ToolCallText]], str] | None = None
    """The text a model of this family writes for these calls (sim backend, test vectors)."""
    forced_prefix: Callable[[str | None], str] | None = None
    """Text that opens a call, appended to the prompt to force `tool_choice` (onehop
    has no guided decoding): a function name, or None for "required" with several
    tools (open up to the name). None when the family cannot be forced this way."""
    format_content: Callable[[str], str] | None = None
    """The text a model of this family writes for a plain answer (sim backend); None: the
    answer's text as is."""
