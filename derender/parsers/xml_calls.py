"""The held-text state machine shared by the XML-ish tool-call families (qwen3_coder, minimax_m2).

Both read a choice's content as text run through one handler per state, with
two marker tokens (a block's opening and closing) and everything else plain
text matched in place. A possible partial tag at the end of a text is held
(`_hold`) and re-read with the next text; a marker or the end of the output
reads it as final (`_final`). The states every such family has::

    CONTENT   plain content; a call may open bare (no block marker)
    PREAMBLE  inside a block, before its first call: framing
    NAME      the call's name, up to its `>`
    ARGS      parameters (`_in_value` while one is open)
    BETWEEN   inside a block, after a call: framing

A family numbers any further states after these. A block or bare call keeps
its text in `_raw` until a call is made (given back as content if none is).
What stays in each family module: its handlers (`_HANDLERS`, one per state
in state order), its tags, what ends a call at a marker (`_take_marker`,
`_close_call`), and how a value's text reaches `ArgsJson`. `BoundXmlCalls`
binds a family's parser class; `written_value` is its writers' value text.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from derender.parsers.base import BoundTools, Markers, ParseOptions, ToolDelta, ToolParser
from derender.parsers.content import ContentText
from derender.parsers.xml_args import ArgsJson
from derender.stop import Piece
from derender.vocab import TokenVocab

CONTENT, PREAMBLE, NAME, ARGS, BETWEEN = range(5)

Handler = Callable[[Any, str, int], int]
"""A state's handler: reads text from `pos`, returns where it stopped."""


