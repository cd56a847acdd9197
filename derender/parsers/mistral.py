"""Mistral / Ministral 3 / Magistral: `[THINK]` reasoning and `[TOOL_CALLS]` calls (vLLM `mistral`).

The model writes (tokenizer v11 and later, the ones with an `[ARGS]` token)::

    [THINK]reasoning[/THINK]content[TOOL_CALLS]NAME[ARGS]{json}[TOOL_CALLS]NAME2[ARGS]{json}

Every marker is a special token, so with the default `skip_special_tokens` its
piece arrives as `("", id)`: a marker counts when the piece's id is the marker's
and its text is the marker's text *or empty* (vLLM's parser turns
`skip_special_tokens` off for the same reason). A piece holding only part of a
marker's text (a stop string cut it) is plain text. Other special tokens
(`[INST]`, `<s>`, ...) never reach any text, as in vLLM. A tokenizer without an
`[ARGS]` token is pre-v11, as vLLM reads an HF tokenizer: its calls are the older
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (`LegacyToolParser`); one
without `[THINK]` (every Mistral before Magistral) is served without reasoning:
its reasoning family binds to nothing, with a warning (`bind_reasoning`).

Reasoning, one choice (`MistralReasoning`)::

    CONTENT   --[THINK]------> REASONING  (dropped; reasoning may open anywhere, more than once)
    CONTENT   --[/THINK]-----> CONTENT    (a stray end is dropped)
    REASONING --[/THINK]-----> CONTENT    (dropped)
    REASONING --[THINK]------> REASONING  (absorbed)
    REASONING --[TOOL_CALLS]-> CONTENT    (implicit end, with tools on; the marker goes on)

vLLM's Mistral parser starts in content whatever the prompt says: the model
opens `[THINK]` itself (Magistral's system prompt asks it to). Reasoning runs
over the whole output, calls included, as vLLM's non-streamed answer reads it.
Trailing whitespace of reasoning is held and dropped when it ends (vLLM strips it).

Tool calls, one choice (`MistralToolParser`)::

    CONTENT | AFTER --[TOOL_CALLS]--> NAME  (whitespace right before it is dropped)
    NAME  --[ARGS] or `{`----------> ARGS   (the header goes out: the name, stripped)
    NAME  --[TOOL_CALLS]-----------> NAME   (absorbed while the name is empty, else a call with `{}`)
    ARGS  --the JSON value closes--> AFTER  (text after it is content)
    ARGS  --[TOOL_CALLS]-----------> NAME   (the open call is closed first)

The format has no call terminator: vLLM's non-streamed answer keeps the first
JSON value of the arguments and drops what follows, its stream sends it all as
arguments (invalid JSON). onehop closes the call where the value closes and
gives the rest back as content, so nothing is lost. A name cut by the end of
output is still a call (with `{}`), as in vLLM's answer; unknown names are
calls too (vLLM does not check names for this family). Arguments stream through
`ArgumentsText`, retyped by the tool's schema as vLLM's non-streamed answer has
them. Call ids are 9 alphanumerics, Mistral's id shape (mistral-common rejects
others in the next request), derived from the request's id source.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Mapping, Sequence

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
from derender.toolcall import ToolCallBody
from derender.vocab import TokenVocab

THINK_START = "[THINK]"
THINK_END = "[/THINK]"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"

CALL_ID_CHARS = string.ascii_letters + string.digits
CALL_ID_LENGTH = 9

# Marker kinds, shared by both machines' id tables (DROP and TEXT: marker_tokens).
_THINK_START, _THINK_END, _CALLS, _ARGS = range(FIRST_KIND, FIRST_KIND + 4)


def _add_kind(vocab: TokenVocab, kinds: dict[int, tuple[int, str]], text: str, kind: int) -> None:
    token_id = optional_id(vocab, text)
    if token_id >= 0:
        kinds[token_id] = (kind, text)


# -- reasoning ------------------------------------------------------------------


class BoundMistralReasoning(BoundReasoning):
    def __init__(self, vocab: TokenVocab) -> None:
        optional = tuple(text for text in (TOOL_CALLS, ARGS) if optional_id(vocab, text) >= 0)
        self.markers = Markers(vocab, (THINK_START, THINK_END, *optional))
        self.strays = {}  # a stray `[/THINK]` is dropped here, not by the tool stage
        kinds: dict[int, tuple[int, str]] = {
            self.markers.id(THINK_START): (_THINK_START, THINK_START),
            self.markers.id(THINK_END): (_THINK_END, THINK_END),
        }
        for text in optional:
            kinds[self.markers.id(text)] = (TEXT, text)
        add_specials(vocab, kinds)
        self.kinds: Kinds = kinds
        self._with_tools: dict[tuple[tuple[int, str], ...], Kinds] = {}

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int], options: ParseOptions) -> bool:
        return False

    def new(self, options: ParseOptions, *, in_reasoning: bool, tool_starts: Mapping[int, str]) -> ReasoningParser:
        return MistralReasoning(self._kinds_with(tool_starts), in_reasoning=in_reasoning)

    def _kinds_with(self, tool_starts: Mapping[int, str]) -> Kinds:
        """The id table with the tool family's call openers ending reasoning, built once per set."""
        return with_kinds(self.kinds, self._with_tools, tool_starts, _CALLS)


