"""gpt-oss Harmony: reasoning parser `openai_gptoss`, tool parser `openai` (vLLM's names).

The model writes messages, each a header then content; the prompt ends with
`<|start|>assistant`, so the output opens inside the first header:

    <|channel|>analysis<|message|>…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"x"}<|call|>
    <|start|>assistant<|channel|>final<|message|>…<|return|>

One protocol machine (`_HarmonyMachine`) reads the pieces, in three states:

    HEADER  --<|message|>, header parses--> CONTENT  (the message's kind is known)
    HEADER  --<|message|>, header fails---> EXPECT   (that message is dropped)
    HEADER  --any other piece------------> HEADER   (markers included, as text)
    CONTENT --<|end|> <|call|> <|return|>-> EXPECT   (the message is closed)
    CONTENT --any other piece------------> CONTENT  (other markers are content text)
    EXPECT  --<|start|>------------------> HEADER
    EXPECT  --anything else--------------> EXPECT   (dropped)

and routes each message by its header (vLLM 0.32 `parser/harmony.py`, which
drives `openai_harmony.StreamableParser` over token ids; `parse_header` is
that parser's header grammar, rewritten here):

    recipient names a function (`to=functions.NAME`, or a bare name that is
        not a built-in tool)                        -> a tool call NAME
    channel `analysis`                              -> reasoning
    channel `final`, or `commentary` with no recipient -> content
    anything else (built-in tools, unknown channels, other roles) -> dropped

Both stages run that machine. The reasoning stage keeps analysis text; with
the `openai` tool stage on it passes every other piece on unchanged, headers
and markers included (an analysis message reaches the tool stage with its
content removed, so the stream stays well formed), and the tool stage routes
content and calls. Without a Harmony tool stage (no tool parser, tools not
offered, `tool_choice` none) the reasoning stage gives clean content itself:
final/commentary text only, never header tokens; calls are dropped, as in
vLLM's non-streamed answer. The tool stage alone drops reasoning, as vLLM does
without a reasoning parser.

Where vLLM's two paths differ, onehop gives the non-streamed answer, or the
one that loses nothing of what a client should see:
- messages of one kind are joined with "\\n" (vLLM's non-streamed join; its
  stream concatenates them);
- a header the output ended inside is content only when it holds no Harmony
  marker token (a model that never wrote Harmony); a Harmony header cut short
  is dropped (vLLM returns its raw text, `<|start|>assistant<|channel|>fin`,
  as content), and stop-token text (`<|return|>`, `<|call|>`) never reaches
  content;
- a closed call with no argument text gets `{}` (vLLM sends "").
Markers are recognised by id whether `skip_special_tokens` left their text or
not (all seven are specials of the o200k_harmony vocabulary).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, auto

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
from derender.stop import Piece
from derender.vocab import TokenVocab

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
CONSTRAIN = "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_CLOSERS = frozenset((END, CALL, RETURN))
_STOP_TOKENS = frozenset((CALL, RETURN))
"""End a generation in gpt-oss (EOS ids): their text never reaches content."""

ROLES = frozenset(("user", "assistant", "system", "developer", "tool"))
BUILTIN_TOOLS = frozenset(("python", "browser", "container"))
FUNCTIONS = "functions."
# Rust's `char::is_whitespace` (Unicode White_Space), which the header grammar trims with.
_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
)
_CHANNEL_END = re.compile(f"[<{re.escape(_WHITESPACE)}]")
# Rust's `split_ascii_whitespace` (no vertical tab).
_ASCII_SPLIT = re.compile(r"[ \t\n\x0c\r]+")

_EXPECT, _HEADER, _CONTENT = range(3)


class MessageKind(Enum):
    """Where a message's text goes: reasoning, content, a tool call, or nowhere."""

    REASONING = auto()
    CONTENT = auto()
    TOOL = auto()
    IGNORE = auto()


class HeaderError(ValueError):
    """A message header the Harmony grammar rejects (the message is dropped)."""


@dataclass(frozen=True, slots=True)
class Header:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None