def written_value(value: Any) -> str:
    """A parameter's value as the family writers put it: strings raw, other values as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class XmlCallParser(ToolParser):
    """One choice's tool parsing for an XML-ish family; subclasses give the grammar."""

    __slots__ = (
        "_after_bare",
        "_args",
        "_args_out",
        "_bare",
        "_content",
        "_deltas",
        "_end",
        "_final",
        "_hold",
        "_in_value",
        "_name",
        "_options",
        "_raw",
        "_start",
        "_state",
        "_stray",
        "calls",
    )

    _START: ClassVar[str]
    """The marker that opens a block."""
    _END: ClassVar[str]
    """The marker that closes a block."""
    _TRIM: ClassVar[bool]
    """`ArgsJson(trim=...)`: whether a value's leading and trailing newline are framing."""
    _HANDLERS: ClassVar[tuple[Handler, ...]]
    """One handler per state, indexed by the state number."""

    def __init__(self, markers: Markers, options: ParseOptions, *, strays: Mapping[int, str]) -> None:
        self._start = markers.id(self._START)
        self._end = markers.id(self._END)
        self._stray = strays
        self._options = options
        self._content = ContentText()
        self._deltas: list[ToolDelta] = []
        self._state = CONTENT
        self._hold = ""  # text that may still be a partial tag, re-read with the next text
        self._final = False  # the output ended: nothing is partial any more
        self._bare = False  # the call was opened without the block marker
        self._after_bare = False  # only whitespace since a bare call ended
        self._raw: list[str] | None = None  # the block's text while it has no call (given back if never one)
        self._name: list[str] = []
        self._in_value = False
        self._args: ArgsJson | None = None
        self._args_out: list[str] = []  # argument fragments of the last emitted call, not yet drained
        self.calls = 0

    # -- the ToolParser interface ----------------------------------------------

    def feed(self, pieces: Sequence[Piece]) -> None:
        start, end, stray = self._start, self._end, self._stray
        start_text, end_text = self._START, self._END
        for text, token_id in pieces:  # hot loop: one iteration per content token
            if token_id == start and text.endswith(start_text):
                self._on_marker(text[: len(text) - len(start_text)], start_text)
            elif token_id == end and text.endswith(end_text):
                self._on_marker(text[: len(text) - len(end_text)], end_text)
            elif token_id in stray and self._state == CONTENT and text.endswith(stray[token_id]):
                self._text(text[: len(text) - len(stray[token_id])])
                self._flush_hold()
            elif text:
                self._text(text)

    def finish(self) -> None:
        self._flush_hold()
        self._close_call()
        self._end_block()
        self._content.finish(calls=self.calls)

    def drain(self) -> tuple[str, list[ToolDelta]]:
        self._flush_args()
        deltas = self._deltas
        self._deltas = []
        return self._content.drain(), deltas

    # -- text and markers ----------------------------------------------------------

    def _text(self, text: str) -> None:
        if self._hold:
            text = self._hold + text
            self._hold = ""
        pos, end = 0, len(text)
        handlers = self._HANDLERS
        while pos < end and not self._hold:
            pos = handlers[self._state](self, text, pos)

    def _flush_hold(self) -> None:
        """Read the held text as final: a marker or the end cut any partial tag short."""
        if self._hold:
            self._final = True
            self._text("")
            self._final = False

    def _on_marker(self, head: str, marker: str) -> None:
        if self._state == ARGS and self._in_value:
            self._text(head + marker)  # inside a value a marker is text, as in vLLM
            return
        if head:
            self._text(head)
        self._flush_hold()
        self._take_marker(marker)

    def _give_back(self) -> None:
        raw = self._raw
        self._raw = None
        if raw:
            self._add_content("".join(raw))

    def _add_content(self, text: str) -> None:
        if text:
            self._content.add(text)
            if self._after_bare and not text.isspace():
                self._after_bare = False

    def _on_args(self, text: str, pos: int) -> int:
        """ARGS: inside a value, or between parameters."""
        return self._on_value(text, pos) if self._in_value else self._on_outside(text, pos)

    def _read_name(self, text: str, pos: int) -> int:
        """NAME: the name runs to the first `>`; where that `>` is, or -1 if not in `text`."""
        close = text.find(">", pos)
        if close < 0:
            self._record(text[pos:])
            self._name.append(text[pos:])
            return -1
        self._record(text[pos : close + 1])
        self._name.append(text[pos:close])
        return close

    # -- calls -----------------------------------------------------------------------

    def _begin_block(self) -> None:
        self._raw = [*self._content.take_held(), self._START]
        self._bare = False
        self._after_bare = False
        self._state = PREAMBLE

    def _send_header(self, name: str) -> None:
        self._raw = None  # a call after all: the held text was framing
        self._flush_args()
        if self.calls and not self._options.parallel_tool_calls:
            self._args = ArgsJson(None, [], trim=self._TRIM)  # parallel_tool_calls=false keeps the first call only
            return
        self.calls += 1
        self._deltas.append(ToolDelta(index=self.calls - 1, id=self._options.new_id(), name=name))
        schema = self._options.schema_of(name)
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        self._args = ArgsJson(properties if isinstance(properties, Mapping) else None, self._args_out, trim=self._TRIM)

    def _finish_args(self) -> None:
        """The call ends: close an open value (cut short) and the arguments JSON."""
        if self._in_value:
            self._close_value(complete=False)
        if self._args is not None:
            self._args.finish()
            self._args = None

    def _leave_call(self) -> None:
        """After a call: a bare one goes back to CONTENT (giving back a call that never got
        a name), a wrapped one to BETWEEN."""
        if self._bare:
            self._state = CONTENT
            self._give_back()
            self._after_bare = True
        else:
            self._state = BETWEEN

    def _end_block(self) -> None:
        self._state = CONTENT
        self._give_back()

    def _flush_args(self) -> None:
        out = self._args_out
        if out:
            self._deltas.append(ToolDelta(index=self.calls - 1, arguments="".join(out)))
            out.clear()

    # -- the family's grammar ----------------------------------------------------------

    @abstractmethod
    def _take_marker(self, marker: str) -> None:
        """A block marker outside a value, after the text before it was read as final."""

    @abstractmethod
    def _close_call(self) -> None:
        """End the call open in NAME or ARGS (a marker or the end of the output cut it)."""

    @abstractmethod
    def _on_value(self, text: str, pos: int) -> int:
        """ARGS in a value: its text, up to what ends it."""

    @abstractmethod
    def _on_outside(self, text: str, pos: int) -> int:
        """ARGS between parameters: wait for the next one or the end of the call."""

    @abstractmethod
    def _record(self, text: str) -> None:
        """Keep text of a block or call that may still be given back as content."""

    @abstractmethod
    def _close_value(self, *, complete: bool) -> None:
        """The open value ended; `complete` when its closing tag (or the next opening) came."""


class BoundXmlCalls(BoundTools):
    """An XML-ish family bound to one vocabulary: its two block markers, one parser per choice."""

    _parser: ClassVar[type[XmlCallParser]]

    def __init__(self, vocab: TokenVocab) -> None:
        start, end = self._parser._START, self._parser._END
        self.markers = Markers(vocab, (start, end))
        self.starts = {self.markers.id(start): start}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return self._parser(self.markers, options, strays=strays)