class MistralReasoning(ReasoningParser):
    __slots__ = ("_kinds", "_reasoning", "_space", "reasoning_tokens")

    def __init__(self, kinds: Kinds, *, in_reasoning: bool) -> None:
        self._kinds = kinds
        self._reasoning = in_reasoning
        self._space: list[str] = []  # trailing whitespace of the reasoning so far
        self.reasoning_tokens = 0

    def feed(self, pieces: Sequence[Piece], reasoning: list[str]) -> Sequence[Piece]:
        kinds = self._kinds
        out: list[Piece] = []
        for text, token_id in pieces:  # hot loop: one iteration per output token
            kind = kinds.get(token_id)
            head = None if kind is None else split_marker(text, kind[1])
            if kind is None or head is None:
                if not self._reasoning:
                    out.append((text, token_id))
                    continue
                if text:
                    add_held(text, reasoning, self._space)
                if token_id >= 0:
                    self.reasoning_tokens += 1
                continue
            if head:
                self._text(head, out, reasoning)
            self._marker(kind, token_id, out, reasoning)
        return out

    def finish(self, reasoning: list[str]) -> Sequence[Piece]:
        self._space.clear()
        return ()

    def _text(self, text: str, out: list[Piece], reasoning: list[str]) -> None:
        if self._reasoning:
            add_held(text, reasoning, self._space)
        else:
            out.append((text, -1))

    def _marker(self, kind: tuple[int, str], token_id: int, out: list[Piece], reasoning: list[str]) -> None:
        which, text = kind
        if which == _THINK_START:
            self._reasoning = True
        elif which == _THINK_END:
            self._end()
        elif which == _CALLS and self._reasoning:
            self._end()
            out.append((text, token_id))
        elif which in (TEXT, _CALLS):
            # The marker's text is given back: the tool stage reads it by id, content shows it.
            if self._reasoning:
                add_held(text, reasoning, self._space)
            else:
                out.append((text, token_id))

    def _end(self) -> None:
        self._reasoning = False
        self._space.clear()


def format_reasoning(text: str) -> str:
    """A reasoning block as Magistral writes it: the markers hug the text."""
    return f"{THINK_START}{text}{THINK_END}"


# -- the end of a call's JSON value ------------------------------------------------

_STRUCTURE = re.compile(r'["{}\[\]]')
_STRING_STOP = re.compile(r'["\\]')


class JsonValueEnd:
    """Finds where the first JSON object or array of a text stream closes.

    Only what decides the end is tracked (nesting, strings, escapes), so the
    scan is linear and jumps over runs. A value that starts with anything but
    `{` or `[` (not JSON a model calls with) never closes.
    """

    __slots__ = ("_dead", "_depth", "_escape", "_in_string", "_started")

    def __init__(self) -> None:
        self._started = False
        self._dead = False
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int:
        """The index just past the value's closing character in `text`, or -1."""
        if self._dead:
            return -1
        pos = 0
        if not self._started:
            body = text.lstrip()
            if not body:
                return -1
            self._started = True
            if body[0] not in "{[":
                self._dead = True
                return -1
            pos = len(text) - len(body)
        return self._scan(text, pos)

    def _scan(self, text: str, pos: int) -> int:
        end = len(text)
        while pos < end:  # hot loop over argument text, by runs
            if self._escape:
                self._escape = False
                pos += 1
                continue
            if self._in_string:
                match = _STRING_STOP.search(text, pos)
                if match is None:
                    return -1
                pos = match.end()
                if match.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                continue
            match = _STRUCTURE.search(text, pos)
            if match is None:
                return -1
            pos = match.end()
            char = match.group()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return pos
        return -1


# -- tool calls -----------------------------------------------------------------

_NAME, _IN_ARGS, _AFTER = range(1, 4)  # after CONTENT (marker_tokens)


