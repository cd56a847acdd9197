"""MiniMax M2.x tool calls and reasoning (vLLM `minimax_m2`, and the `minimax_m2_append_think` variant).

The format, as MiniMax-M2 / M2.1 / M2.5 write it::

    <think>
    reasoning
    </think>

    Some text.
    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

`<think>`, `</think>`, `<minimax:tool_call>` and `</minimax:tool_call>` are
single tokens (matched by id + text); `<invoke name=`, the name's closing
`">`, `</invoke>` and the parameter tags are plain text spanning tokens,
matched in text with only a possible partial tag held back (released at
`finish()`).

Reasoning is `think.ThinkSyntax`: the chat template opens `<think>` in the
prompt, so a generation turn without a marker starts in reasoning (vLLM
ignores `enable_thinking` here); a `<minimax:tool_call>` ends it, and trailing
whitespace of the reasoning is dropped, as vLLM's grammar does.

States of one choice's tool parsing: vLLM 0.32's `minimax_m2` ParserEngine
grammar (`vllm/parser/minimax_m2.py`), with onehop's recoveries marked *::

    CONTENT  --<minimax:tool_call>-->  PREAMBLE     text in PREAMBLE is framing
    CONTENT  --<invoke name=------->   NAME         a bare call, no wrapper
    PREAMBLE --<invoke name=------->   NAME
    PREAMBLE --</minimax:tool_call>->  CONTENT      * never a call: the block is content
    NAME     --'>'------------------>  ARGS         the name (one closing quote dropped)
    NAME     --'>' (unknown name)--->  SKIP         * vLLM drops the call; onehop keeps its text
    ARGS     --</invoke>------------>  BETWEEN      * a bare call goes back to CONTENT
    ARGS     --</minimax:tool_call>->  CONTENT      * between parameters: </invoke> was missing
    SKIP     --</invoke>------------>  BETWEEN      * the invoke's text is given back as content
    BETWEEN  --</minimax:tool_call>->  CONTENT      text in BETWEEN is framing
    BETWEEN  --<invoke name=------->   NAME

`<invoke name=` may be followed by `"`, `'` or nothing; the name ends at the
first `>`. A name is a call only if the request offered a tool of that name
(vLLM's `validate_tool_names`). A `</minimax:tool_call>` in CONTENT and a
`</think>` there are dropped, as in vLLM.

In ARGS, `<parameter name="K">` (or `'K'`, or a bare `K`; whitespace inside
the tag as vLLM's regex allows) opens a value that ends at `</parameter>`,
before the next `<parameter name=`, or at `</invoke>`. Values are kept
verbatim (no newline trimming: MiniMax writes them inline) and typed by the
tool's schema (`typed_values`), written by `xml_args.ArgsJson`; text between
parameters is dropped, as in vLLM. Inside a value the two marker tokens are
text, as in vLLM.

Where vLLM 0.32 loses text or writes invalid JSON, onehop keeps what the
model wrote (tests/vllm/parity_cases/minimax_m2.py pins each case):
- a block that never makes a call, and an invoke of a function the request did
  not offer, are given back as content (vLLM drops them);
- text after a bare call's `</invoke>` is content (vLLM drops it);
- a marker between parameters ends the call (vLLM reads on as arguments);
- a value still open when the call ends is kept as far as it arrived and
  closed, so the fragments always join to valid JSON;
- content is not stripped when calls were made (vLLM strips it non-streamed
  only; a stream cannot take back what it sent);
- a prompt that closes `<think>` starts in content (vLLM's non-streamed
  answer reads the output as reasoning all the same).
With `parallel_tool_calls=false` only the first call is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from derender.parsers.base import (
    BoundReasoning,
    Markers,
    ParseOptions,
    ReasoningFactory,
    ReasoningParser,
    ToolCallText,
    ToolFactory,
)
from derender.parsers.think import BoundThink, ThinkSyntax
from derender.parsers.xml_args import NO, PARTIAL, WS, match_tag
from derender.parsers.xml_calls import (
    ARGS,
    BETWEEN,
    CONTENT,
    NAME,
    PREAMBLE,
    BoundXmlCalls,
    XmlCallParser,
    written_value,
)
from derender.stop import Piece
from derender.vocab import TokenVocab

START = "<minimax:tool_call>"
END = "</minimax:tool_call>"
INVOKE = "<invoke name="
INVOKE_END = "</invoke>"
PARAM_END = "</parameter>"
THINK_START = "<think>"
THINK_END = "</think>"
TURN_START = "]~b]"
"""The special token that opens a chat turn (`]~b]ai` for the assistant)."""

THINK = ThinkSyntax(
    start=THINK_START,
    end=THINK_END,
    turn_start=TURN_START,
    default_reasoning=True,
    strip_trailing_space=True,
    count_specials=False,
)

_SKIP = BETWEEN + 1  # the one state MiniMax adds to the shared ones (xml_calls)
_QUOTES = "\"'"
# vLLM's `<\s*/\s*parameter\s*>`, and `<\s*parameter\s+name\s*=\s*` split at its `\s+`.
_CLOSE_TAG = ("<", WS, "/", WS, "parameter", WS, ">")
_OPEN_HEAD = ("<", WS, "parameter")
_OPEN_TAIL = ("name", WS, "=", WS)
_INVOKE_END_TAG = (INVOKE_END,)


# -- reasoning ---------------------------------------------------------------------


def bind_reasoning(vocab: TokenVocab) -> BoundThink:
    return BoundThink(vocab, THINK)


def format_reasoning(text: str) -> str:
    """A reasoning block as MiniMax writes it after the template's `<think>\\n`."""
    return f"{text}\n{THINK_END}\n\n"


