"""GLM-4.5 / 4.6 / 4.7 / 5.x: `<think>` reasoning and XML-ish tool calls (vLLM `glm45`, `glm47`).

Both vLLM names run one grammar (`vllm/parser/glm47_moe.py`). GLM-4.5/4.6
write a call with newlines, GLM-4.7+ without; the parser reads both::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>

`<think>`, `</think>`, `<tool_call>` and `</tool_call>` count by token id +
text (a marker split into plain tokens is text, as in vLLM's stream). The arg
tags are matched in the text, as vLLM does, holding back only a possible
partial tag (`"</arg_val"`) until the next piece or the finish.

Reasoning, one choice (`GlmReasoning`):

    REASONING --</think>------> CONTENT   (the marker is dropped)
    REASONING --<think>-------> REASONING (absorbed)
    REASONING --<tool_call>---> CONTENT   (implicit end; the marker goes on to the tools)
    CONTENT   --<think>-------> REASONING (outside a call: GLM may think again)
    PLAIN: `enable_thinking=false`; no reasoning, `<think>`/`</think>` are text.

The choice starts in REASONING unless thinking is off or the prompt's last
turn (scanned back to a role token) ends in `</think>` (GLM-4.7's template
pre-opens `<think>`; GLM-4.5 leaves it to the model). Trailing whitespace of
the reasoning is held: it goes out if GLM thinks again, and is dropped at the
end (vLLM's full answer strips the joined reasoning).

Tool calls, one choice (`GlmToolParser`), the tag each state looks for:

    CONTENT --<tool_call>--> NAME
    NAME    --<arg_key>----> KEY      (header: the name, stripped; unknown → RAW)
    KEY     --</arg_key>---> GAP
    GAP     --<arg_value>--> VALUE    (only whitespace between: else the key goes on, as
                                       vLLM's lazy regex makes it)
    VALUE   --</arg_value>-> BETWEEN  (text between pairs is dropped, as in vLLM)
    BETWEEN --<arg_key>----> KEY
    any call state --</tool_call>--> CONTENT,  --<tool_call>--> NAME (closes the open call)
    RAW: a call whose name is not an offered tool, written back as content.

Arguments stream as JSON text: a value whose schema type is only `string`
(or that the schema does not type) streams as it arrives; any other value is
written once complete, typed by `typed_values` (vLLM's `_fix_arg_types`).

Content follows vLLM's non-streamed answer (`.strip()` once calls were made)
as far as streaming allows: trailing whitespace is held and dropped at the
end when calls were made, whitespace before content that starts after a
call is dropped; leading whitespace of content that began before any call
has gone out already and stays.

Where vLLM 0.32 loses text or writes invalid JSON, onehop keeps what the
model wrote (each case is listed in docs/derender.md against vLLM's two answers):
a call to a function that was not offered (or with no name) is content
(vLLM drops it); text after a call is content (vLLM's full answer drops it);
a value still open when the call ends is closed as far as it arrived (vLLM
streams a cut string, its full answer drops the pair); a `<tool_call>` inside
an open call closes it (vLLM merges both into the first call). A key given
twice is written twice (the JSON parses to vLLM's last value).
With `parallel_tool_calls=false` only the first call is kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from derender.parsers.base import (
    BoundReasoning,
    BoundTools,
    Markers,
    ParseOptions,
    ReasoningFactory,
    ReasoningParser,
    ToolCallText,
    ToolDelta,
    ToolFactory,
    ToolParser,
)
from derender.parsers.typed_values import STRING_ONLY, coerce, parameter_types
from derender.stop import Piece
from derender.vocab import TokenVocab

THINK_START = "<think>"
THINK_END = "</think>"
START = "<tool_call>"
END = "</tool_call>"
KEY = "<arg_key>"
KEY_END = "</arg_key>"
VALUE = "<arg_value>"
VALUE_END = "</arg_value>"
ARG_TAGS = (KEY, KEY_END, VALUE, VALUE_END)
TURNS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")


# -- reasoning ----------------------------------------------------------------

_REASONING, _CONTENT, _PLAIN = range(3)
_OPEN, _CLOSE, _CALL, _CALL_END = range(4)


class BoundGlmThink(BoundReasoning):
    def __init__(self, vocab: TokenVocab) -> None:
        self.markers = Markers(vocab, (THINK_START, THINK_END))
        self.start = self.markers.id(THINK_START)
        self.end = self.markers.id(THINK_END)
        self.strays = {self.end: THINK_END}
        self.call = _id_or_none(vocab, START)
        self.call_end = _id_or_none(vocab, END)
        self._turns = frozenset(i for i in (_id_or_none(vocab, t) for t in TURNS) if i >= 0)

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int], options: ParseOptions) -> bool:
        """Reasoning unless thinking is off, or the generation turn already closed it
        (`</think>`, or a call opened in the prompt)."""
        if not options.enable_thinking:
            return False
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end or token_id == self.call:
                return False
            if token_id == self.start or token_id in self._turns:
                break
        return True

    def new(self, options: ParseOptions, *, in_reasoning: bool, tool_starts: Mapping[int, str]) -> ReasoningParser:
        state = _PLAIN if not options.enable_thinking else _REASONING if in_reasoning else _CONTENT
        return GlmReasoning(self, state, track_calls=bool(tool_starts))


def format_reasoning_45(text: str) -> str:
    """GLM-4.5/4.6 open the block themselves."""
    return f"{THINK_START}{text}{THINK_END}"


def format_reasoning_47(text: str) -> str:
    """GLM-4.7's template pre-opens `<think>`: the model writes the rest."""
    return f"{text}{THINK_END}"