class BoundMistralTools(BoundTools):
    def __init__(self, vocab: TokenVocab) -> None:
        # vLLM's rule for an HF tokenizer: without an `[ARGS]` token it is pre-v11 (JSON list).
        self.legacy = optional_id(vocab, ARGS) < 0
        self.markers = Markers(vocab, (TOOL_CALLS,) if self.legacy else (TOOL_CALLS, ARGS))
        self.starts = {self.markers.id(TOOL_CALLS): TOOL_CALLS}
        kinds: dict[int, tuple[int, str]] = {self.markers.id(TOOL_CALLS): (_CALLS, TOOL_CALLS)}
        _add_kind(vocab, kinds, ARGS, _ARGS)
        # Reasoning markers reach this stage only without the reasoning family: text then.
        _add_kind(vocab, kinds, THINK_START, TEXT)
        _add_kind(vocab, kinds, THINK_END, TEXT)
        add_specials(vocab, kinds)
        self.kinds: Kinds = kinds

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        kinds = self.kinds
        if strays:
            kinds = {**kinds, **{token_id: (DROP, text) for token_id, text in strays.items()}}
        if self.legacy:
            return LegacyToolParser(kinds, options)
        return MistralToolParser(kinds, options)


def call_id(seed: str) -> str:
    """A Mistral-shaped call id (9 alphanumerics) from a source id: random ids stay random,
    a test's counter gives the same ids for every chunking."""
    number = int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=8).digest(), "big")
    chars = []
    for _ in range(CALL_ID_LENGTH):
        number, rest = divmod(number, len(CALL_ID_CHARS))
        chars.append(CALL_ID_CHARS[rest])
    return "".join(chars)


class MistralToolParser(MarkerToolParser):
    __slots__ = ("_end", "_name")

    def __init__(self, kinds: Kinds, options: ParseOptions) -> None:
        super().__init__(kinds, options)
        self._name: list[str] = []
        self._end = JsonValueEnd()
        # `_space` holds the trailing whitespace of content, dropped if a call follows.

    def _marker(self, kind: int, text: str) -> None:
        if kind == _CALLS:
            self._open()
        elif kind == _ARGS and self._state == _NAME:
            self._send_header()
        else:
            self._text(text)

    def finish(self) -> None:
        if self._state == _NAME:
            if "".join(self._name).strip():
                self._send_header()
                self._close_call()
        elif self._state == _IN_ARGS:
            self._close_call()
        if self._space and (self._state != _NAME or not self.calls):
            self._content.add("".join(self._space))  # ContentText drops it after a call
        self._space = []
        self._content.finish(calls=self.calls)

    def _text(self, text: str) -> None:
        state = self._state
        if state == _IN_ARGS:
            self._args_text(text)
        elif state == _NAME:
            brace = text.find("{")
            if brace < 0:
                self._name.append(text)
                return
            # `NAME{json}` without `[ARGS]`: the brace ends the name (vLLM reads it so too).
            self._name.append(text[:brace])
            self._send_header()
            self._args_text(text[brace:])
        else:
            self._content_text(text)

    def _content_text(self, text: str) -> None:
        """Content: its trailing whitespace run is held, dropped if a call follows (vLLM's
        answer strips content around calls) and given back at the end otherwise."""
        body = text.rstrip()
        if not body:
            self._space.append(text)
            return
        if self._space:
            body = "".join(self._space) + body
            self._space = []
        self._content.add(body)
        if len(body) < len(text):
            self._space.append(text[len(body) :])

    def _open(self) -> None:
        """`[TOOL_CALLS]`: a call opens; one with only a name so far is closed first."""
        state = self._state
        if state == _NAME:
            if not "".join(self._name).strip():
                return  # a repeated marker before any name
            self._send_header()
            self._close_call()
        elif state == _IN_ARGS:
            self._close_call()
        else:
            self._space = self._content.take_held() + self._space
        self._state = _NAME
        self._name = []

    def _send_header(self) -> None:
        name = "".join(self._name).strip()
        self._name = []
        self._state = _IN_ARGS
        self._end = JsonValueEnd()
        self._space = []
        if self._open_args(name):
            self._deltas.append(ToolDelta(index=self._index, id=call_id(self._options.new_id()), name=name))

    def _args_text(self, text: str) -> None:
        args = self._args
        assert args is not None
        end = self._end.feed(text)
        if end < 0:
            args.feed(text)
            self._emit_args()
            return
        args.feed(text[:end])
        self._close_call()
        self._state = _AFTER
        if end < len(text):
            self._content_text(text[end:])

    def _close_call(self) -> None:
        self._finish_args()
        self._state = _AFTER


# -- pre-v11 calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` -----------------

_L_LEAD, _L_LIST, _L_CALL, _L_AFTER, _L_RAW = range(1, 6)  # after CONTENT (marker_tokens)