class BoundAppendThink(BoundReasoning):
    """`minimax_m2_append_think`: no reasoning split; the content is the whole output with the
    template's `<think>` put back in front (for clients that parse the tags themselves)."""

    def __init__(self, vocab: TokenVocab) -> None:
        self.markers = Markers(vocab, ())

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int], options: ParseOptions) -> bool:
        return False

    def new(self, options: ParseOptions, *, in_reasoning: bool, tool_starts: Mapping[int, str]) -> ReasoningParser:
        return AppendThink()


class AppendThink(ReasoningParser):
    __slots__ = ("_started", "reasoning_tokens")

    def __init__(self) -> None:
        self._started = False
        self.reasoning_tokens = 0

    def feed(self, pieces: Sequence[Piece], reasoning: list[str]) -> Sequence[Piece]:
        if self._started or not pieces:
            return pieces
        self._started = True
        return [(THINK_START, -1), *pieces]


# -- tool calls ----------------------------------------------------------------------


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """How MiniMax writes calls: one block, one invoke per call, strings raw, other values as JSON."""
    invokes = "".join(_format_invoke(call) for call in calls)
    return f"{START}\n{invokes}{END}"


def _format_invoke(call: ToolCallText) -> str:
    params = "".join(
        f'<parameter name="{key}">{written_value(value)}{PARAM_END}\n' for key, value in call.arguments.items()
    )
    return f'{INVOKE}"{call.name}">\n{params}{INVOKE_END}\n'


def forced_prefix(name: str | None) -> str:
    """Named: the call is opened past its name, so the model writes only parameters;
    "required": up to the name."""
    if name is None:
        return f'{START}\n{INVOKE}"'
    return f'{START}\n{INVOKE}"{name}">\n'