class GlmReasoning(ReasoningParser):
    __slots__ = ("_by_id", "_held", "_in_call", "_state", "_think", "reasoning_tokens")

    def __init__(self, bound: BoundGlmThink, state: int, *, track_calls: bool) -> None:
        by_id = {bound.start: (_OPEN, THINK_START), bound.end: (_CLOSE, THINK_END)}
        if track_calls:
            # Calls are tracked so that a `<think>` inside one stays argument text.
            if bound.call >= 0:
                by_id[bound.call] = (_CALL, START)
            if bound.call_end >= 0:
                by_id[bound.call_end] = (_CALL_END, END)
        self._by_id = by_id
        self._think = frozenset((bound.start, bound.end))
        self._state = state
        self._in_call = False
        self._held: list[str] = []  # trailing whitespace of the reasoning so far
        self.reasoning_tokens = 0

    def feed(self, pieces: Sequence[Piece], reasoning: list[str]) -> Sequence[Piece]:
        if self._state == _PLAIN:
            return self._plain(pieces)
        by_id = self._by_id
        content: list[Piece] | None = None
        for i, piece in enumerate(pieces):  # hot loop
            text, token_id = piece
            marker = by_id.get(token_id)
            if marker is not None and not text.endswith(marker[1]):
                marker = None
            if self._state == _REASONING:
                if marker is None or marker[0] == _CALL_END:
                    self._reason(text, reasoning)
                    if token_id >= 0:
                        self.reasoning_tokens += 1
                    continue
                self._reason(text[: len(text) - len(marker[1])], reasoning)
                if marker[0] == _OPEN:
                    continue
                # Held whitespace stays held: it is reasoning again if GLM thinks again.
                self._state = _CONTENT
                if content is None:
                    content = []
                if marker[0] == _CALL:
                    self._in_call = True
                    content.append((marker[1], token_id))
                continue
            # CONTENT
            if marker is not None:
                kind = marker[0]
                if kind == _CALL:
                    self._in_call = True
                elif kind == _CALL_END:
                    self._in_call = False
                elif kind == _OPEN and not self._in_call:
                    if content is None:
                        content = list(pieces[:i])
                    head = text[: len(text) - len(marker[1])]
                    if head:
                        content.append((head, -1))
                    self._state = _REASONING
                    continue
            if content is not None:
                content.append(piece)
        if content is None:
            return pieces if self._state == _CONTENT else ()
        return content

    def finish(self, reasoning: list[str]) -> Sequence[Piece]:
        self._held.clear()  # the reasoning's trailing whitespace, as vLLM strips it
        return ()

    def _reason(self, text: str, reasoning: list[str]) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._held.append(text)
            return
        if self._held:
            reasoning.extend(self._held)
            self._held.clear()
        reasoning.append(body)
        if len(body) < len(text):
            self._held.append(text[len(body) :])

    def _plain(self, pieces: Sequence[Piece]) -> Sequence[Piece]:
        """Thinking off: think markers are plain text (id dropped, so no stage drops them)."""
        think = self._think
        if not any(token_id in think for _, token_id in pieces):
            return pieces
        return [(text, -1) if token_id in think else (text, token_id) for text, token_id in pieces]


