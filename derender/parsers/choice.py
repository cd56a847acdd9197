"""One choice's parsing: the reasoning stage, then the tool-call stage, as one object.

`ParserSet` is a parser configuration bound to a vocabulary, built once per
(vocabulary, reasoning name, tool name) and cached on the vocabulary; each
choice gets a `ChoiceParser` from it. Every decision depends on the text order
only, never on how it was chunked, so any chunking yields the same joined
output (the master test).

A tool call left open is closed here, for every family alike: each call's
arguments stream through a `JsonCloser`, and one more arguments delta makes
what was streamed valid JSON, before the next call's header or at finish (an
output cut by `max_tokens`, a stop string or EOS inside a call; see `json_close`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from derender.parsers.base import (
    BoundReasoning,
    BoundTools,
    MissingMarker,
    ParseOptions,
    ReasoningParser,
    ToolDelta,
    ToolParser,
)
from derender.parsers.json_close import JsonCloser
from derender.parsers.registry import reasoning_factory, tool_factory
from derender.stop import Piece
from derender.vocab import TokenVocab

log = logging.getLogger(__name__)


class ChoiceParsing(Protocol):
    """What a chat choice drives: `ChoiceParser`, or an adapter over another engine's parser."""

    @property
    def reasoning_tokens(self) -> int: ...

    @property
    def calls(self) -> int: ...

    def feed(self, pieces: Sequence[Piece]) -> None: ...

    def finish(self) -> None: ...

    def drain(self) -> tuple[str, str, list[ToolDelta]]: ...


@runtime_checkable
class BoundParsers(Protocol):
    """What `bind_parsers` finds in `vocab.parsers`: `ParserSet`, or one a backend pre-bound
    there (the vllm backend's, for names only vLLM parses)."""

    @property
    def marker_ids(self) -> Mapping[str, int]: ...

    @property
    def atomic_ids(self) -> frozenset[int]: ...

    def new(self, options: ParseOptions, prompt_token_ids: Sequence[int], *, forced: bool) -> ChoiceParsing: ...


