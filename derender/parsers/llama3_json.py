"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` (vLLM `llama3_json`, alias `llama4_json`).

The model answers a tool turn with bare JSON objects, `parameters` or
`arguments` holding the arguments, optionally after the special token
`<|python_tag|>`, several calls joined by `; `::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

There is no marker around a call, so whether the output is a call is read from
its start, as vLLM does: the output is a call list only when it opens (after
whitespace and `<|python_tag|>`) with a JSON object that names a function and
has arguments. Output that starts with anything else is content to its end.

States of one choice:

    LEAD    --`{`--------------> CALL     (whitespace and the tag before it are dropped)
    LEAD    --other text-------> CONTENT  (the held lead is content)
    CALL    --object closes----> AFTER    (a call), or
                                 CONTENT / AFTER (no call: the object is content)
    AFTER   --`{`--------------> CALL     (`;`, whitespace, tags before it are dropped)
    AFTER   --other text-------> AFTER    (content)

A candidate object streams through `ToolCallBody`; its header goes out once the
name is known *and* its arguments have begun, which is when vLLM's non-streamed
answer would call it a call; until then its text is held, and an object that
closes without both is released as content. After that, arguments stream as the
model writes them (vLLM re-serialises them with `json.dumps`, the same JSON);
they are not retyped by the schema, as vLLM's parser does not retype them.

