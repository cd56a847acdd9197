"""DeepSeek: `<think>` reasoning (vLLM `deepseek_r1`, `deepseek_v3`) and tool calls (`deepseek_v3`, `deepseek_v31`).

Reasoning is `ThinkReasoning` with DeepSeek's rules (vLLM's
`DeepSeekR1ReasoningParser` / `DeepSeekV3ReasoningParser`):

- R1's template pre-opens `<think>`, so output starts inside reasoning
  without a start marker; a `<think>` the model writes anyway is absorbed.
  Output that never writes `</think>` is all reasoning (vLLM, both paths).
- The start state comes from the generation turn of the prompt (scanned back
  to `<｜Assistant｜>`): a trailing `</think>` (V3.1's non-thinking turn)
  means content, a trailing `<think>` reasoning; with neither, `deepseek_r1`
  starts in reasoning whatever `enable_thinking` says (vLLM ignores it) and
  `deepseek_v3` in content (vLLM's V3 parser is the identity parser unless
  the `thinking` / `enable_thinking` template kwargs are set, and V3.1's
  template writes the marker that says which). vLLM's non-streamed answer
  ignores the prompt (a `</think>`-closed turn comes out all reasoning);
  onehop follows its stream, which reads the prompt.
- `reasoning_tokens` counts the ids routed to reasoning (vLLM counts only
  ids between an explicit `<think>` and `</think>`: 0 for R1's usual output).
- A tool-call opening inside reasoning does not end it, and a second
  `</think>` stays in content as text: vLLM passes both through.

Tool calls sit in a section; every marker is a single token:

    V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
          <｜tool▁call▁end｜> (calls joined by "\\n") <｜tool▁calls▁end｜>
    V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

States of one choice:

    CONTENT --calls begin--> SECTION --calls end--> CONTENT
    SECTION --call begin---> CALL    --call end---> SECTION
    CALL    --call begin / calls end--> (the open call is closed first)

    CALL, V3:   TYPE --sep--> NAME --"\\n"--> FENCE --"```json\\n"--> ARGS --"\\n```"--> TAIL
    CALL, V3.1: NAME --sep--> ARGS

The header (id + name) goes out when the name ends (V3: its newline; V3.1:
the separator), as vLLM's stream sends it; the arguments stream as the
model's JSON text, with V3 holding back only a trailing `"\\n"` + up to three
backticks that may open the closing fence (a fence cut short at the end
is markup and dropped). Arguments are JSON, so values are
never typed by the schema, and names are not checked against the offered
tools: vLLM emits whatever call the model wrote, unknown names and invalid
JSON included, and so does onehop. Where vLLM loses text, onehop keeps it:

- multi-line arguments (vLLM's regexes stop at the first newline: its full
  answer drops the call, its stream sends the first line only);
- a call cut short (truncation, a stop string) is a call with the partial
  arguments, as vLLM streams it (its full answer drops it), closed to valid
  JSON by the chat choice (`json_close`);
- a call that never got a name, and a section with text but no call, come
  back as content, marker text included; a section with nothing but
  whitespace in it (`<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>`, or an opening the
  output ended after) is markup: no content, no call;
- text after the last call is content (vLLM's full answer keeps only the
  text before the section).
Call markers outside a section, and markers written as ordinary tokens, are
plain text (vLLM's stream decides by token id too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace

from derender.parsers.base import (
    BoundTools,
    Markers,
    ParseOptions,
    ReasoningFactory,
    ToolCallText,
    ToolDelta,
    ToolFactory,
    ToolParser,
)
from derender.parsers.content import ContentText
from derender.parsers.think import BoundThink, ThinkSyntax, format_think
from derender.stop import Piece
from derender.vocab import TokenVocab

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
ASSISTANT = "<｜Assistant｜>"
CALL_TYPE = "function"
FENCE_OPEN = "```json\n"
FENCE_CLOSE = "\n```"

R1_THINK = ThinkSyntax(
    start="<think>",
    end="</think>",
    turn_start=ASSISTANT,
    tool_ends_reasoning=False,
    default_reasoning=True,
    drop_stray_end=False,
)
V3_THINK = replace(R1_THINK, default_reasoning=False)


def _bind_r1(vocab: TokenVocab) -> BoundThink:
    return BoundThink(vocab, R1_THINK)


def _bind_v3_reasoning(vocab: TokenVocab) -> BoundThink:
    return BoundThink(vocab, V3_THINK)


def format_reasoning(text: str) -> str:
    """A reasoning block as R1 writes it when its template leaves `<think>` to the model."""
    return format_think(R1_THINK, text)


# -- writing calls ---------------------------------------------------------------


def _arguments(call: ToolCallText) -> str:
    return json.dumps(dict(call.arguments), ensure_ascii=False)


def format_calls_v3(calls: Sequence[ToolCallText]) -> str:
    """V3's section: each call's JSON in a fenced block, calls on their own lines."""
    body = "\n".join(
        f"{CALL_BEGIN}{CALL_TYPE}{SEP}{c.name}\n{FENCE_OPEN}{_arguments(c)}{FENCE_CLOSE}{CALL_END}" for c in calls
    )
    return f"{CALLS_BEGIN}{body}{CALLS_END}"


def format_calls_v31(calls: Sequence[ToolCallText]) -> str:
    """V3.1's section: name, separator, bare JSON; calls back to back."""
    body = "".join(f"{CALL_BEGIN}{c.name}{SEP}{_arguments(c)}{CALL_END}" for c in calls)
    return f"{CALLS_BEGIN}{body}{CALLS_END}"