# -- tool calls ---------------------------------------------------------------

_NONE, _NAME, _KEY, _GAP, _VALUE, _BETWEEN, _RAW = range(7)
_TAG = {_NAME: KEY, _KEY: KEY_END, _GAP: VALUE, _VALUE: VALUE_END, _BETWEEN: KEY}


class BoundGlmTools(BoundTools):
    def __init__(self, vocab: TokenVocab) -> None:
        # The arg tags are single tokens in GLM's tokenizer: listed so stop strings never split
        # them and the text route finds them, but parsed from text either way.
        optional = tuple(tag for tag in ARG_TAGS if vocab.token_id(tag) is not None)
        self.markers = Markers(vocab, (START, END, *optional))
        self.starts = {self.markers.id(START): START}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return GlmToolParser(self.markers, options, strays=strays)


def _format_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def format_calls_45(calls: Sequence[ToolCallText]) -> str:
    """GLM-4.5/4.6: the name and each tag pair on their own lines, calls one per line."""
    return "\n".join(
        f"{START}{c.name}\n"
        + "".join(f"{KEY}{k}{KEY_END}\n{VALUE}{_format_value(v)}{VALUE_END}\n" for k, v in c.arguments.items())
        + END
        for c in calls
    )


def format_calls_47(calls: Sequence[ToolCallText]) -> str:
    """GLM-4.7+: no newlines anywhere in a call."""
    return "".join(
        f"{START}{c.name}"
        + "".join(f"{KEY}{k}{KEY_END}{VALUE}{_format_value(v)}{VALUE_END}" for k, v in c.arguments.items())
        + END
        for c in calls
    )


def forced_prefix_45(name: str | None) -> str:
    return START if name is None else f"{START}{name}\n"


def forced_prefix_47(name: str | None) -> str:
    return START if name is None else f"{START}{name}"


class CallContent:
    """Content around calls, whitespace as vLLM's non-streamed answer has it (see the module doc)."""

    __slots__ = ("_emitted", "_held", "out")

    def __init__(self) -> None:
        self.out: list[str] = []
        self._held: list[str] = []
        self._emitted = False

    def add(self, text: str, *, calls: int) -> None:
        body = text.rstrip()
        if not body:
            self._held.append(text)
            return
        trailing = text[len(body) :]
        if not self._emitted and calls:
            self._held.clear()  # the answer will be stripped: no leading whitespace
            body = body.lstrip()
        elif self._held:
            self.out.extend(self._held)
            self._held.clear()
        self.out.append(body)
        self._emitted = True
        if trailing:
            self._held.append(trailing)

    def finish(self, *, calls: int) -> None:
        if self._held and not calls:
            self.out.extend(self._held)
        self._held.clear()

    def drain(self) -> str:
        out = self.out
        if not out:
            return ""
        self.out = []
        return "".join(out)