def parse_header(text: str, *, role: str | None) -> Header:
    """The header between a message's start and `<|message|>`, markers as text.

    `role` is the role the prompt already opened (`<|start|>assistant`), else
    None: the header's first word is the role then.
    """
    channel: str | None = None
    at = text.find(CHANNEL)
    if at >= 0:
        after = text[at + len(CHANNEL) :]
        found = _CHANNEL_END.search(after)
        size = found.start() if found else len(after)
        if not size:
            raise HeaderError("channel marker without a channel")
        channel = after[:size]
        text = text[:at] + after[size:]
    text = text.strip(_WHITESPACE)
    if CONSTRAIN in text:
        text = text.replace(CONSTRAIN, " " + CONSTRAIN).strip(_WHITESPACE)
    parts = [part for part in _ASCII_SPLIT.split(text) if part]
    if role is None:
        role = _role(parts)
    if parts and parts[0] == role:
        del parts[0]
    recipient, content_type = _addressing(parts)
    return Header(role, channel, normalize_recipient(recipient), content_type)


def _role(parts: list[str]) -> str:
    if not parts:
        raise HeaderError("header without a role")
    if parts[0] in ROLES:
        return parts[0]
    if len(parts) > 1 or parts[0].startswith("to="):
        del parts[0]  # an unknown author addressing someone is a tool
        return "tool"
    raise HeaderError(f"unknown role {parts[0]!r}")


def _addressing(parts: list[str]) -> tuple[str | None, str | None]:
    """(recipient, content type) from the words left after role and channel."""
    if not parts:
        return None, None
    count = len(parts)
    last = parts.pop()
    recipient: str | None
    content_type: str | None = None
    if last.startswith("to="):
        recipient = last[3:]
    elif count == 1:
        recipient = last
    else:
        content_type = last
        raw = parts.pop()
        recipient = raw[3:] if raw.startswith("to=") else raw
    if parts:
        raise HeaderError(f"unexpected words in header: {parts!r}")
    return recipient, content_type


def normalize_recipient(recipient: str | None) -> str | None:
    """Drop a content type glued to the recipient (`to=f<|constrain|>json`), as vLLM does."""
    if recipient is None:
        return None
    at = recipient.find(CONSTRAIN)
    if at < 0:
        return recipient
    return recipient[:at].rstrip() or None


def function_name(recipient: str | None) -> str | None:
    """The function a recipient calls, or None when it is no function (vLLM's chat rule)."""
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return None
    if recipient.startswith(FUNCTIONS):
        return recipient[len(FUNCTIONS) :] or None
    if recipient in BUILTIN_TOOLS or recipient.split(".", 1)[0] in BUILTIN_TOOLS:
        return None
    return recipient


def message_kind(header: Header) -> MessageKind:
    if function_name(header.recipient) is not None:
        return MessageKind.TOOL if header.role == "assistant" else MessageKind.IGNORE
    if header.role != "assistant":
        return MessageKind.IGNORE
    if header.channel == "analysis":
        return MessageKind.REASONING
    if header.channel == "final" or (header.channel == "commentary" and header.recipient is None):
        return MessageKind.CONTENT
    return MessageKind.IGNORE


def counts_as_reasoning(header: Header) -> bool:
    """vLLM's `reasoning_tokens`: content tokens of analysis, and of commentary to a recipient."""
    return header.channel == "analysis" or (header.channel == "commentary" and header.recipient is not None)


# -- writing -------------------------------------------------------------------


def format_reasoning(text: str) -> str:
    """An analysis message, then the next message opened (the prompt opened the first)."""
    return f"{CHANNEL}analysis{MESSAGE}{text}{END}{START}assistant"


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """Calls as gpt-oss writes them: commentary to the function, compact JSON, `<|call|>`."""
    return f"{START}assistant".join(
        f"{_call_opening(c.name)}{json.dumps(dict(c.arguments), ensure_ascii=False, separators=(',', ':'))}{CALL}"
        for c in calls
    )


def format_content(text: str) -> str:
    """An answer as gpt-oss writes it: a message on the final channel (plain text would be
    read as a header, and dropped)."""
    return f"{CHANNEL}final{MESSAGE}{text}{RETURN}"


def forced_prefix(name: str | None) -> str:
    """A named call is opened up to its arguments; "required" up to the function name."""
    if name is None:
        return f"{CHANNEL}commentary to={FUNCTIONS}"
    return _call_opening(name)


def _call_opening(name: str) -> str:
    return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


# -- the protocol machine --------------------------------------------------------