def forced_prefix_v3(name: str | None) -> str:
    """Open a call up to its arguments (named) or up to its name ("required")."""
    head = f"{CALLS_BEGIN}{CALL_BEGIN}{CALL_TYPE}{SEP}"
    return head if name is None else f"{head}{name}\n{FENCE_OPEN}"


def forced_prefix_v31(name: str | None) -> str:
    head = f"{CALLS_BEGIN}{CALL_BEGIN}"
    return head if name is None else f"{head}{name}{SEP}"


# -- parsing calls ---------------------------------------------------------------

# Marker kinds, and the phases of one call.
_CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP, _STRAY = range(6)
_NONE, _TYPE, _NAME, _FENCE, _ARGS, _TAIL = range(6)


class BoundDeepSeekTools(BoundTools):
    def __init__(self, vocab: TokenVocab, *, fenced: bool) -> None:
        self.fenced = fenced
        self.markers = Markers(vocab, (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP))
        self.starts = {self.markers.id(CALLS_BEGIN): CALLS_BEGIN}

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return DeepSeekToolParser(self, options, strays=strays)


def bind_v3(vocab: TokenVocab) -> BoundDeepSeekTools:
    return BoundDeepSeekTools(vocab, fenced=True)


def bind_v31(vocab: TokenVocab) -> BoundDeepSeekTools:
    return BoundDeepSeekTools(vocab, fenced=False)


