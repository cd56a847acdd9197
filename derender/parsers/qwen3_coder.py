"""Qwen3-Coder XML tool calls (vLLM `qwen3_coder`, alias `qwen3_xml`).

The format, as Qwen3-Coder and Qwen3.5+ write it::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

`<tool_call>` / `</tool_call>` are single tokens (matched by id + text);
`<function=`, `>`, `<parameter=`, `</parameter>` and `</function>` are plain
text spanning tokens, matched in text with only a possible partial tag held
back (released at `finish()`).

States of one choice: vLLM 0.32's `qwen3` ParserEngine grammar
(`vllm/parser/qwen3.py`), with onehop's recoveries marked *::

    CONTENT  --<tool_call>-->  PREAMBLE      text in PREAMBLE is framing
    CONTENT  --<function=--->  NAME          a bare call, no <tool_call>
    PREAMBLE --<function=--->  NAME
    PREAMBLE --</tool_call>->  CONTENT       * never a call: the block is content
    NAME     --'>'----------->  ARGS          header: the name, stripped
    NAME     --</function>--->  BETWEEN       a call with that name and {}
    ARGS     --</function>--->  BETWEEN       * a bare call goes back to CONTENT
    ARGS     --</tool_call>-->  CONTENT       * between parameters: </function> was missing
    BETWEEN  --</tool_call>-->  CONTENT       text in BETWEEN is framing
    BETWEEN  --<tool_call>--->  PREAMBLE      BETWEEN --<function=--> NAME

A `<tool_call>` token where a call is open starts the next block; inside a
value both markers are text, as in vLLM. A `</tool_call>` right after a bare
call is dropped with the whitespace before it (vLLM's TOOL_BETWEEN).

In ARGS, `<parameter=NAME>` opens a value that ends at `</parameter>`, before
the next `<parameter=`, or at `</function>`, with one leading and one
trailing newline trimmed (the template's framing); whitespace inside the tags
is allowed and a name keeps trailing spaces, as vLLM's regex has it. Text
between parameters is dropped, as in vLLM. The arguments stream as JSON
written by `ArgsJson`, equal to `json.dumps` of vLLM's final arguments:
string-only values (and values the schema does not type) stream as they
arrive, other values are written once complete, typed by the tool's schema
(`typed_values`). Unknown function names are calls, with string values.

Where vLLM 0.32 loses text or writes invalid JSON, onehop keeps what the
model wrote (tests/vllm/parity_cases/qwen3_coder.py pins each case against
vLLM's two answers):
- a `<tool_call>` block that never names a function is given back as content;
- text after a bare call's `</function>` is content (vLLM drops it);
- `</tool_call>` or `<tool_call>` between parameters ends the call (vLLM
  reads everything after a missing `</function>` as arguments);
- a value still open when the call ends (max_tokens, a stop string, a
  missing `</parameter>`) is kept as far as it arrived and closed, so the
  fragments always join to valid JSON (vLLM streams the cut string unclosed
  and its non-streamed answer drops the value); a value cut before any of
  its text arrived leaves nothing;
- a parameter given twice is written twice: the JSON parses to vLLM's
  answer (first position, last value) without retracting streamed text.
With `parallel_tool_calls=false` only the first call is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from derender.parsers.base import ToolCallText, ToolFactory
from derender.parsers.xml_args import NO, PARTIAL, WS, match_tag
from derender.parsers.xml_calls import ARGS, CONTENT, NAME, BoundXmlCalls, XmlCallParser, written_value

START = "<tool_call>"
END = "</tool_call>"
FUNC = "<function="
FUNC_END = "</function>"
PARAM = "<parameter="
PARAM_END = "</parameter>"

# vLLM's `<\s*/\s*parameter\s*>` and `<\s*parameter\s*=\s*`; `</function>` is a lexer literal.
_CLOSE_TAG = ("<", WS, "/", WS, "parameter", WS, ">")
_OPEN_TAG = ("<", WS, "parameter", WS, "=", WS)
_FUNC_END_TAG = (FUNC_END,)


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """How Qwen3-Coder writes calls: one block per call, strings raw, other values as JSON."""
    return "\n".join(_format_call(call) for call in calls)


def _format_call(call: ToolCallText) -> str:
    params = "".join(f"{PARAM}{key}>\n{written_value(value)}\n{PARAM_END}\n" for key, value in call.arguments.items())
    return f"{START}\n{FUNC}{call.name}>\n{params}{FUNC_END}\n{END}"


def forced_prefix(name: str | None) -> str:
    """Named: the call is opened past its name, so the model writes only parameters;
    "required": up to the name."""
    if name is None:
        return f"{START}\n{FUNC}"
    return f"{START}\n{FUNC}{name}>\n"


class Qwen3CoderParser(XmlCallParser):
    __slots__ = ()

    _START = START
    _END = END
    _TRIM = True

    def _take_marker(self, marker: str) -> None:
        if marker == END and self._state == CONTENT:
            if self._after_bare:
                self._after_bare = False  # closes a bare call, as vLLM's TOOL_BETWEEN does:
                self._content.take_held()  # the whitespace before it was framing
            else:
                self._text(END)
            return
        if marker == END:
            self._record(END)
        self._close_call()
        self._after_bare = False
        self._end_block()
        if marker == START:
            self._begin_block()

    def _close_call(self) -> None:
        if self._state == NAME:
            self._name_done()
            self._end_call()
        elif self._state == ARGS:
            self._end_call()

    def _record(self, text: str) -> None:
        if self._raw is not None and text:
            self._raw.append(text)

    # -- state handlers: each reads text from `pos`, returns where it stopped --------

    def _on_content(self, text: str, pos: int) -> int:
        at = self._find_func(text, pos)
        self._add_content(text[pos:at])
        if at < len(text) and not self._hold:
            self._raw = [*self._content.take_held(), FUNC]
            self._bare = True
            self._after_bare = False
            self._begin_name()
            return at + len(FUNC)
        return at

    def _on_preamble(self, text: str, pos: int) -> int:
        at = self._find_func(text, pos)
        if at < len(text) and not self._hold:
            self._record(text[pos : at + len(FUNC)])
            self._begin_name()
            return at + len(FUNC)
        self._record(text[pos:at])
        return at

    def _on_between(self, text: str, pos: int) -> int:
        at = self._find_func(text, pos)
        if at < len(text) and not self._hold:
            if self._raw is None:
                self._raw = [FUNC]
            else:
                self._record(text[pos : at + len(FUNC)])
            self._begin_name()
            return at + len(FUNC)
        self._record(text[pos:at])
        return at

    def _find_func(self, text: str, pos: int) -> int:
        """Where `<function=` starts (or `len(text)`); sets `_hold` for a partial one at the end."""
        at = text.find("<", pos)
        while at >= 0:
            if text.startswith(FUNC, at):
                return at
            if not self._final and len(text) - at < len(FUNC) and FUNC.startswith(text[at:]):
                self._hold = text[at:]
                return at
            at = text.find("<", at + 1)
        return len(text)

    def _on_name(self, text: str, pos: int) -> int:
        close = self._read_name(text, pos)
        if close < 0:
            return len(text)
        if self._name_done():
            self._end_call()  # `<function=NAME</function>`: vLLM's TOOL_NAME --FUNC_END--> TOOL_BETWEEN
        else:
            self._state = ARGS
            self._in_value = False
        return close + 1

    def _on_outside(self, text: str, pos: int) -> int:
        """Between parameters: wait for `<parameter=NAME>` or `</function>`; other text is dropped."""
        at = text.find("<", pos)
        while at >= 0:
            name_at = match_tag(text, at, _OPEN_TAG)
            if name_at >= 0:
                close = text.find(">", name_at)
                if close >= 0:
                    self._record(text[pos : close + 1])
                    name = text[name_at:close]
                    if name.endswith(FUNC_END[:-1]):
                        self._end_call()  # the lexer sees `</function>` first
                    else:
                        self._open_value(name)
                    return close + 1
                name_at = NO if self._final else PARTIAL
            func_end = match_tag(text, at, _FUNC_END_TAG)
            if func_end >= 0:
                self._record(text[pos:func_end])
                self._end_call()
                return func_end
            if not self._final and PARTIAL in (name_at, func_end):
                return self._hold_from(text, pos, at)
            at = text.find("<", at + 1)
        self._record(text[pos:])
        return len(text)

    def _on_value(self, text: str, pos: int) -> int:
        """In a value: it ends at `</parameter>`, before the next `<parameter=`, or at `</function>`."""
        at = text.find("<", pos)  # hot path: long values stream through here, run by run
        while at >= 0:
            close = match_tag(text, at, _CLOSE_TAG)
            opening = match_tag(text, at, _OPEN_TAG) if close < 0 else NO
            func_end = match_tag(text, at, _FUNC_END_TAG) if close < 0 and opening < 0 else NO
            if close >= 0 or opening >= 0 or func_end >= 0:
                stop = max(close, func_end, at)
                self._record(text[pos:stop])
                self._value_text(text[pos:at])
                self._close_value(complete=func_end < 0)
                if func_end >= 0:
                    self._end_call()
                return stop
            if not self._final and PARTIAL in (close, opening, func_end):
                self._value_text(text[pos:at])
                return self._hold_from(text, pos, at)
            at = text.find("<", at + 1)
        self._record(text[pos:])
        self._value_text(text[pos:])
        return len(text)

    def _hold_from(self, text: str, pos: int, at: int) -> int:
        self._record(text[pos:at])
        self._hold = text[at:]
        return at

    # -- calls -----------------------------------------------------------------------

    def _begin_name(self) -> None:
        self._state = NAME
        self._name.clear()
        self._args = None

    def _name_done(self) -> bool:
        """The name is complete: send the header. True when it ended in `</function`."""
        name = "".join(self._name)
        self._name.clear()
        closed = name.endswith(FUNC_END[:-1])
        if closed:
            name = name[: -len(FUNC_END) + 1]
        name = name.strip()
        if name:
            self._send_header(name)
        return closed

    def _open_value(self, name: str) -> None:
        self._in_value = True
        if self._args is not None:
            self._args.open(name)

    def _value_text(self, text: str) -> None:
        if text and self._args is not None:
            self._args.value(text)

    def _close_value(self, *, complete: bool) -> None:
        self._in_value = False
        if self._args is not None:
            self._args.close(complete=complete)

    def _end_call(self) -> None:
        """`</function>` (or what stands for it): close the JSON; a call that never got a
        name gives its text back now if bare, at the end of its block if wrapped."""
        self._finish_args()
        self._leave_call()

    _HANDLERS = (_on_content, _on_preamble, _on_name, XmlCallParser._on_args, _on_between)


class BoundQwen3Coder(BoundXmlCalls):
    _parser = Qwen3CoderParser


FACTORY = ToolFactory("qwen3_coder", BoundQwen3Coder, format_calls, forced_prefix)
"""Registered as `qwen3_coder` and, as in vLLM, `qwen3_xml`."""