class _HarmonyMachine:
    """Harmony's message structure over pieces; the stages route what it finds."""

    __slots__ = ("_by_id", "_header", "_joined", "_kind", "_marked", "_raw", "_role", "_started", "_state")

    def __init__(self, markers: Markers) -> None:
        self._by_id = markers.by_id
        self._state = _HEADER
        self._role: str | None = "assistant"  # opened by the prompt; the header grammar forgets it once parsed
        self._header: list[str] = []
        self._raw: list[str] = []
        """The plain text of headers since the last message opened (for a header the output ends inside)."""
        self._marked = False
        """Whether a Harmony marker token (stop tokens aside) came since the last message opened."""
        self._kind = MessageKind.IGNORE
        self._joined = [False, False]
        """Whether a reasoning / content message with text came before (the "\\n" join)."""
        self._started = False
        """Whether the open message has produced text."""

    def _run(self, pieces: Sequence[Piece]) -> None:
        by_id = self._by_id
        for piece in pieces:  # hot loop: one iteration per output token
            text, token_id = piece
            marker = by_id.get(token_id)
            if marker is not None:
                if text and not text.endswith(marker):
                    marker = None  # a stop string cut into it: plain text now
                elif len(text) > len(marker):
                    # Text flushed ahead of the marker (a split character) belongs before it.
                    self._plain((text[: len(text) - len(marker)], -1))
                    piece = (marker, token_id)
            if marker is None:
                self._plain(piece)
            else:
                self._marker(marker, piece)

    def _plain(self, piece: Piece) -> None:
        state = self._state
        if state == _CONTENT:
            self._text(piece[0], piece[1])
            return
        if state == _HEADER:
            self._header.append(piece[0])
            if not self._marked:
                self._raw.append(piece[0])
        self._outside(piece)

    def _marker(self, marker: str, piece: Piece) -> None:
        state = self._state
        if state == _CONTENT:
            if marker in _CLOSERS:
                self._state = _EXPECT
                self._outside(piece)
                self._close(closed=True)
                return
            self._text(marker, piece[1])  # inside content Harmony reads other markers as text
            return
        self._outside(piece)
        if state == _EXPECT:
            if marker == START:
                self._state = _HEADER
                self._marked = True
            return
        if marker == MESSAGE:
            self._open_message()
            return
        self._header.append(marker)
        if marker not in _STOP_TOKENS:
            self._marked = True

    def _open_message(self) -> None:
        text = "".join(self._header)
        self._header = []
        try:
            header = parse_header(text, role=self._role)
        except HeaderError:
            self._state = _EXPECT  # Harmony drops the message; its header text stays for recovery
            return
        self._role = None
        self._raw = []
        self._marked = False
        self._state = _CONTENT
        self._kind = message_kind(header)
        self._started = False
        self._open(header)

    def _end(self) -> None:
        """The output ended: close an open message, or recover a header cut short."""
        state = self._state
        self._state = _EXPECT
        if state == _CONTENT:
            self._close(closed=False)
            return
        raw = "".join(self._raw) if state == _HEADER and not self._marked else ""
        self._raw = []
        self._header = []
        if raw:
            self._recover(raw)

    def _join(self, slot: int) -> bool:
        """Whether this message's first text needs the "\\n" that joins it to an earlier one."""
        self._started = True
        joined = self._joined[slot]
        self._joined[slot] = True
        return joined

    # Hooks for the stages.
    def _open(self, header: Header) -> None: ...

    def _text(self, text: str, token_id: int) -> None: ...

    def _close(self, *, closed: bool) -> None: ...

    def _outside(self, piece: Piece) -> None:
        """A piece outside message content (header, marker, text between messages)."""

    def _recover(self, text: str) -> None:
        """Text of a header that never completed and holds no Harmony marker token: content."""


# -- reasoning stage -------------------------------------------------------------


class BoundHarmonyReasoning(BoundReasoning):
    def __init__(self, vocab: TokenVocab) -> None:
        self.markers = Markers(vocab, MARKERS)
        self.strays: Mapping[int, str] = {}
        self.specials = vocab.special_ids
        self.channel_id = self.markers.id(CHANNEL)

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int], options: ParseOptions) -> bool:
        """Harmony's channels, not a start state, say what is reasoning (vLLM ignores the prompt too)."""
        return False

    def new(self, options: ParseOptions, *, in_reasoning: bool, tool_starts: Mapping[int, str]) -> ReasoningParser:
        return HarmonyReasoning(self, passthrough=self.channel_id in tool_starts)


