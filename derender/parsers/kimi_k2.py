"""Kimi K2 / K2.5: reasoning in `<think>` and tool calls in a section of marker tokens (vLLM `kimi_k2`).

The model writes::

    <think>reasoning</think>content<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
    ...<|tool_calls_section_end|>

Every marker is a special token in Kimi's tokenizer, so with the default
`skip_special_tokens` its piece arrives as `("", id)`: here a marker counts when
the piece's id is the marker's and its text is the marker's text *or empty*
(vLLM's parser turns `skip_special_tokens` off for the same reason). A piece that
kept only part of a marker's text (a stop string cut it) is plain text. Other
special tokens (`<|im_end|>`, `[EOS]`, ...) never reach any text, as vLLM's
parser drops them.

Reasoning, one choice (`KimiReasoning`)::

    REASONING --</think>------------------> DONE  (dropped)
    REASONING --<|tool_calls_section_begin|>-> DONE  (implicit end; the marker goes on)
    REASONING --<think>-------------------> REASONING (absorbed)
    DONE: content; with tools off, markers keep the text `skip_special_tokens` left them.

Reasoning never ends in trailing whitespace (vLLM strips it, streamed or not):
the trailing whitespace run is held and dropped when reasoning ends. Whether a
choice starts in REASONING: not when thinking is off (vLLM's rule: on unless
`chat_template_kwargs` has `thinking` or `enable_thinking` and neither is true);
else from the prompt, scanned back to the turn's `<|im_assistant|>`: a trailing
`</think>` (K2.5 renders `<think></think>` with thinking off) means content,
anything else reasoning (a model that writes `<think>` itself has it absorbed).
vLLM's stream scans the whole prompt instead, so an earlier turn's `</think>`
flips it to content; its non-streamed answer, which onehop gives, does not look
at the prompt.

Tool calls, one choice (`KimiToolParser`)::

    CONTENT --section_begin--> SECTION
    SECTION --call_begin-----> NAME      (text between calls: whitespace dropped, else content)
    SECTION --section_end----> SECTION   (calls may still follow, as in vLLM)
    NAME    --argument_begin-> ARGS      (header `[functions.]NAME:IDX` checked here)
    NAME    --call_end | section_end --> SECTION  (a call without arguments: `{}`)
    ARGS    --call_end | section_end --> SECTION
    NAME | ARGS --call_begin--> NAME     (the open call is closed first)
    RAW: a call whose header is not `NAME:IDX`, released as content up to its call_end.

The tool-call id is the model's header verbatim (`functions.get_weather:0`), as
vLLM gives it; the name is the header up to its first `:` without `functions.`.
Arguments stream through `ArgumentsText`, which retypes values by the tool's
schema the way vLLM's non-streamed answer does. vLLM behaviours not followed,
each because vLLM loses text or writes invalid JSON (see the parity tests):
text after or between calls is content, not dropped; a call opened inside
another call's arguments closes it; a call without arguments is `{}` in the
stream too; a call whose header is cut or malformed is content, not a call
named from the cut header. Markers that open nothing in a state (a stray
`<|tool_call_end|>` in content, `<|tool_calls_section_begin|>` inside
arguments) are that state's text, as in vLLM; between calls they are dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from derender.parsers.base import (
    BoundReasoning,
    BoundTools,
    Markers,
    ParseOptions,
    ReasoningParser,
    ToolCallText,
    ToolDelta,
    ToolParser,
)
from derender.parsers.marker_tokens import (
    CONTENT,
    DROP,
    FIRST_KIND,
    TEXT,
    Kinds,
    MarkerToolParser,
    add_held,
    add_specials,
    optional_id,
    split_marker,
    with_kinds,
)
from derender.stop import Piece
from derender.vocab import TokenVocab

THINK_START = "<think>"
THINK_END = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
TURN_START = "<|im_assistant|>"
TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

_HEADER = re.compile(r"(.+:\d+)")

# Marker kinds, shared by both machines' id tables (DROP and TEXT: marker_tokens).
(
    _THINK_START,
    _THINK_END,
    _SECTION_BEGIN,
    _SECTION_END,
    _CALL_BEGIN,
    _ARGUMENT_BEGIN,
    _CALL_END,
) = range(FIRST_KIND, FIRST_KIND + 7)
_TOOL_KINDS = {
    SECTION_BEGIN: _SECTION_BEGIN,
    SECTION_END: _SECTION_END,
    CALL_BEGIN: _CALL_BEGIN,
    ARGUMENT_BEGIN: _ARGUMENT_BEGIN,
    CALL_END: _CALL_END,
}


# -- reasoning ------------------------------------------------------------------


class BoundKimiReasoning(BoundReasoning):
    def __init__(self, vocab: TokenVocab) -> None:
        section = optional_id(vocab, SECTION_BEGIN)
        self.markers = Markers(vocab, (THINK_START, THINK_END) + ((SECTION_BEGIN,) if section >= 0 else ()))
        self._start = self.markers.id(THINK_START)
        self._end = self.markers.id(THINK_END)
        self._turn = optional_id(vocab, TURN_START)
        self.strays = {self._end: THINK_END}
        kinds: dict[int, tuple[int, str]] = {
            self._start: (_THINK_START, THINK_START),
            self._end: (_THINK_END, THINK_END),
        }
        for text in TOOL_MARKERS:
            token_id = optional_id(vocab, text)
            if token_id >= 0:
                kinds[token_id] = (_SECTION_BEGIN if text == SECTION_BEGIN else TEXT, text)
        add_specials(vocab, kinds)
        self.kinds: Kinds = kinds
        self._extra: dict[tuple[tuple[int, str], ...], Kinds] = {}

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int], options: ParseOptions) -> bool:
        if not thinking_enabled(options):
            return False
        for token_id in reversed(prompt_token_ids):
            if token_id == self._end:
                return False
            if token_id == self._start:
                return True
            if token_id == self._turn:
                break
        return True

    def new(self, options: ParseOptions, *, in_reasoning: bool, tool_starts: Mapping[int, str]) -> ReasoningParser:
        kinds = with_kinds(self.kinds, self._extra, tool_starts, _SECTION_BEGIN)
        return KimiReasoning(kinds, in_reasoning=in_reasoning, tools_on=bool(tool_starts))


class KimiReasoning(ReasoningParser):
    __slots__ = ("_done", "_kinds", "_space", "_tools_on", "reasoning_tokens")

    def __init__(self, kinds: Kinds, *, in_reasoning: bool, tools_on: bool) -> None:
        self._kinds = kinds
        self._done = not in_reasoning
        self._tools_on = tools_on
        self._space: list[str] = []  # trailing whitespace of the reasoning so far
        self.reasoning_tokens = 0

    def feed(self, pieces: Sequence[Piece], reasoning: list[str]) -> Sequence[Piece]:
        if self._done:
            return pieces if self._tools_on else self._content(pieces)
        kinds = self._kinds
        for i, (text, token_id) in enumerate(pieces):  # hot loop while reasoning
            kind = kinds.get(token_id)
            head = None if kind is None else split_marker(text, kind[1])
            if kind is None or head is None:
                if text:
                    add_held(text, reasoning, self._space)
                if token_id >= 0:
                    self.reasoning_tokens += 1
                continue
            if head:
                add_held(head, reasoning, self._space)
            if kind[0] == TEXT:
                add_held(kind[1], reasoning, self._space)
            if kind[0] not in (_THINK_END, _SECTION_BEGIN):
                continue
            self._done = True
            self._space.clear()
            rest: list[Piece] = list(pieces[i + 1 :])
            if kind[0] == _SECTION_BEGIN:
                rest.insert(0, (kind[1] if text else "", token_id))
            return rest if self._tools_on else self._content(rest)
        return ()

    def finish(self, reasoning: list[str]) -> Sequence[Piece]:
        self._space.clear()
        return ()

    def _content(self, pieces: Sequence[Piece]) -> list[Piece]:
        """Content when no tool parser follows: the tool markers are special tokens like any
        other, their text what `skip_special_tokens` left (vLLM shows none by default: its
        parser turns skipping off only when it parses calls); other special tokens are dropped."""
        out: list[Piece] = []
        kinds = self._kinds
        for piece in pieces:  # hot loop for content while tools are off
            kind = kinds.get(piece[1])
            head = None if kind is None or kind[0] != DROP else split_marker(piece[0], kind[1])
            if head is None:
                out.append(piece)
            elif head:
                out.append((head, -1))
        return out


def thinking_enabled(options: ParseOptions) -> bool:
    """vLLM's Kimi rule: thinking is on unless `thinking` or `enable_thinking` is given
    and neither is true (K2.5's templates take `thinking`, others `enable_thinking`)."""
    kwargs = options.chat_template_kwargs
    thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
    if thinking is None and enable is None:
        return options.enable_thinking
    return bool(thinking) or bool(enable)


def format_reasoning(text: str) -> str:
    """A reasoning block as Kimi K2 writes it: the markers hug the text."""
    return f"{THINK_START}{text}{THINK_END}"


# -- tool calls -----------------------------------------------------------------

_SECTION, _NAME, _ARGS, _RAW = range(1, 5)  # after CONTENT (marker_tokens)


class BoundKimiTools(BoundTools):
    def __init__(self, vocab: TokenVocab) -> None:
        self.markers = Markers(vocab, TOOL_MARKERS)
        self.starts = {self.markers.id(SECTION_BEGIN): SECTION_BEGIN}
        kinds: dict[int, tuple[int, str]] = {self.markers.id(text): (kind, text) for text, kind in _TOOL_KINDS.items()}
        for text in (THINK_START, THINK_END):
            token_id = optional_id(vocab, text)
            if token_id >= 0:
                kinds[token_id] = (TEXT, text)
        add_specials(vocab, kinds)
        self.kinds: Kinds = kinds
        self._extra: dict[tuple[tuple[int, str], ...], Kinds] = {}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return KimiToolParser(with_kinds(self.kinds, self._extra, strays, _THINK_END), options)


def call_header(header: str) -> tuple[str, str] | None:
    """(id, name) from a call header `functions.get_weather:0`, or None when it has no `NAME:IDX`."""
    match = _HEADER.match(header.strip())
    if match is None:
        return None
    call_id = match.group(1).strip()
    name = call_id.split(":", 1)[0].removeprefix("functions.")
    return (call_id, name) if name else None


class KimiToolParser(MarkerToolParser):
    __slots__ = ("_gap", "_header")

    def __init__(self, kinds: Kinds, options: ParseOptions) -> None:
        super().__init__(kinds, options)
        self._header: list[str] = []
        self._gap: list[str] = []  # trailing whitespace between calls
        # `_space` holds the whitespace before the section, dropped once a call is made.

    def finish(self) -> None:
        state = self._state
        if state == _NAME:
            self._close_header("", ends_call=True)
        elif state == _ARGS:
            self._close_call()
        self._gap.clear()
        if self._space and not self.calls:
            self._content.add("".join(self._space))
        self._content.finish(calls=self.calls)

    # -- dispatch -----------------------------------------------------------

    def _text(self, text: str) -> None:
        state = self._state
        if state == _ARGS:
            self._args_text(text)
        elif state == _NAME:
            self._header.append(text)
        elif state == _SECTION:
            self._gap_text(text)
        else:
            self._content.add(text)

    def _marker(self, kind: int, text: str) -> None:
        state = self._state
        if state == CONTENT:
            if kind == _SECTION_BEGIN:
                self._space = self._content.take_held()
                self._state = _SECTION
            elif kind != _THINK_END:
                self._content.add(text)
        elif state == _SECTION:
            self._gap.clear()
            if kind == _CALL_BEGIN:
                self._open_call()
        elif state == _NAME:
            if kind == _ARGUMENT_BEGIN:
                self._close_header(text, ends_call=False)
            elif kind in (_CALL_BEGIN, _CALL_END, _SECTION_END):
                self._close_header(text if kind == _CALL_END else "", ends_call=True)
                if kind == _CALL_BEGIN:
                    self._open_call()
            else:
                self._header.append(text)
        elif kind in (_CALL_BEGIN, _CALL_END, _SECTION_END):
            if state == _ARGS:
                self._close_call()
            elif kind == _CALL_END:
                self._raw(text)
            self._state = _SECTION
            if kind == _CALL_BEGIN:
                self._open_call()
        else:
            self._text(text)

    # -- calls --------------------------------------------------------------

    def _open_call(self) -> None:
        self._state = _NAME
        self._header = []

    def _close_header(self, marker: str, *, ends_call: bool) -> None:
        """The header ended at `marker` (its text, "" for one that is not the model's
        own); `ends_call`: no arguments follow."""
        header = "".join(self._header)
        self._header = []
        parsed = call_header(header)
        if parsed is None:
            # Not a call: the model's text goes back as content, up to its call_end.
            self._raw(CALL_BEGIN + header + marker)
            self._state = _SECTION if ends_call else _RAW
            return
        self._send_header(*parsed)
        self._state = _ARGS
        if ends_call:
            self._close_call()

    def _send_header(self, call_id: str, name: str) -> None:
        self._space = []
        if self._open_args(name):
            self._deltas.append(ToolDelta(index=self._index, id=call_id, name=name))

    def _args_text(self, text: str) -> None:
        args = self._args
        assert args is not None
        args.feed(text)
        self._emit_args()

    def _close_call(self) -> None:
        self._finish_args()
        self._state = _SECTION

    # -- content inside the section ---------------------------------------------

    def _raw(self, text: str) -> None:
        if self._space:
            text = "".join(self._space) + text
            self._space = []
        self._content.add(text)

    def _gap_text(self, text: str) -> None:
        """Text between calls or after the section: trailing whitespace is layout (held,
        dropped at the next marker or the end), the rest is content."""
        body = text.rstrip()
        if not body:
            self._gap.append(text)
            return
        held = "".join(self._gap)
        self._gap.clear()
        if len(body) < len(text):
            self._gap.append(text[len(body) :])
        self._raw(held + body)


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """How Kimi K2 writes calls: one section, ids numbered from 0, JSON as `json.dumps` spaces it."""
    body = "".join(
        f"{CALL_BEGIN}functions.{c.name}:{i}{ARGUMENT_BEGIN}"
        f"{json.dumps(dict(c.arguments), ensure_ascii=False)}{CALL_END}"
        for i, c in enumerate(calls)
    )
    return f"{SECTION_BEGIN}{body}{SECTION_END}"


def forced_prefix(name: str | None) -> str:
    """Named: the call is opened up to its arguments (id index 0, as a first call of the
    turn); "required": up to the name, after the `functions.` every header starts with."""
    if name is None:
        return f"{SECTION_BEGIN}{CALL_BEGIN}functions."
    return f"{SECTION_BEGIN}{CALL_BEGIN}functions.{name}:0{ARGUMENT_BEGIN}"
