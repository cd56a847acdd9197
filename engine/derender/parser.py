"""Reasoning and tool-call parsing of one choice, as a single state machine.

Input is the stream of pieces `(text, token_id)` left after stop strings.
Markers (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`) are recognised
by token id, and only while the piece's text still ends with the marker's
text — a stop string that cut into a marker turns it back into plain text.

States and transitions (a marker not listed for a state is plain text):

    REASONING --</think>----> CONTENT          (<think> is absorbed)
    REASONING --<tool_call>-> TOOL             (implicit end of reasoning)
    CONTENT   --<tool_call>-> TOOL             (a duplicate </think> is dropped)
    TOOL      --</tool_call>> CONTENT
    TOOL      --<tool_call>-> TOOL             (previous call closed first)

Tool markers count only when the request offered tools (DERENDER_CASES 11).
Whitespace-only content before the first tool call, or between and after
calls, is held and then dropped, so streamed and non-streamed output agree
(both give `content: null` before a call). A call whose name never arrived is
released as content text: nothing the model wrote is lost.

Every decision depends on the text order only, never on how it was chunked,
so any chunking yields the same joined output (the master test).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from engine.derender.stop import Piece
from engine.derender.toolcall import ToolCallBody
from engine.derender.vocab import TokenVocab


@dataclass(frozen=True, slots=True)
class ReasoningSyntax:
    start: str
    end: str
    turn_start: str
    """Token that opens a chat turn; the prompt is scanned back to it for markers."""


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    start: str
    end: str

    def forced_prefix(self, name: str | None) -> str:
        """Text that opens a call, appended to the prompt to force `tool_choice`.

        Named: the call is opened up to its arguments, so the model writes only
        those; "required": up to the name. The JSON spacing is `json.dumps`'s,
        the one models are trained on and the sim backend continues.
        """
        if name is None:
            return f'{self.start}\n{{"name": "'
        return f'{self.start}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


REASONING_PARSERS: dict[str, ReasoningSyntax] = {
    "qwen3": ReasoningSyntax(start="<think>", end="</think>", turn_start="<|im_start|>"),
}
TOOL_PARSERS: dict[str, ToolSyntax] = {
    "hermes": ToolSyntax(start="<tool_call>", end="</tool_call>"),
}


class UnknownParser(ValueError):
    pass


class State(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL = "tool"


class Marker(Enum):
    THINK_START = 0
    THINK_END = 1
    TOOL_START = 2
    TOOL_END = 3


@dataclass(slots=True)
class ToolDelta:
    """One OpenAI `tool_calls` delta entry: a header (id, name) or an argument fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class MarkerIds:
    """Token ids of one parser configuration's markers in a given vocabulary."""

    by_id: dict[int, tuple[Marker, str]]
    think_start: int
    think_end: int
    tool_start: int
    turn_start: int

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(self.by_id)


def resolve_markers(vocab: TokenVocab, reasoning: ReasoningSyntax | None, tools: ToolSyntax | None) -> MarkerIds:
    """Look the markers up in the vocabulary; each must be a single token."""
    by_id: dict[int, tuple[Marker, str]] = {}
    wanted: list[tuple[Marker, str]] = []
    if reasoning is not None:
        wanted += [(Marker.THINK_START, reasoning.start), (Marker.THINK_END, reasoning.end)]
    if tools is not None:
        wanted += [(Marker.TOOL_START, tools.start), (Marker.TOOL_END, tools.end)]
    for marker, text in wanted:
        token_id = vocab.token_id(text)
        if token_id is None:
            raise UnknownParser(f"marker {text!r} is not a single token in this tokenizer")
        by_id[token_id] = (marker, text)
    ids = {marker: tid for tid, (marker, _) in by_id.items()}
    turn = vocab.token_id(reasoning.turn_start) if reasoning is not None else None
    return MarkerIds(
        by_id=by_id,
        think_start=ids.get(Marker.THINK_START, -1),
        think_end=ids.get(Marker.THINK_END, -1),
        tool_start=ids.get(Marker.TOOL_START, -1),
        turn_start=-1 if turn is None else turn,
    )


def starts_in_reasoning(prompt_token_ids: Sequence[int], markers: MarkerIds, *, enable_thinking: bool) -> bool:
    """Initial state from the rendered prompt (DERENDER_CASES 12).

    The generation turn is scanned back to its opening token: a trailing
    `</think>` (as `enable_thinking=false` renders) means the answer starts as
    content, a trailing `<think>` (a template that pre-opens it) means
    reasoning. With neither, reasoning is on unless thinking was disabled —
    Qwen3 opens `<think>` itself and that marker is absorbed.
    """
    for token_id in reversed(prompt_token_ids):
        if token_id == markers.think_end:
            return False
        if token_id == markers.think_start:
            return True
        if token_id == markers.turn_start:
            break
    return enable_thinking