class HarmonyReasoning(_HarmonyMachine, ReasoningParser):
    """Analysis text to reasoning; the rest passed on (Harmony tool stage) or as clean content."""

    __slots__ = ("_counting", "_out", "_passthrough", "_reasoning", "_specials", "reasoning_tokens")

    def __init__(self, bound: BoundHarmonyReasoning, *, passthrough: bool) -> None:
        super().__init__(bound.markers)
        self._specials = bound.specials
        self._passthrough = passthrough
        self._counting = False
        self._reasoning: list[str] = []
        self._out: list[Piece] = []
        self.reasoning_tokens = 0

    def feed(self, pieces: Sequence[Piece], reasoning: list[str]) -> Sequence[Piece]:
        self._reasoning = reasoning
        self._run(pieces)
        return self._take()

    def finish(self, reasoning: list[str]) -> Sequence[Piece]:
        self._reasoning = reasoning
        if not self._passthrough:
            self._end()  # with a tool stage, that stage settles the end
        return self._take()

    def _take(self) -> list[Piece]:
        out = self._out
        if out:
            self._out = []
        return out

    def _open(self, header: Header) -> None:
        self._counting = counts_as_reasoning(header)

    def _text(self, text: str, token_id: int) -> None:
        if self._counting and token_id >= 0 and token_id not in self._specials:
            self.reasoning_tokens += 1
        kind = self._kind
        if kind is MessageKind.REASONING:
            if text:
                if not self._started and self._join(0):
                    self._reasoning.append("\n")
                self._reasoning.append(text)
        elif self._passthrough:
            self._out.append((text, token_id))
        elif kind is MessageKind.CONTENT and text:
            if not self._started and self._join(1):
                self._out.append(("\n", -1))
            self._out.append((text, -1))

    def _close(self, *, closed: bool) -> None:
        self._counting = False

    def _outside(self, piece: Piece) -> None:
        if self._passthrough:
            self._out.append(piece)

    def _recover(self, text: str) -> None:
        self._out.append(("\n" + text if self._join(1) else text, -1))


# -- tool stage ------------------------------------------------------------------


class BoundHarmonyTools(BoundTools):
    def __init__(self, vocab: TokenVocab) -> None:
        self.markers = Markers(vocab, MARKERS)
        self.starts = {self.markers.id(CHANNEL): CHANNEL}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return HarmonyTools(self.markers, options)


class HarmonyTools(_HarmonyMachine, ToolParser):
    """Content messages to content, function messages to tool calls; analysis dropped."""

    __slots__ = ("_content", "_deltas", "_has_arguments", "_index", "_options", "calls")

    def __init__(self, markers: Markers, options: ParseOptions) -> None:
        super().__init__(markers)
        self._options = options
        self._content: list[str] = []
        self._deltas: list[ToolDelta] = []
        self._index = -1
        """The open call's index, -1 when the open message is no (kept) call."""
        self._has_arguments = False
        self.calls = 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        self._run(pieces)

    def finish(self) -> None:
        self._end()

    def drain(self) -> tuple[str, list[ToolDelta]]:
        deltas = self._deltas
        self._deltas = []
        content = "".join(self._content) if self._content else ""
        self._content = []
        return content, deltas

    def _open(self, header: Header) -> None:
        self._index = -1
        if self._kind is not MessageKind.TOOL or (self.calls and not self._options.parallel_tool_calls):
            return  # parallel_tool_calls=false keeps the first call only
        name = function_name(header.recipient)
        assert name is not None
        self._index = self.calls
        self.calls += 1
        self._has_arguments = False
        self._deltas.append(ToolDelta(index=self._index, id=self._options.new_id(), name=name))

    def _text(self, text: str, token_id: int) -> None:
        if not text:
            return
        if self._index >= 0:
            self._has_arguments = True
            self._deltas.append(ToolDelta(index=self._index, arguments=text))
        elif self._kind is MessageKind.CONTENT:
            if not self._started and self._join(1):
                self._content.append("\n")
            self._content.append(text)

    def _close(self, *, closed: bool) -> None:
        if self._index >= 0 and closed and not self._has_arguments:
            self._deltas.append(ToolDelta(index=self._index, arguments="{}"))
        self._index = -1

    def _recover(self, text: str) -> None:
        self._content.append("\n" + text if self._join(1) else text)


REASONING = ReasoningFactory("openai_gptoss", BoundHarmonyReasoning, format_reasoning)
TOOLS = ToolFactory("openai", BoundHarmonyTools, format_calls, forced_prefix, format_content)
