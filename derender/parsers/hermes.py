"""Hermes JSON tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (vLLM `hermes`).

States of one choice:

    CONTENT --<tool_call>--> CALL
    CALL    --</tool_call>-> CONTENT
    CALL    --<tool_call>--> CALL      (the previous call is closed first)

The call body streams through `ToolCallBody`, a JSON scanner that knows the
name once its string closes and passes the `arguments` text through as it
arrives. A call whose name never arrived is released as content: nothing the
model wrote is lost. With `parallel_tool_calls=false` only the first call is kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from derender.parsers.base import BoundTools, Markers, ParseOptions, ToolCallText, ToolDelta, ToolParser
from derender.parsers.content import ContentText
from derender.stop import Piece
from derender.toolcall import ToolCallBody
from derender.vocab import TokenVocab

START = "<tool_call>"
END = "</tool_call>"


class BoundHermes(BoundTools):
    def __init__(self, vocab: TokenVocab) -> None:
        self.markers = Markers(vocab, (START, END))
        self.starts = {self.markers.id(START): START}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return HermesParser(self.markers, options, strays=strays)


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """How Qwen3 writes calls: one `<tool_call>` block per call, JSON as `json.dumps` spaces it."""
    return "\n".join(
        f'{START}\n{{"name": {json.dumps(c.name, ensure_ascii=False)}, '
        f'"arguments": {json.dumps(dict(c.arguments), ensure_ascii=False)}}}\n{END}'
        for c in calls
    )


def forced_prefix(name: str | None) -> str:
    """Named: the call is opened up to its arguments, so the model writes only
    those; "required": up to the name. The JSON spacing is `json.dumps`'s, the
    one models are trained on and the sim backend continues."""
    if name is None:
        return f'{START}\n{{"name": "'
    return f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


class HermesParser(ToolParser):
    __slots__ = (
        "_call",
        "_call_index",
        "_call_raw",
        "_call_space",
        "_content",
        "_deltas",
        "_end",
        "_header_sent",
        "_options",
        "_start",
        "_stray",
        "calls",
    )

    def __init__(self, markers: Markers, options: ParseOptions, *, strays: Mapping[int, str]) -> None:
        self._start = markers.id(START)
        self._end = markers.id(END)
        self._stray = strays
        self._options = options
        self._content = ContentText()
        self._deltas: list[ToolDelta] = []
        self._call: ToolCallBody | None = None
        self._call_index = -1
        self._call_raw: list[str] = []
        self._call_space: list[str] = []  # whitespace held when the call began
        self._header_sent = False
        self.calls = 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        start, end, stray = self._start, self._end, self._stray
        for text, token_id in pieces:  # hot loop: one iteration per content token
            if token_id == start and text.endswith(START):
                self._text(text[: len(text) - len(START)])
                if self._call is not None:
                    self._end_call(closed=False)
                self._start_call()
            elif token_id == end and text.endswith(END) and self._call is not None:
                self._text(text[: len(text) - len(END)])
                self._call_raw.append(END)
                self._end_call(closed=True)
            elif token_id in stray and self._call is None and text.endswith(stray[token_id]):
                self._text(text[: len(text) - len(stray[token_id])])
            elif text:
                self._text(text)

    def finish(self) -> None:
        if self._call is not None:
            self._end_call(closed=False)
        self._content.finish(calls=self.calls)

    def drain(self) -> tuple[str, list[ToolDelta]]:
        deltas = self._deltas
        self._deltas = []
        return self._content.drain(), deltas

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._call is None:
            self._content.add(text)
        else:
            self._call_text(text)

    def _start_call(self) -> None:
        self._call_space = self._content.take_held()
        self._call = ToolCallBody()
        self._call_raw = [START]
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
            self._deltas.append(ToolDelta(index=self._call_index, arguments=arguments))

    def _send_header(self, name: str) -> None:
        self._header_sent = True
        if self.calls and not self._options.parallel_tool_calls:
            self._call_index = -1  # parallel_tool_calls=false keeps the first call only
            return
        self._call_index = self.calls
        self.calls += 1
        self._deltas.append(ToolDelta(index=self._call_index, id=self._options.new_id(), name=name))

    def _end_call(self, *, closed: bool) -> None:
        call = self._call
        assert call is not None
        self._call = None
        if not self._header_sent:
            # Never became a call: give the model's text back as content.
            raw = "".join(self._call_space + self._call_raw)
            self._call_raw = []
            self._content.add(raw)
            return
        self._call_raw = []
        if self._call_index >= 0 and not call.has_arguments and (closed or call.closed):
            self._deltas.append(ToolDelta(index=self._call_index, arguments="{}"))