class LegacyToolParser(MarkerToolParser):
    """Pre-v11 Mistral calls, one choice::

        CONTENT --[TOOL_CALLS]--> LEAD   (a repeated marker here is absorbed, as in vLLM)
        LEAD    --`[`----------> LIST   | `{` -> CALL (a bare object is one call) | else RAW
        LIST    --`{`----------> CALL   | `,` and layout skipped | `]` -> AFTER | else RAW
        CALL    --object closes-> LIST  (AFTER for a bare object)
        AFTER: content. RAW: the text after the marker is content (vLLM's answer does so).

    Each object streams through `ToolCallBody`: the header once its `name` closes, the
    `arguments` text as it arrives (vLLM's pre-v11 path retypes nothing). An object that
    closes without a name, before any call of the list, turns the whole list into content.
    Of `MarkerToolParser` it uses the dispatch only: arguments go through `ToolCallBody`.
    """

    __slots__ = ("_bare", "_body", "_raw")

    def __init__(self, kinds: Kinds, options: ParseOptions) -> None:
        super().__init__(kinds, options)
        self._bare = False
        self._body: ToolCallBody | None = None
        self._raw: list[str] = []  # the list's text while no call of it has a header
        self._index = -2  # the open call's index; -1: not streamed; -2: no header yet

    def _marker(self, kind: int, text: str) -> None:
        if kind == _CALLS and self._state in (CONTENT, _L_LEAD):
            if self._state == CONTENT:
                self._content.take_held()  # whitespace-only content before calls is null
            self._state = _L_LEAD
        else:
            self._text(text)

    def finish(self) -> None:
        if self._state == _L_CALL:
            self._end_call()
        elif self._state in (_L_LEAD, _L_LIST) and self._raw and not self.calls:
            self._content.add("".join(self._raw))
        self._content.finish(calls=self.calls)

    def _text(self, text: str) -> None:
        while text:
            state = self._state
            if state in (CONTENT, _L_AFTER, _L_RAW):
                self._content.add(text)
                return
            if state == _L_CALL:
                text = self._call_text(text)
                continue
            body = text.lstrip(" \t\r\n," if state == _L_LIST else " \t\r\n")
            char = body[:1]
            if char == "{":
                self._open(bare=state == _L_LEAD)
            elif char == "[" and state == _L_LEAD:
                self._state = _L_LIST
            elif char == "]" and state == _L_LIST:
                self._state = _L_AFTER
            elif char:
                self._raw.append(text)
                self._to_raw()
                return
            self._raw.append(text[: len(text) - len(body) + 1])
            text = body[1:]

    def _open(self, *, bare: bool) -> None:
        self._state = _L_CALL
        self._bare = bare
        self._body = ToolCallBody()
        self._body.feed("{")
        self._index = -2

    def _call_text(self, text: str) -> str:
        """Feed the open object; return the text after it once it closed."""
        body = self._body
        assert body is not None
        taken = body.feed(text)
        if self._index == -2:
            self._raw.append(text[:taken])
        if self._index == -2 and body.name is not None:
            self._send_header(body.name)
        self._emit(body)
        if not body.closed:
            return ""
        self._end_call()
        return text[taken:]

    def _send_header(self, name: str) -> None:
        self._raw = []
        if self.calls and not self._options.parallel_tool_calls:
            self._index = -1  # parallel_tool_calls=false keeps the first call only
            return
        self._index = self.calls
        self.calls += 1
        self._deltas.append(ToolDelta(index=self._index, id=call_id(self._options.new_id()), name=name))

    def _emit(self, body: ToolCallBody) -> None:
        out = body.take_arguments()
        if out and self._index >= 0:
            self._deltas.append(ToolDelta(index=self._index, arguments=out))

    def _end_call(self) -> None:
        body = self._body
        assert body is not None
        self._body = None
        self._state = _L_AFTER if self._bare else _L_LIST
        if self._index == -2:
            self._to_raw()  # an object without a name is no call
        elif self._index >= 0 and not body.has_arguments:
            self._deltas.append(ToolDelta(index=self._index, arguments="{}"))

    def _to_raw(self) -> None:
        """Malformed: the list's text so far (and all that follows) is content."""
        self._state = _L_RAW
        self._content.add("".join(self._raw))
        self._raw = []


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """How Mistral's v11+ models write calls: `[TOOL_CALLS]NAME[ARGS]{json}` per call, no separator
    (the writers and `forced_prefix` are v11+ only: they cannot see the tokenizer)."""
    return "".join(
        f"{TOOL_CALLS}{c.name}{ARGS}{json.dumps(dict(c.arguments), ensure_ascii=False)}" for c in calls
    )


def forced_prefix(name: str | None) -> str:
    """Named: the call is opened up to its arguments; "required": up to the name."""
    if name is None:
        return TOOL_CALLS
    return f"{TOOL_CALLS}{name}{ARGS}"


REASONING = ReasoningFactory("mistral", BoundMistralReasoning, format_reasoning)
TOOLS = ToolFactory("mistral", BoundMistralTools, format_calls, forced_prefix)