class MinimaxToolParser(XmlCallParser):
    __slots__ = ("_invoke", "_named", "_offered")

    _START = START
    _END = END
    _TRIM = False  # MiniMax writes values inline: no newline framing

    def __init__(self, markers: Markers, options: ParseOptions, *, strays: Mapping[int, str]) -> None:
        super().__init__(markers, options, strays=strays)
        self._offered = frozenset(tool.name for tool in options.tools)
        self._invoke: list[str] | None = None  # the invoke's text while its name is not accepted
        self._named = False  # the open value has a name (vLLM drops one without)

    def _take_marker(self, marker: str) -> None:
        if marker == END and self._state == CONTENT:
            if self._after_bare:
                self._after_bare = False  # it closes a bare call: the whitespace before it was framing
                self._content.take_held()
            return  # a stray end marker is dropped, as in vLLM
        self._record(marker)
        self._close_call()
        if marker == START and self._state in (PREAMBLE, BETWEEN):
            return  # a second opening inside a block is framing, as in vLLM
        self._after_bare = False
        self._end_block()
        if marker == START:
            self._begin_block()

    def _close_call(self) -> None:
        if self._state == NAME:
            self._name_done()
        if self._state in (ARGS, _SKIP):
            self._end_call()

    def _record(self, text: str) -> None:
        if self._raw is not None:
            self._raw.append(text)
        if self._invoke is not None:
            self._invoke.append(text)

    # -- state handlers: each reads text from `pos`, returns where it stopped --------

    def _on_content(self, text: str, pos: int) -> int:
        at, after = self._find_invoke(text, pos)
        self._add_content(text[pos:at])
        if after >= 0:
            self._raw = [*self._content.take_held()]
            self._bare = True
            self._after_bare = False
            self._begin_invoke(text[at:after])
            return after
        return at

    def _on_framing(self, text: str, pos: int) -> int:
        """PREAMBLE and BETWEEN: wait for `<invoke name=`; other text is framing."""
        at, after = self._find_invoke(text, pos)
        self._record(text[pos:at])
        if after >= 0:
            self._begin_invoke(text[at:after])
            return after
        return at

    def _find_invoke(self, text: str, pos: int) -> tuple[int, int]:
        """(where `<invoke name=` starts, where its name starts) or (`len(text)`, -1);
        sets `_hold` for a partial opening at the end (its quote may still come)."""
        at = text.find("<", pos)
        while at >= 0:
            after = at + len(INVOKE)
            if text.startswith(INVOKE, at):
                if after < len(text):
                    return at, after + 1 if text[after] in _QUOTES else after
                if self._final:
                    return at, after
                self._hold = text[at:]
                return at, -1
            if not self._final and len(text) < after and INVOKE.startswith(text[at:]):
                self._hold = text[at:]
                return at, -1
            at = text.find("<", at + 1)
        return len(text), -1

    def _on_name(self, text: str, pos: int) -> int:
        close = self._read_name(text, pos)
        if close < 0:
            return len(text)
        self._name_done()
        return close + 1

    def _on_outside(self, text: str, pos: int) -> int:
        """Between parameters: wait for a parameter's opening tag or `</invoke>`; other text is dropped."""
        at = text.find("<", pos)
        while at >= 0:
            end, name = _open_tag(text, at, final=self._final)
            if end >= 0:
                self._open_value(name)
                return end
            invoke_end = match_tag(text, at, _INVOKE_END_TAG)
            if invoke_end >= 0:
                self._end_call()
                return invoke_end
            if not self._final and PARTIAL in (end, invoke_end):
                self._hold = text[at:]
                return at
            at = text.find("<", at + 1)
        return len(text)

    def _on_value(self, text: str, pos: int) -> int:
        """In a value: it ends at `</parameter>`, before the next parameter's opening, or at `</invoke>`."""
        at = text.find("<", pos)  # hot path: long values stream through here, run by run
        while at >= 0:
            close = match_tag(text, at, _CLOSE_TAG)
            opening = _open_head(text, at) if close < 0 else NO
            invoke_end = match_tag(text, at, _INVOKE_END_TAG) if close < 0 and opening < 0 else NO
            if close >= 0 or opening >= 0 or invoke_end >= 0:
                self._value_text(text[pos:at])
                self._close_value(complete=invoke_end < 0)
                if invoke_end >= 0:
                    self._end_call()
                    return invoke_end
                return close if close >= 0 else at
            if not self._final and PARTIAL in (close, opening, invoke_end):
                self._value_text(text[pos:at])
                self._hold = text[at:]
                return at
            at = text.find("<", at + 1)
        self._value_text(text[pos:])
        return len(text)

    def _on_skip(self, text: str, pos: int) -> int:
        """An invoke whose name was not offered: its text is kept until `</invoke>`."""
        at = text.find(INVOKE_END, pos)
        if at >= 0:
            self._record(text[pos : at + len(INVOKE_END)])
            self._end_call()
            return at + len(INVOKE_END)
        cut = _partial_suffix(text, pos, INVOKE_END) if not self._final else len(text)
        self._record(text[pos:cut])
        if cut < len(text):
            self._hold = text[cut:]
        return cut

    # -- calls -----------------------------------------------------------------------

    def _begin_invoke(self, opening: str) -> None:
        self._record(opening)
        self._invoke = [opening]
        self._state = NAME
        self._name.clear()
        self._args = None
        self._in_value = False

    def _name_done(self) -> None:
        """The name is complete (its `>` came, or the output ended): a call if it was offered."""
        name = "".join(self._name)
        self._name.clear()
        if name and name[-1] in _QUOTES:
            name = name[:-1]
        name = name.strip()
        if name and (name in self._offered or not self._offered):
            self._invoke = None
            self._send_header(name)
            self._state = ARGS
        else:
            self._state = _SKIP

    def _open_value(self, name: str) -> None:
        """A value opens; one without a name is read to its end and dropped, as vLLM does."""
        self._in_value = True
        self._named = bool(name)
        if self._args is not None and name:
            self._args.open(name)

    def _value_text(self, text: str) -> None:
        if text and self._named and self._args is not None:
            self._args.value(text)

    def _close_value(self, *, complete: bool) -> None:
        self._in_value = False
        if self._named and self._args is not None:
            self._args.close(complete=complete)

    def _end_call(self) -> None:
        """`</invoke>` (or what stands for it): close the JSON; an invoke that made no call
        gives its text back now if bare or after an earlier call, else at the end of its block."""
        self._finish_args()
        invoke = self._invoke
        self._invoke = None
        if invoke and self._raw is None:
            self._add_content("".join(invoke))
        self._leave_call()

    _HANDLERS = (_on_content, _on_framing, _on_name, XmlCallParser._on_args, _on_framing, _on_skip)