class GlmToolParser(ToolParser):
    __slots__ = (
        "_args",
        "_content",
        "_deltas",
        "_end",
        "_gap",
        "_index",
        "_key",
        "_made",
        "_name",
        "_names",
        "_options",
        "_pending",
        "_properties",
        "_start",
        "_state",
        "_stray",
        "_types",
        "_value",
        "calls",
    )

    def __init__(self, markers: Markers, options: ParseOptions, *, strays: Mapping[int, str]) -> None:
        self._start = markers.id(START)
        self._end = markers.id(END)
        self._stray = strays
        self._options = options
        self._names = frozenset(tool.name for tool in options.tools)
        self._content = CallContent()
        self._deltas: list[ToolDelta] = []
        self._state = _NONE
        self._pending = ""  # a possible partial tag, held until the next text
        self._name: list[str] = []
        self._key: list[str] = []
        self._gap: list[str] = []  # whitespace between `</arg_key>` and `<arg_value>`
        self._value: list[str] = []  # a typed value, written when complete
        self._types = STRING_ONLY
        self._properties: Mapping[str, Any] | None = None
        self._index = -1  # the call's delta index; -1 while it streams nothing
        self._args = False  # the call's arguments object has been opened
        self._made = 0  # calls made, including those parallel_tool_calls=false drops
        self.calls = 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        start, end, stray = self._start, self._end, self._stray
        for text, token_id in pieces:  # hot loop: one iteration per content token
            if token_id == start and text.endswith(START):
                self._text(text[: len(text) - len(START)])
                if self._state != _NONE:
                    self._close(closed=False)
                self._open()
            elif token_id == end and self._state != _NONE and text.endswith(END):
                self._text(text[: len(text) - len(END)])
                self._close(closed=True)
            elif token_id in stray and self._state == _NONE and text.endswith(stray[token_id]):
                self._text(text[: len(text) - len(stray[token_id])])
            elif text:
                self._text(text)

    def finish(self) -> None:
        if self._state != _NONE:
            self._close(closed=False)
        self._content.finish(calls=self._made)

    def drain(self) -> tuple[str, list[ToolDelta]]:
        deltas = self._deltas
        self._deltas = []
        return self._content.drain(), deltas

    # -- text --------------------------------------------------------------

    def _text(self, text: str) -> None:
        if not text:
            return
        state = self._state
        if state in (_NONE, _RAW):
            self._content.add(text, calls=self._made)
            return
        while text:  # hot loop inside a call: one tag search per state change
            if state == _GAP:
                text = self._gap_text(text)
                state = self._state
                continue
            buffer = self._pending + text if self._pending else text
            self._pending = ""
            tag = _TAG[state]
            found = buffer.find(tag)
            if found < 0:
                hold = _partial_tag(buffer, tag)
                if hold:
                    self._pending = buffer[-hold:]
                    buffer = buffer[:-hold]
                self._inner(state, buffer)
                return
            self._inner(state, buffer[:found])
            text = buffer[found + len(tag) :]
            self._tag(state)
            state = self._state
            if state == _RAW:
                if text:
                    self._content.add(text, calls=self._made)
                return

    def _inner(self, state: int, text: str) -> None:
        """Text between tags in a call state."""
        if not text:
            return
        if state == _VALUE:
            if self._types == STRING_ONLY:
                self._emit(json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                self._value.append(text)
        elif state == _NAME:
            self._name.append(text)
        elif state == _KEY:
            self._key.append(text)
        # BETWEEN: text between pairs is dropped, as vLLM's pair regex skips it.

    def _gap_text(self, text: str) -> str:
        """After `</arg_key>`: whitespace, then `<arg_value>`; anything else continues the key."""
        buffer = self._pending + text if self._pending else text
        self._pending = ""
        rest = buffer.lstrip()
        if len(rest) < len(buffer):
            self._gap.append(buffer[: len(buffer) - len(rest)])
        if not rest:
            return ""
        if rest.startswith(VALUE):
            self._open_value()
            return rest[len(VALUE) :]
        if VALUE.startswith(rest):
            self._pending = rest
            return ""
        self._key.append(KEY_END)
        self._key.extend(self._gap)
        self._gap.clear()
        self._state = _KEY
        return rest

    def _tag(self, state: int) -> None:
        if state == _NAME:
            self._header()
            if self._state == _RAW:
                self._content.add(START + "".join(self._name) + KEY, calls=self._made)
                return
            self._state = _KEY
        elif state == _KEY:
            self._gap.clear()
            self._state = _GAP
        elif state == _VALUE:
            self._close_value()
            self._state = _BETWEEN
        elif state == _BETWEEN:
            self._key.clear()
            self._state = _KEY

    # -- calls -------------------------------------------------------------

    def _open(self) -> None:
        self._state = _NAME
        self._pending = ""
        self._name.clear()
        self._key.clear()
        self._gap.clear()
        self._args = False
        self._index = -1

    def _header(self) -> None:
        """The name is complete: a call if it names an offered tool, else the text is content."""
        name = "".join(self._name).strip()
        if name not in self._names:
            self._state = _RAW
            return
        self._made += 1
        schema = self._options.schema_of(name)
        properties = schema.get("properties") if schema else None
        self._properties = properties if isinstance(properties, Mapping) else None
        if self.calls and not self._options.parallel_tool_calls:
            return  # parallel_tool_calls=false keeps the first call only
        self._index = self.calls
        self.calls += 1
        self._deltas.append(ToolDelta(index=self._index, id=self._options.new_id(), name=name))

    def _open_value(self) -> None:
        key = "".join(self._key).strip()
        self._key.clear()
        self._gap.clear()
        self._types = parameter_types(self._properties, key)
        self._value.clear()
        head = ", " if self._args else "{"
        self._args = True
        quote = '"' if self._types == STRING_ONLY else ""
        self._emit(f"{head}{json.dumps(key, ensure_ascii=False)}: {quote}")
        self._state = _VALUE

    def _close_value(self) -> None:
        if self._types == STRING_ONLY:
            self._emit('"')
            return
        self._emit(json.dumps(coerce("".join(self._value), self._types), ensure_ascii=False))
        self._value.clear()

    def _close(self, *, closed: bool) -> None:
        """The call ends: `</tool_call>`, a new `<tool_call>`, or the output's end."""
        state, pending = self._state, self._pending
        self._pending = ""
        if state == _NAME:
            self._name.append(pending)
            self._header()
            if self._state == _RAW:
                raw = START + "".join(self._name) + (END if closed else "")
                self._state = _NONE
                self._content.add(raw, calls=self._made)
                return
        elif state == _RAW:
            self._state = _NONE
            if closed:
                self._content.add(END, calls=self._made)
            return
        elif state == _VALUE:
            self._inner(_VALUE, pending)  # a partial tag at a cut value is its text
            self._close_value()
        self._state = _NONE
        self._emit("}" if self._args else "{}")

    def _emit(self, fragment: str) -> None:
        if self._index >= 0 and fragment:
            self._deltas.append(ToolDelta(index=self._index, arguments=fragment))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the suffix of `text` that could still become `tag` (every tag starts with
    its only `<`, so only the last `<` can begin one)."""
    at = text.rfind("<", max(0, len(text) - len(tag) + 1))
    if at < 0 or not tag.startswith(text[at:]):
        return 0
    return len(text) - at


def _id_or_none(vocab: TokenVocab, text: str) -> int:
    found = vocab.token_id(text)
    return -1 if found is None else found


REASONING_45 = ReasoningFactory("glm45", BoundGlmThink, format_reasoning_45)
REASONING_47 = ReasoningFactory("glm47", BoundGlmThink, format_reasoning_47)
TOOLS_45 = ToolFactory("glm45", BoundGlmTools, format_calls_45, forced_prefix_45)
TOOLS_47 = ToolFactory("glm47", BoundGlmTools, format_calls_47, forced_prefix_47)