vLLM behaviours not followed, each because vLLM loses text, a call, or writes
invalid JSON (see the parity tests): its stream treats output as calls only when
the text starts with `{` or the tag's text, with no whitespace before it, and
drops every call after the first that is not separated by exactly two
characters; its non-streamed answer takes a call from anywhere in the text and
drops the text around it. Here a call list may open after whitespace, text
before the first object makes the whole output content (vLLM's stream), text
after or between calls is content, and every object after the first call that
is a call is one. A cut or invalid call stays a best-effort call once its header
went out (the stream cannot take it back); vLLM's full answer turns the whole
output into content then.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from derender.parsers.base import (
    BoundTools,
    Markers,
    ParseOptions,
    ToolCallText,
    ToolDelta,
    ToolFactory,
    ToolParser,
)
from derender.stop import Piece
from derender.toolcall import ToolCallBody
from derender.vocab import TokenVocab

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "

# The run a call may be followed by before the next one: whitespace and `;`.
_TRAILING_SEPARATOR = re.compile(r"[\s;]*\Z")

# States of one choice.
_LEAD, _CALL, _AFTER, _CONTENT = range(4)


class BoundLlama3(BoundTools):
    def __init__(self, vocab: TokenVocab) -> None:
        self.markers = Markers(vocab, (PYTHON_TAG,))
        self.starts = {self.markers.id(PYTHON_TAG): PYTHON_TAG}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return Llama3JsonParser(self.markers.id(PYTHON_TAG), options, strays=strays)


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """How Llama 3.x writes calls: one JSON object each, `parameters` holding the arguments, `; ` between."""
    return SEPARATOR.join(
        json.dumps({"name": c.name, "parameters": dict(c.arguments)}, ensure_ascii=False) for c in calls
    )


def forced_prefix(name: str | None) -> str:
    """Named: the call is opened up to its arguments; "required": up to the name. The
    spacing is `json.dumps`'s, as `format_calls` writes it."""
    if name is None:
        return '{"name": "'
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '


FACTORY = ToolFactory("llama3_json", BoundLlama3, format_calls, forced_prefix)


class Llama3JsonParser(ToolParser):
    __slots__ = (
        "_call",
        "_call_index",
        "_call_raw",
        "_deltas",
        "_header_sent",
        "_held",
        "_options",
        "_out",
        "_state",
        "_stray",
        "_tag",
        "calls",
    )

    def __init__(self, tag: int, options: ParseOptions, *, strays: Mapping[int, str]) -> None:
        self._tag = tag
        self._stray = strays
        self._options = options
        self._state = _LEAD
        self._out: list[str] = []  # content to drain
        self._held: list[str] = []  # the lead (LEAD) or the separator run after a call (AFTER)
        self._deltas: list[ToolDelta] = []
        self._call: ToolCallBody | None = None
        self._call_raw: list[str] = []  # the candidate's text (and the run before it) until it is a call
        self._call_index = -1
        self._header_sent = False
        self.calls = 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        tag, stray = self._tag, self._stray
        for text, token_id in pieces:  # hot loop: one iteration per content token
            if token_id == tag and (not text or text.endswith(PYTHON_TAG)):
                self._text(text[: len(text) - len(PYTHON_TAG)])
                self._on_tag(text[len(text) - len(PYTHON_TAG) :])
            elif token_id in stray and self._state != _CALL and text.endswith(stray[token_id]):
                self._text(text[: len(text) - len(stray[token_id])])
            elif text:
                self._text(text)

    def finish(self) -> None:
        if self._state == _CALL:
            self._end_call()
        if self._state == _LEAD:
            self._out.extend(self._held)  # whitespace-only output is the model's content
        self._held = []

    def drain(self) -> tuple[str, list[ToolDelta]]:
        deltas = self._deltas
        self._deltas = []
        if not self._out:
            return "", deltas
        content = "".join(self._out)
        self._out = []
        return content, deltas

    # -- text by state ------------------------------------------------------

    def _on_tag(self, text: str) -> None:
        """The tag opens nothing by itself: in LEAD and AFTER it is part of the run before a
        call; inside an object or in content it is text (empty when special tokens are skipped)."""
        if self._state in (_LEAD, _AFTER):
            self._held.append(text)
        elif text:
            self._text(text)

    def _text(self, text: str) -> None:
        while text:
            state = self._state
            if state == _CONTENT:
                self._out.append(text)
                return
            if state == _CALL:
                text = self._call_text(text)
            elif state == _LEAD:
                text = self._lead_text(text)
            else:
                text = self._after_text(text)

    def _lead_text(self, text: str) -> str:
        body = text.lstrip()
        if not body:
            self._held.append(text)
            return ""
        if body[0] != "{":
            # Output that does not open with an object is content, as in vLLM's stream.
            self._held.append(text)
            self._release_held()
            self._state = _CONTENT
            return ""
        self._held.append(text[: len(text) - len(body)])
        self._open_call()
        return body

    def _after_text(self, text: str) -> str:
        brace = text.find("{")
        gap = text if brace < 0 else text[:brace]
        if gap:
            self._gap(gap)
        if brace < 0:
            return ""
        self._open_call()
        return text[brace:]

    def _gap(self, text: str) -> None:
        """Text after a call: content, except a trailing `;` / whitespace run, held until
        it is known whether a call follows it (dropped) or more text (content)."""
        run = _TRAILING_SEPARATOR.search(text)
        assert run is not None
        if run.start() == 0:
            self._held.append(text)
            return
        self._release_held()
        self._out.append(text[: run.start()])
        if run.start() < len(text):
            self._held.append(text[run.start() :])

    def _release_held(self) -> None:
        if self._held:
            self._out.extend(self._held)
            self._held = []

    # -- one candidate object -----------------------------------------------

    def _open_call(self) -> None:
        self._state = _CALL
        self._call = ToolCallBody()
        self._call_raw = self._held  # given back with the object if it is no call
        self._held = []
        self._header_sent = False

    def _call_text(self, text: str) -> str:
        """Feed the open object; return the text after it when it closed in `text`."""
        call = self._call
        assert call is not None
        taken = call.feed(text)
        if not self._header_sent:
            self._call_raw.append(text[:taken])
            if call.name is None or not call.has_arguments:
                if call.closed:
                    self._end_call()
                return text[taken:]
            self._send_header(call.name)
        arguments = call.take_arguments()
        if arguments and self._call_index >= 0:
            self._deltas.append(ToolDelta(index=self._call_index, arguments=arguments))
        if call.closed:
            self._end_call()
        return text[taken:]

    def _send_header(self, name: str) -> None:
        self._header_sent = True
        self._call_raw = []
        if self.calls and not self._options.parallel_tool_calls:
            self._call_index = -1  # parallel_tool_calls=false keeps the first call only
            return
        self._call_index = self.calls
        self.calls += 1
        self._deltas.append(ToolDelta(index=self._call_index, id=self._options.new_id(), name=name))

    def _end_call(self) -> None:
        """The object closed, or the output ended inside it."""
        self._call = None
        if self._header_sent:
            self._state = _AFTER
            return
        # Never became a call: give the model's text back as content.
        self._out.extend(self._call_raw)
        self._call_raw = []
        self._state = _AFTER if self.calls else _CONTENT