class DeepSeekToolParser(ToolParser):
    """One choice's V3 (`fenced`) or V3.1 tool-call parsing."""

    __slots__ = (
        "_content",
        "_deltas",
        "_fenced",
        "_has_arguments",
        "_header_sent",
        "_held",
        "_index",
        "_kinds",
        "_name",
        "_options",
        "_pending",
        "_phase",
        "_raw",
        "_section",
        "_section_called",
        "_space",
        "calls",
    )

    def __init__(self, bound: BoundDeepSeekTools, options: ParseOptions, *, strays: Mapping[int, str]) -> None:
        markers = bound.markers
        kinds: dict[int, tuple[int, str]] = {token_id: (_STRAY, text) for token_id, text in strays.items()}
        for kind, text in (
            (_CALLS_BEGIN, CALLS_BEGIN),
            (_CALLS_END, CALLS_END),
            (_CALL_BEGIN, CALL_BEGIN),
            (_CALL_END, CALL_END),
            (_SEP, SEP),
        ):
            kinds[markers.id(text)] = (kind, text)
        self._kinds = kinds
        self._fenced = bound.fenced
        self._options = options
        self._content = ContentText()
        self._deltas: list[ToolDelta] = []
        self._section = False
        self._section_called = False  # a call was made in the open section
        # The space before the section, its opening, the space after, until text or a call.
        self._pending: list[str] = []
        self._phase = _NONE
        self._raw: list[str] = []  # the open call's text until its header, given back if it never gets one
        self._space: list[str] = []  # whitespace held when the call began
        self._name: list[str] = []
        self._held = ""  # V3: a possible start of the closing fence
        self._index = -1
        self._header_sent = False
        self._has_arguments = False
        self.calls = 0

    def feed(self, pieces: Sequence[Piece]) -> None:
        kinds = self._kinds
        for text, token_id in pieces:  # hot loop: one iteration per content token
            marker = kinds.get(token_id)
            if marker is None or not text.endswith(marker[1]):
                if text:
                    self._text(text)
                continue
            kind, marker_text = marker
            head = text[: len(text) - len(marker_text)]
            if head:
                self._text(head)
            self._marker(kind, marker_text)

    def finish(self) -> None:
        if self._phase != _NONE:
            self._end_call(closed=False)
        if self._section:
            self._close_section("")
        self._content.finish(calls=self.calls)

    def drain(self) -> tuple[str, list[ToolDelta]]:
        deltas = self._deltas
        self._deltas = []
        return self._content.drain(), deltas

    # -- markers ------------------------------------------------------------

    def _marker(self, kind: int, text: str) -> None:
        in_call = self._phase != _NONE
        if kind == _SEP and in_call:
            self._separator(text)
        elif kind == _STRAY:
            if in_call:
                self._text(text)
        elif not self._section:
            if kind == _CALLS_BEGIN:
                self._open_section()
            else:
                self._outside(text)  # a call marker outside a section is text (vLLM: no section, no calls)
        elif kind == _CALL_BEGIN:
            if in_call:
                self._end_call(closed=False)
            self._start_call()
        elif kind == _CALL_END:
            if in_call:
                if not self._header_sent:
                    self._raw.append(text)
                self._end_call(closed=True)
        elif kind == _CALLS_END:
            if in_call:
                self._end_call(closed=False)
            self._close_section(text)
        elif kind == _SEP:
            self._outside(text)
        elif in_call:  # a second section opening inside a call ends the call
            self._end_call(closed=False)

    def _open_section(self) -> None:
        self._section = True
        self._section_called = False
        self._pending = [*self._content.take_held(), CALLS_BEGIN]

    def _close_section(self, marker: str) -> None:
        self._section = False
        if self._pending:
            # Nothing but whitespace since the opening (issue #27): markup, not text. The space
            # before the section goes back to content, held as it was.
            lead = self._pending[: self._pending.index(CALLS_BEGIN)]
            self._pending = []
            if lead:
                self._content.add("".join(lead))
            return
        if marker and not self._section_called:
            self._content.add(marker)

    def _release_pending(self) -> None:
        """The section made no call (yet): its opening is the model's text after all."""
        if self._pending:
            self._content.add("".join(self._pending))
            self._pending = []

    # -- text -----------------------------------------------------------------

    def _text(self, text: str) -> None:
        if self._phase == _NONE:
            self._outside(text)
            return
        if not self._header_sent:
            self._raw.append(text)
        self._call_text(text)

    def _outside(self, text: str) -> None:
        if self._pending:
            if text.isspace():
                self._pending.append(text)  # still an empty section, so far
                return
            self._release_pending()
        self._content.add(text)

    def _call_text(self, text: str) -> None:
        phase = self._phase
        if phase == _ARGS:
            if self._fenced:
                self._fenced_arguments(text)
            else:
                self._emit(text)
        elif phase == _NAME:
            if not self._fenced:
                self._name.append(text)
                return
            cut = text.find("\n")
            if cut < 0:
                self._name.append(text)
                return
            self._name.append(text[:cut])
            self._end_name()
            self._phase = _FENCE
            if cut + 1 < len(text):
                self._fence(text[cut + 1 :])
        elif phase == _FENCE:
            self._fence(text)

    def _fence(self, text: str) -> None:
        """V3: the opening "```json\\n" (held until it is whole); without one, the text is the arguments."""
        seen = self._held + text
        if FENCE_OPEN.startswith(seen):
            if len(seen) < len(FENCE_OPEN):
                self._held = seen
                return
            seen = ""
        elif seen.startswith(FENCE_OPEN):
            seen = seen[len(FENCE_OPEN) :]
        self._held = ""
        self._phase = _ARGS
        if seen:
            self._fenced_arguments(seen)

    def _fenced_arguments(self, text: str) -> None:
        """V3: stream the JSON, holding back a trailing "\\n" + backticks that may close the fence."""
        seen = self._held + text if self._held else text
        end = seen.find(FENCE_CLOSE)
        if end >= 0:
            self._held = ""
            self._emit(seen[:end])
            self._phase = _TAIL  # what follows the fence up to the call's end marker is not the call's
            return
        cut = seen.rfind("\n")
        if cut >= 0 and FENCE_CLOSE.startswith(seen[cut:]):
            self._held = seen[cut:]
            seen = seen[:cut]
        else:
            self._held = ""
        self._emit(seen)

    def _separator(self, text: str) -> None:
        if self._phase == _TYPE:
            self._raw.append(text)
            self._phase = _NAME
        elif self._phase == _NAME and not self._fenced:
            self._raw.append(text)
            self._end_name()
            self._phase = _ARGS
        else:
            self._text(text)

    # -- calls ----------------------------------------------------------------

    def _start_call(self) -> None:
        self._space = self._content.take_held()
        self._raw = [CALL_BEGIN]
        self._name = []
        self._held = ""
        self._header_sent = False
        self._has_arguments = False
        self._index = -1
        self._phase = _TYPE if self._fenced else _NAME

    def _end_name(self) -> None:
        name = "".join(self._name).strip()
        self._name = []
        if not name:
            return  # no name, no call: its text goes back to content when it ends
        self._header_sent = True
        self._section_called = True
        self._pending = []
        if self.calls and not self._options.parallel_tool_calls:
            return  # parallel_tool_calls=false keeps the first call only
        self._index = self.calls
        self.calls += 1
        self._deltas.append(ToolDelta(index=self._index, id=self._options.new_id(), name=name))

    def _emit(self, arguments: str) -> None:
        if not arguments:
            return
        self._has_arguments = True
        if self._index >= 0:
            self._deltas.append(ToolDelta(index=self._index, arguments=arguments))

    def _end_call(self, *, closed: bool) -> None:
        if self._phase == _NAME and self._fenced and closed:
            self._end_name()  # V3 `NAME<call end>`: a call written without its JSON block
        self._held = ""  # only ever a prefix of a fence: markup, not arguments
        self._phase = _NONE
        raw = self._raw
        self._raw = []
        if not self._header_sent:
            self._release_pending()
            self._content.add("".join(self._space + raw))
            return
        if self._index >= 0 and closed and not self._has_arguments:
            self._deltas.append(ToolDelta(index=self._index, arguments="{}"))


REASONING_R1 = ReasoningFactory("deepseek_r1", _bind_r1, format_reasoning)
REASONING_V3 = ReasoningFactory("deepseek_v3", _bind_v3_reasoning, format_reasoning)
TOOLS_V3 = ToolFactory("deepseek_v3", bind_v3, format_calls_v3, forced_prefix_v3)
TOOLS_V31 = ToolFactory("deepseek_v31", bind_v31, format_calls_v31, forced_prefix_v31)