class ParserSet:
    """Reasoning and tool families bound to one vocabulary."""

    __slots__ = ("atomic_ids", "marker_ids", "reasoning", "tools")

    def __init__(self, reasoning: BoundReasoning | None, tools: BoundTools | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        marker_ids: dict[str, int] = {}
        for bound in (reasoning, tools):
            if bound is not None:
                marker_ids.update(bound.markers.by_text)
        self.marker_ids = marker_ids
        """Every marker's text → id: what the text route looks for in text."""
        self.atomic_ids = frozenset(marker_ids.values())
        """Ids whose text stop strings must never split from the id."""

    def new(self, options: ParseOptions, prompt_token_ids: Sequence[int], *, forced: bool) -> ChoiceParser:
        """A choice's parser. `forced`: the prompt ends inside a forced tool call (no reasoning)."""
        tools_on = options.tools_enabled and self.tools is not None
        strays = self.reasoning.strays if self.reasoning is not None else {}
        tools = self.tools.new(options, strays=strays) if tools_on and self.tools is not None else None
        reasoning: ReasoningParser | None = None
        if self.reasoning is not None:
            in_reasoning = not forced and self.reasoning.starts_in_reasoning(prompt_token_ids, options)
            starts: Mapping[int, str] = self.tools.starts if tools is not None and self.tools is not None else {}
            reasoning = self.reasoning.new(options, in_reasoning=in_reasoning, tool_starts=starts)
        return ChoiceParser(reasoning, tools, strays)


def bind_parsers(vocab: TokenVocab, reasoning: str | None, tools: str | None) -> BoundParsers | None:
    """The bound families for these names, or None when no parser is configured."""
    if reasoning is None and tools is None:
        return None
    key = (reasoning, tools)
    cached = vocab.parsers.get(key)
    if cached is None:
        cached = ParserSet(
            bind_reasoning(vocab, reasoning) if reasoning is not None else None,
            tool_factory(tools).bind(vocab) if tools is not None else None,
        )
        vocab.parsers[key] = cached
    assert isinstance(cached, BoundParsers)
    return cached


def bind_reasoning(vocab: TokenVocab, name: str) -> BoundReasoning | None:
    """The reasoning family bound to `vocab`, or None when the vocabulary lacks its markers.

    A model of the family's tokenizer that cannot reason (every Mistral before Magistral
    has no `[THINK]`) is served without reasoning, as vLLM serves it, never failing its
    requests (issue #27). Bound once per vocabulary, so the warning is logged once."""
    alone = vocab.parsers.get((name, None))
    if isinstance(alone, ParserSet):
        return alone.reasoning
    try:
        return reasoning_factory(name).bind(vocab)
    except MissingMarker as exc:
        log.warning("reasoning parser %r: %s; serving this model without reasoning", name, exc)
        if alone is None:
            vocab.parsers[(name, None)] = ParserSet(None, None)
        return None


def check_tool_markers(vocab: TokenVocab, name: str) -> None:
    """Raise `MissingMarker` when the tool family's markers are not single tokens of `vocab`.

    Called at start: unlike reasoning, a model cannot be served "without tools" behind a
    tool parser its vocabulary cannot speak, so the start fails naming the marker instead
    of every tool request failing later."""
    if vocab.parsers.get((None, name)) is None:
        vocab.parsers[(None, name)] = ParserSet(None, tool_factory(name).bind(vocab))


class ChoiceParser:
    """Reasoning + tool-call parsing of one choice. Feed pieces, drain deltas."""

    __slots__ = ("_closer", "_content_out", "_finished", "_index", "_reasoning", "_reasoning_out", "_strays", "_tools")

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, strays: Mapping[int, str]
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._strays = strays
        self._reasoning_out: list[str] = []
        self._content_out: list[str] = []
        self._index = -1  # the call whose arguments `_closer` follows (calls stream one after another)
        self._closer = JsonCloser()
        self._finished = False

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    @property
    def calls(self) -> int:
        return self._tools.calls if self._tools is not None else 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        if self._reasoning is not None:
            pieces = self._reasoning.feed(pieces, self._reasoning_out)
        if pieces:
            self._content(pieces)

    def finish(self) -> None:
        """The output ended: flush the reasoning stage into content, close an open call."""
        if self._reasoning is not None:
            rest = self._reasoning.finish(self._reasoning_out)
            if rest:
                self._content(rest)
        if self._tools is not None:
            self._tools.finish()
            self._finished = True

    def drain(self) -> tuple[str, str, list[ToolDelta]]:
        """(reasoning, content, tool deltas) produced since the last drain."""
        reasoning = "".join(self._reasoning_out) if self._reasoning_out else ""
        self._reasoning_out = []
        if self._tools is not None:
            content, deltas = self._tools.drain()
            if deltas or self._finished:
                deltas = self._closed(deltas)
            return reasoning, content, deltas
        content = "".join(self._content_out) if self._content_out else ""
        self._content_out = []
        return reasoning, content, []

    def _closed(self, deltas: list[ToolDelta]) -> list[ToolDelta]:
        """The deltas with the open call's arguments passed through its closer; the closing of a
        call goes out before the next call's header, or at finish."""
        out: list[ToolDelta] = []
        for delta in deltas:
            if delta.index != self._index:
                self._close_call(out)
                self._index, self._closer = delta.index, JsonCloser()
            if delta.arguments:
                delta.arguments = self._closer.feed(delta.arguments)
                if not delta.arguments and delta.name is None:
                    continue  # only a held comma
            out.append(delta)
        if self._finished:
            self._finished = False
            self._close_call(out)
        return out

    def _close_call(self, out: list[ToolDelta]) -> None:
        if self._index >= 0:
            tail = self._closer.close()
            if tail:
                out.append(ToolDelta(index=self._index, arguments=tail))
        self._index = -1

    def _content(self, pieces: Sequence[Piece]) -> None:
        if self._tools is not None:
            self._tools.feed(pieces)
            return
        strays, out = self._strays, self._content_out
        for text, token_id in pieces:
            marker = strays.get(token_id)
            if marker is not None and text.endswith(marker):
                text = text[: len(text) - len(marker)]
            if text:
                out.append(text)