class BoundMinimaxTools(BoundXmlCalls):
    _parser = MinimaxToolParser


def _open_head(text: str, at: int) -> int:
    """End of `<\\s*parameter\\s+name\\s*=\\s*` at `text[at]`, `PARTIAL` or `NO`."""
    head = match_tag(text, at, _OPEN_HEAD)
    if head < 0:
        return head
    spaced = match_tag(text, head, (WS,))
    if spaced == head:
        return PARTIAL if head == len(text) else NO
    return match_tag(text, spaced, _OPEN_TAIL)


def _open_tag(text: str, at: int, *, final: bool) -> tuple[int, str]:
    """(end, name) of a whole parameter opening tag at `text[at]`, or (`PARTIAL` | `NO`, "").

    The name is `"..."`, `'...'` or a run without `>` and whitespace, then `\\s*>`; it is
    stripped (an empty one names no parameter)."""
    pos = _open_head(text, at)
    if pos < 0:
        return pos, ""
    if pos == len(text):
        return (NO if final else PARTIAL), ""
    quote = text[pos]
    if quote in _QUOTES:
        close = text.find(quote, pos + 1)
        if close < 0:
            return (NO if final else PARTIAL), ""
        name, after = text[pos + 1 : close], close + 1
    else:
        after = pos
        while after < len(text) and text[after] != ">" and match_tag(text, after, (WS,)) == after:
            after += 1
        name = text[pos:after]
        if not name:
            return NO, ""
    end = match_tag(text, after, (WS, ">"))
    if end == PARTIAL and final:
        end = NO
    return end, name.strip() if end >= 0 else ""


def _partial_suffix(text: str, pos: int, tag: str) -> int:
    """Where a possible start of `tag` at the end of `text` begins (`len(text)` if none)."""
    at = text.rfind("<", max(pos, len(text) - len(tag) + 1))
    if at >= 0 and tag.startswith(text[at:]):
        return at
    return len(text)


REASONING = ReasoningFactory("minimax_m2", bind_reasoning, format_reasoning)
APPEND_THINK = ReasoningFactory("minimax_m2_append_think", BoundAppendThink, None)
TOOLS = ToolFactory("minimax_m2", BoundMinimaxTools, format_calls, forced_prefix)