class OutputParser:
    """Reasoning + tool-call parser of one choice. Feed pieces, drain deltas."""

    __slots__ = (
        "_markers",
        "_tools_on",
        "_parallel",
        "_new_id",
        "state",
        "_reasoning",
        "_content",
        "_tool_deltas",
        "_held_space",
        "_content_started",
        "_call",
        "_call_index",
        "_call_raw",
        "_call_space",
        "_header_sent",
        "calls",
    )

    def __init__(
        self,
        markers: MarkerIds,
        *,
        reasoning: bool,
        tools: bool,
        parallel_tool_calls: bool = True,
        new_id: Callable[[], str] = new_tool_call_id,
    ) -> None:
        by_id = markers.by_id
        if not tools:
            by_id = {tid: m for tid, m in by_id.items() if m[0] not in (Marker.TOOL_START, Marker.TOOL_END)}
        self._markers = by_id
        self._tools_on = tools
        self._parallel = parallel_tool_calls
        self._new_id = new_id
        self.state = State.REASONING if reasoning else State.CONTENT
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_deltas: list[ToolDelta] = []
        self._held_space: list[str] = []
        self._content_started = False
        self._call: ToolCallBody | None = None
        self._call_index = -1
        self._call_raw: list[str] = []
        self._call_space: list[str] = []  # whitespace dropped when the call began
        self._header_sent = False
        self.calls = 0
        """Tool calls emitted so far (a header was sent)."""

    # -- input --------------------------------------------------------------

    def feed(self, pieces: Sequence[Piece]) -> None:
        markers = self._markers
        for text, token_id in pieces:  # hot loop: one iteration per token
            marker = markers.get(token_id)
            if marker is None or not text.endswith(marker[1]):
                if text:
                    self._text(text)
                continue
            head = text[: len(text) - len(marker[1])]
            if head:
                self._text(head)
            self._marker(marker[0], marker[1])

    def finish(self) -> None:
        """The output ended: close an open call and settle held whitespace."""
        if self.state is State.TOOL:
            self._end_call(closed=False)
            self.state = State.CONTENT
        if self._held_space and not self.calls:
            self._content.extend(self._held_space)
        self._held_space.clear()

    # -- output -------------------------------------------------------------

    def drain(self) -> tuple[str, str, list[ToolDelta]]:
        """(reasoning, content, tool deltas) produced since the last drain."""
        reasoning = "".join(self._reasoning) if self._reasoning else ""
        content = "".join(self._content) if self._content else ""
        deltas = self._tool_deltas
        self._reasoning = []
        self._content = []
        self._tool_deltas = []
        return reasoning, content, deltas

    # -- transitions --------------------------------------------------------

    def _text(self, text: str) -> None:
        state = self.state
        if state is State.REASONING:
            self._reasoning.append(text)
        elif state is State.CONTENT:
            self._content_text(text)
        else:
            self._call_text(text)

    def _marker(self, marker: Marker, text: str) -> None:
        state = self.state
        if marker is Marker.THINK_START:
            if state is not State.REASONING:
                self._text(text)
        elif marker is Marker.THINK_END:
            if state is State.REASONING:
                self.state = State.CONTENT
            elif state is State.TOOL:
                self._text(text)
        elif marker is Marker.TOOL_START:
            if state is State.TOOL:
                self._end_call(closed=False)
            self._start_call(text)
        elif state is State.TOOL:
            self._call_raw.append(text)
            self._end_call(closed=True)
            self.state = State.CONTENT
        else:
            self._text(text)

    def _content_text(self, text: str) -> None:
        if not self._tools_on or (self._content_started and not self.calls):
            self._content.append(text)
            return
        # Holding whitespace: before any content (it is dropped if a call comes
        # first) and after a call (dropped unless more text follows). Only the
        # trailing run is held, so the result does not depend on how the text
        # was split into pieces.
        body = text.rstrip()
        if not body:
            self._held_space.append(text)
            return
        if self._held_space:
            self._content.extend(self._held_space)
            self._held_space.clear()
        if self.calls:
            self._content.append(body)
            if len(body) < len(text):
                self._held_space.append(text[len(body) :])
        else:
            self._content.append(text)
        self._content_started = True

    def _start_call(self, marker_text: str) -> None:
        self.state = State.TOOL
        self._call_space = self._held_space
        self._held_space = []
        self._call = ToolCallBody()
        self._call_raw = [marker_text]
        self._header_sent = False

    def _call_text(self, text: str) -> None:
        call = self._call
        assert call is not None
        self._call_raw.append(text)
        call.feed(text)
        if not self._header_sent:
            if call.name is None:
                return
            self._send_header(call.name)
        arguments = call.take_arguments()
        if arguments and self._call_index >= 0:
            self._tool_deltas.append(ToolDelta(index=self._call_index, arguments=arguments))

    def _send_header(self, name: str) -> None:
        self._header_sent = True
        if self.calls and not self._parallel:
            self._call_index = -1  # parallel_tool_calls=false keeps the first call only
            return
        self._call_index = self.calls
        self.calls += 1
        self._tool_deltas.append(ToolDelta(index=self._call_index, id=self._new_id(), name=name))

    def _end_call(self, *, closed: bool) -> None:
        call = self._call
        assert call is not None
        self._call = None
        if not self._header_sent:
            # Never became a call: give the model's text back as content.
            self.state = State.CONTENT
            raw = "".join(self._call_space + self._call_raw)
            self._call_raw = []
            self._content_text(raw)
            return
        self._call_raw = []
        if self._call_index >= 0 and not call.has_arguments and (closed or call.closed):
            self._tool_deltas.append(ToolDelta(index=self._call_index, arguments="{}"))
