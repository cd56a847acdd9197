"""Pythonic tool calls: a Python list of calls (vLLM `pythonic`, and `llama4_pythonic`).

Llama 3.2 and Llama 4 write every call of a turn as one Python list, with
keyword arguments whose values are Python literals::

    [get_weather(city="Paris", days=2), get_time(tz='UTC')]

and Llama 4 may wrap it as `<|python_start|>[...]<|python_end|>` (special
tokens; `llama4_pythonic` drops them). vLLM re-parses the whole text with
`ast` on every chunk; here one character scanner reads each piece once and
streams a call's header as soon as its opening is certain and its JSON
arguments as the values arrive (O(delta)). String values stream as they are
read, escapes decoded; other values (numbers, `True`, lists, dicts, prefixed
or triple-quoted strings) are held until they end and then read once with
`ast` under vLLM's rules (`True`/`None` and `true`/`null`, tuples and sets as
lists, `-1`). States of the list scanner::

    LEAD --`[`-----> CALL              (anything else: the whole output is content)
    CALL --name----> NAME --`(`--> ARG
    ARG  --key-----> KEY --`=`--> VALUE ---> STRING | HELD ---> NEXT
    ARG | NEXT --`)`--> SEP --`,`--> CALL;  SEP --`]`--> AFTER (content)
    NEXT --`,`--> ARG

vLLM's non-streamed answer takes a call list only when the output starts with
`[NAME(KEY=` or `[NAME()` exactly (its regex), so the first call opens only
so; later calls may be spaced and dotted as Python allows. A call's header is
sent once its first value proved good (a string opened, a literal read) or at
its `)`: `[get_weather(city=Paris)]` is no call, all of it is content. Until
text is spoken for by a delta it is kept, to be given back as content if the
list breaks. What vLLM does not do, each because it loses text or can only
know at the end (see the parity tests): a string value holding a raw line
break is read as written; text after the list is content; a list left open
keeps its calls; a list that breaks after a call was announced (`days=1 + 2`,
`get_time(UTC)`) keeps that call, its arguments closed after the last
complete value, and the text from the break on is content. A break before any
header makes the whole output content, as vLLM's full answer has it. A list
cut by the output's end keeps its open call; a held value cut before it could
be read is left out, and the chat choice closes the arguments (`json_close`).
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from derender.parsers.base import (
    BoundTools,
    Markers,
    ParseOptions,
    ToolCallText,
    ToolDelta,
    ToolFactory,
    ToolParser,
)
from derender.parsers.content import ContentText
from derender.stop import Piece
from derender.vocab import TokenVocab

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"

_QUOTES = "'\""
_STRING_STOP = {"'": re.compile(r"['\\]"), '"': re.compile(r'["\\]')}
_HELD_STOP = re.compile(r"""['"()\[\]{},]""")  # what a held value's end depends on, outside strings
_JSON_ESCAPED = re.compile(r'["\\\x00-\x1f]')  # what `json.dumps` escapes with ensure_ascii=False
_SIMPLE_ESCAPES = {
    "\\": "\\",
    "'": "'",
    '"': '"',
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\n": "",  # a line continuation
}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_OCTAL = frozenset("01234567")
_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}
_SURROGATE = re.compile("[\ud800-\udfff]")
_WORDS = {"True": "true", "False": "false", "None": "null", "true": "true", "false": "false", "null": "null"}
_INTEGER = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+(?=[eE]))(?:[eE][-+]?[0-9]+)?")

# Scanner states (see the module docstring).
(
    _LEAD,
    _CONTENT,
    _AFTER,
    _CALL,
    _NAME,
    _ARG,
    _KEY,
    _EQ,
    _VALUE,
    _QUOTE1,
    _QUOTE2,
    _STRING,
    _ESCAPE,
    _CLOSED,
    _HELD,
    _NEXT,
    _SEP,
) = range(17)


class BadValue(ValueError):
    """A held argument value that is not a literal vLLM maps to JSON."""


# -- values -----------------------------------------------------------------------


def literal_json(source: str) -> str:
    """The JSON text of one complete Python literal, or `BadValue`."""
    text = source.strip()
    word = _WORDS.get(text)
    if word is not None:
        return word
    if _INTEGER.fullmatch(text):  # numbers and words skip `ast` (~15 µs a value): the common case
        return str(int(text))
    if _FLOAT.fullmatch(text):
        return json.dumps(float(text))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `'\d'` warns in `ast` and is still a string
        try:
            node = ast.parse(source.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            raise BadValue(source) from exc
    try:
        value = _value(node)
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:  # `{b'k': 1}`, nesting too deep
        raise BadValue(source) from exc
    # Surrogate halves (`'\ud83d\ude00'`) cannot be encoded as text: JSON escapes pair them up.
    return json.dumps(value) if _SURROGATE.search(text) else text


def _value(node: ast.expr) -> Any:
    """vLLM's reading of an argument's AST (`get_parameter_value`), written here."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
        raise BadValue(ast.dump(node))
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) for key in node.keys):
            raise BadValue(ast.dump(node))
        pairs = zip(node.keys, node.values, strict=True)
        return {key.value: _value(value) for key, value in pairs if isinstance(key, ast.Constant)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in node.values):
        return "".join(str(part.value) for part in node.values if isinstance(part, ast.Constant))
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise BadValue(ast.dump(node))


def _escape_text(sequence: str) -> str:
    """The text of an escape sequence (what follows its backslash); Python's reading, or as written."""
    simple = _SIMPLE_ESCAPES.get(sequence)
    if simple is not None:
        return simple
    head = sequence[0]
    try:
        if head in _HEX_DIGITS and len(sequence) == _HEX_DIGITS[head] + 1:
            return chr(int(sequence[1:], 16))
        if head in _OCTAL:
            return chr(int(sequence, 8))
        if head == "N" and sequence.startswith("N{") and sequence.endswith("}"):
            return unicodedata.lookup(sequence[2:-1])
    except (ValueError, KeyError, OverflowError):
        pass
    return "\\" + sequence  # unknown or malformed: kept with its backslash (Python keeps unknown ones)


def _escape_ends_before(sequence: str, char: str, quote: str) -> bool:
    """Whether an unfinished escape sequence ends before `char` (which is then read as text)."""
    head = sequence[0]
    if head in _HEX_DIGITS:
        return char not in "0123456789abcdefABCDEF"
    if head in _OCTAL:
        return char not in _OCTAL
    return char == quote or char == "\\"  # `\N{...`: never past the string's end


def _escape_complete(sequence: str) -> bool:
    head = sequence[0]
    if head in _HEX_DIGITS:
        return len(sequence) == _HEX_DIGITS[head] + 1
    if head in _OCTAL:
        return len(sequence) == 3
    if head == "N":
        return len(sequence) > 1 and (sequence[1] != "{" or sequence.endswith("}"))
    return True


def _json_chars(text: str) -> str:
    """Text as it goes inside a JSON string; a surrogate half (`\\ud83d`) as its JSON escape, which
    pairs up with the next one where a client decodes the arguments."""
    if _JSON_ESCAPED.search(text) is None:
        if len(text) == 1 and "\ud800" <= text <= "\udfff":
            return f"\\u{ord(text):04x}"
        return text  # most runs: no call into `json` (hot path)
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _python(value: Any) -> str:
    """A JSON value as a Python literal (the writer's side)."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_python(str(k))}: {_python(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    return repr(value)


def format_calls(calls: Sequence[ToolCallText]) -> str:
    """How Llama 3.2 / 4 write calls: one Python list, keyword arguments as Python literals."""
    written = (f"{c.name}({', '.join(f'{k}={_python(v)}' for k, v in c.arguments.items())})" for c in calls)
    return f"[{', '.join(written)}]"


def forced_prefix(name: str | None) -> str:
    """Named: the list and the call are opened, the model writes the arguments; "required": `[`."""
    return "[" if name is None else f"[{name}("


# -- binding ----------------------------------------------------------------------


class BoundPythonic(BoundTools):
    """`wrapped`: Llama 4's `<|python_start|>` / `<|python_end|>` are dropped around the list."""

    def __init__(self, vocab: TokenVocab, *, wrapped: bool = False) -> None:
        texts = tuple(t for t in (PYTHON_START, PYTHON_END) if wrapped and vocab.token_id(t) is not None)
        self.markers = Markers(vocab, texts)
        self.starts: Mapping[int, str] = {}  # the list opens with `[`, plain text: nothing ends reasoning
        self._start = self.markers.get(PYTHON_START)
        self._end = self.markers.get(PYTHON_END)

    def new(self, options: ParseOptions, *, strays: Mapping[int, str]) -> ToolParser:
        return PythonicParser(options, start=self._start, end=self._end, strays=strays)


def bind_llama4(vocab: TokenVocab) -> BoundPythonic:
    return BoundPythonic(vocab, wrapped=True)


def _is_marker(text: str, marker: str) -> str | None:
    """The text before a marker piece's marker (a skipped special token has none), else None."""
    if text.endswith(marker):
        return text[: len(text) - len(marker)]
    return "" if not text else None


# -- the parser -------------------------------------------------------------------


class PythonicParser(ToolParser):
    __slots__ = (
        "_args",
        "_content",
        "_deltas",
        "_depth",
        "_end",
        "_escape",
        "_header",
        "_held",
        "_index",
        "_key",
        "_lead",
        "_mark",
        "_members",
        "_name",
        "_opened",
        "_opening",
        "_options",
        "_quote",
        "_raw",
        "_run",
        "_start",
        "_state",
        "_strays",
        "_triple",
        "calls",
    )

    def __init__(self, options: ParseOptions, *, start: int, end: int, strays: Mapping[int, str]) -> None:
        self._options = options
        self._start = start
        self._end = end
        self._strays = strays
        self._content = ContentText()
        self._deltas: list[ToolDelta] = []
        self._state = _LEAD
        self._raw: list[str] = []  # list text of earlier pieces not yet spoken for by deltas
        self._mark = 0  # where such text starts in the piece being scanned
        self._name: list[str] = []
        self._key: list[str] = []
        self._held: list[str] = []  # a held value's text, or a streamed string's escape sequence
        self._quote = ""  # the open string's quote
        self._escape = False  # held value: the next character is escaped
        self._depth = 0  # held value: bracket depth
        self._triple = False  # held value: the open string is triple-quoted
        self._opening = 0  # held value: quotes in a row that opened a string (empty or triple?)
        self._run = 0  # held value: quotes in a row inside a triple-quoted string
        self._index = -1  # the open call's index; -1 when it is not streamed
        self._header = False  # the open call's header was sent
        self._members = 0  # arguments written in the open call
        self._args: list[str] = []  # argument text for the open call, sent at the end of the piece
        self._opened = False  # a call was closed: later calls need not open as strictly as the first
        self._lead = ""  # `<|python_start|>`'s text opening the output: given back if no list follows
        self.calls = 0

    # -- the ToolParser interface -------------------------------------------------

    def feed(self, pieces: Sequence[Piece]) -> None:
        start, end, strays = self._start, self._end, self._strays
        for text, token_id in pieces:  # hot loop: one iteration per content token
            if token_id >= 0 and token_id in (start, end):
                head = _is_marker(text, PYTHON_START if token_id == start else PYTHON_END)
                if head is not None:
                    self._marker(head, token_id == start, text)
                    continue
            stray = strays.get(token_id)
            if stray is not None and self._state in (_LEAD, _CONTENT, _AFTER) and text.endswith(stray):
                text = text[: len(text) - len(stray)]
            if text:
                self._text(text)

    def finish(self) -> None:
        if self._state not in (_LEAD, _CONTENT, _AFTER):
            self._cut_short(self._state)
        elif self._state == _LEAD and self._lead:
            self._content.add(self._lead)
        self._content.finish(calls=self.calls)

    def drain(self) -> tuple[str, list[ToolDelta]]:
        deltas = self._deltas
        self._deltas = []
        return self._content.drain(), deltas

    # -- dispatch ---------------------------------------------------------------

    def _marker(self, head: str, start: bool, text: str) -> None:
        """Llama 4's wrapper: `<|python_start|>` opening the call list and `<|python_end|>` inside
        or after it are dropped; around text that is no call list they stay (vLLM's full answer)."""
        if head:
            self._text(head)
        state = self._state
        marker = text[len(head) :]
        if start and state == _LEAD:
            self._lead += marker
            return
        if not start and state not in (_LEAD, _CONTENT):
            return
        if marker:
            self._text(marker)

    def _text(self, text: str) -> None:
        state = self._state
        if state in (_CONTENT, _AFTER):
            self._content.add(text)
            return
        self._mark = 0
        if state == _LEAD:
            if text[0] != "[":  # vLLM: a call list only when the output starts with one
                self._state = _CONTENT
                self._content.add(self._lead + text)
                return
            self._state = _CALL
            if self._lead:
                self._raw.append(self._lead)
            self._scan(text, 1)
        else:
            self._scan(text, 0)
        if self._state in (_CONTENT, _AFTER):
            return
        if self._mark < len(text):
            self._raw.append(text[self._mark :])
        self._flush_args()

    def _scan(self, text: str, pos: int) -> None:
        end = len(text)
        while pos < end:  # hot loop over the list's text
            state = self._state
            if state == _STRING:
                pos = self._string(text, pos)
            elif state == _HELD:
                pos = self._held_value(text, pos)
            elif state in (_CONTENT, _AFTER):
                self._content.add(text[pos:])
                return
            elif text[pos].isspace() and self._skips_space(state):
                pos += 1
            else:
                pos = _HANDLERS[state](self, text[pos], text, pos)

    def _skips_space(self, state: int) -> bool:
        """Whitespace between tokens, as Python allows it; vLLM's full answer wants the first call's
        opening `[NAME(KEY=` unspaced."""
        if state in (_EQ, _VALUE, _NEXT, _SEP, _CLOSED):
            return True
        if state == _CALL:
            return self._opened
        return state == _ARG and (self._opened or self._members > 0)

    # -- call names ---------------------------------------------------------------

    def _at_call(self, char: str, text: str, pos: int) -> int:
        if (char.isascii() and char.isalpha()) or (self._opened and (char.isalpha() or char == "_")):
            self._name = [char]
            self._state = _NAME
            return pos + 1
        if char == "]" and self._opened:  # a trailing comma
            return self._close_list(pos)
        return self._break(text, pos)

    def _in_name(self, char: str, text: str, pos: int) -> int:
        last = self._name[-1]
        if char.isalnum() or char == "_" or (char == "." and self._opened and last != "."):
            self._name.append(char)
            return pos + 1
        if char == "(" and last != ".":
            self._state = _ARG
            self._members = 0
            self._header = False
            return pos + 1
        return self._break(text, pos)

    # -- keywords -----------------------------------------------------------------

    def _at_argument(self, char: str, text: str, pos: int) -> int:
        if (char.isascii() and char.isalpha()) or ((self._opened or self._members) and (char.isalpha() or char == "_")):
            self._key = [char]
            self._state = _KEY
            return pos + 1
        if char == ")":
            return self._close_call(pos)
        return self._break(text, pos)  # a positional argument, `**kwargs`, ...

    def _in_key(self, char: str, text: str, pos: int) -> int:
        if char.isalnum() or char == "_":
            self._key.append(char)
            return pos + 1
        if char == "=":
            return self._equals(pos)
        if char.isspace() and (self._opened or self._members):
            self._state = _EQ
            return pos + 1
        return self._break(text, pos)

    def _at_equals(self, char: str, text: str, pos: int) -> int:
        return self._equals(pos) if char == "=" else self._break(text, pos)

    def _equals(self, pos: int) -> int:
        self._state = _VALUE
        return pos + 1

    # -- values -------------------------------------------------------------------

    def _at_value(self, char: str, text: str, pos: int) -> int:
        if char in _QUOTES:
            self._quote = char
            self._state = _QUOTE1
            return pos + 1
        self._start_held("")
        return self._held_value(text, pos)

    def _at_quote1(self, char: str, text: str, pos: int) -> int:
        if char == self._quote:
            self._state = _QUOTE2
            return pos + 1
        self._open_member('"')
        self._commit(pos)
        self._state = _STRING
        return pos

    def _at_quote2(self, char: str, text: str, pos: int) -> int:
        quote = self._quote
        if char == quote:  # three quotes: a triple-quoted string is held whole
            self._start_held(quote * 3)
            self._quote, self._triple = quote, True
            return pos + 1
        self._open_member('"')  # two quotes: an empty string
        self._commit(pos)
        self._state = _CLOSED
        return pos

    def _string(self, text: str, pos: int) -> int:
        """A streamed string value: runs go out JSON-escaped, escapes decoded (a raw line break is kept)."""
        match = _STRING_STOP[self._quote].search(text, pos)
        stop = match.start() if match else len(text)
        if stop > pos:
            self._args.append(_json_chars(text[pos:stop]))
        if match is None:
            self._commit(stop)
            return stop
        if text[stop] == "\\":
            self._held = []
            self._state = _ESCAPE
        else:
            self._state = _CLOSED
        self._commit(stop + 1)
        return stop + 1

    def _in_escape(self, char: str, text: str, pos: int) -> int:
        held = self._held
        if held and _escape_ends_before("".join(held), char, self._quote):
            self._end_escape()
            return pos
        held.append(char)
        self._commit(pos + 1)
        if _escape_complete("".join(held)):
            self._end_escape()
        return pos + 1

    def _end_escape(self) -> None:
        sequence = "".join(self._held)
        self._held = []
        self._args.append(_json_chars(_escape_text(sequence)))
        self._state = _STRING

    def _after_string(self, char: str, text: str, pos: int) -> int:
        if char in ",)":
            self._args.append('"')
            self._commit(pos)
            self._state = _NEXT
            return pos
        return self._break(text, pos)  # adjacent strings, `'a' + x`, ...: not followed

    def _start_held(self, prefix: str) -> None:
        self._state = _HELD
        self._held = [prefix] if prefix else []
        self._depth = 0
        self._quote = ""
        self._escape = self._triple = False
        self._opening = self._run = 0

    def _held_value(self, text: str, pos: int) -> int:
        """A value read whole: scanned to its end (a top-level `,` or closing bracket), then read with `ast`."""
        start, end = pos, len(text)
        while pos < end:  # hot loop: jumps to the next character that matters
            if not self._quote:
                match = _HELD_STOP.search(text, pos)
                pos = match.start() if match else end
                if pos == end:
                    break
            elif not (self._opening or self._escape):
                match = _STRING_STOP[self._quote].search(text, pos)
                stop = match.start() if match else end
                if stop > pos:
                    self._run = 0
                    pos = stop
                    continue
            char = text[pos]
            if self._quote:
                if not self._in_held_string(char):
                    continue  # an empty string ended before this character
            elif char in _QUOTES:
                self._quote, self._opening, self._triple = char, 1, False
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                if self._depth == 0:
                    break
                self._depth -= 1
            elif char == "," and self._depth == 0:
                break
            pos += 1
        self._held.append(text[start:pos])
        return self._end_held(text, pos) if pos < end else pos

    def _in_held_string(self, char: str) -> bool:
        """One character inside a held value's string; False when it is not the string's."""
        quote = self._quote
        if self._opening:  # just after an opening quote: a string, an empty one, or triple-quoted?
            if char == quote:
                self._opening += 1
                if self._opening == 3:
                    self._triple, self._opening = True, 0
                return True
            if self._opening == 2:
                self._quote, self._opening = "", 0
                return False
            self._opening = 0
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
            self._run = 0
        elif char != quote:
            self._run = 0
        elif not self._triple:
            self._quote = ""
        else:
            self._run += 1
            if self._run == 3:
                self._quote, self._run, self._triple = "", 0, False
        return True

    def _end_held(self, text: str, pos: int) -> int:
        source = "".join(self._held)
        self._held = []
        try:
            value = literal_json(source)
        except BadValue:
            return self._break(text, pos)
        self._open_member(value)
        self._commit(pos)
        self._state = _NEXT
        return pos

    def _open_member(self, value_start: str) -> None:
        """The next argument's key and the start of its value; the call's header goes first
        (a call is announced only once a value proved good: `city=Paris` is no call)."""
        if not self._header:
            self._send_header()
        key = json.dumps("".join(self._key), ensure_ascii=False)
        self._args.append(f"{', ' if self._members else '{'}{key}: {value_start}")
        self._members += 1

    # -- separators ---------------------------------------------------------------

    def _at_next(self, char: str, text: str, pos: int) -> int:
        if char == ",":
            self._state = _ARG
            return pos + 1
        if char == ")":
            return self._close_call(pos)
        return self._break(text, pos)

    def _at_sep(self, char: str, text: str, pos: int) -> int:
        if char == ",":
            self._state = _CALL
            return pos + 1
        if char == "]":
            return self._close_list(pos)
        return self._break(text, pos)

    def _close_call(self, pos: int) -> int:
        if self._members:
            self._args.append("}")
        else:
            if not self._header:
                self._send_header()
            self._args.append("{}")
        self._commit(pos + 1)
        self._flush_args()
        self._opened = True
        self._header = False
        self._state = _SEP
        return pos + 1

    def _close_list(self, pos: int) -> int:
        self._commit(pos + 1)
        self._state = _AFTER
        return pos + 1

    # -- deltas -------------------------------------------------------------------

    def _send_header(self) -> None:
        self._header = True
        if self.calls and not self._options.parallel_tool_calls:
            self._index = -1  # parallel_tool_calls=false keeps the first call only
            return
        self._index = self.calls
        self.calls += 1
        self._deltas.append(ToolDelta(index=self._index, id=self._options.new_id(), name="".join(self._name)))

    def _flush_args(self) -> None:
        if not self._args:
            return
        text = "".join(self._args)
        self._args = []
        if self._index >= 0:
            self._deltas.append(ToolDelta(index=self._index, arguments=text))

    def _commit(self, pos: int) -> None:
        """The list text before `pos` is spoken for: by deltas, or by the syntax around them."""
        self._raw.clear()
        self._mark = pos

    def _break(self, text: str, pos: int) -> int:
        """The list broke: the open call ends after its last complete value; the rest is content."""
        if self._header:
            self._args.append('"}' if self._state == _CLOSED else "}")
            self._header = False
        self._flush_args()
        rest = "".join(self._raw) + text[self._mark :]
        self._raw.clear()
        self._mark = len(text)
        self._state = _CONTENT
        if rest:
            self._content.add(rest)
        return len(text)

    def _cut_short(self, state: int) -> None:
        """The output ended inside the list: the open call's value goes out as far as it got and
        the call stays open, as cut; with no call announced the list's text is content."""
        if state == _ESCAPE:
            self._args.append(_json_chars(_escape_text("".join(self._held)) if self._held else "\\"))
        elif state == _CLOSED:
            self._args.append('"')
        elif state == _QUOTE1:
            self._open_member('"')
        elif state == _QUOTE2:
            self._open_member('""')
        elif state == _HELD:
            self._held_cut_short()
        if self._header:
            self._raw.clear()
        self._flush_args()
        rest = "".join(self._raw)
        self._raw.clear()
        self._state = _CONTENT
        if rest:
            self._content.add(rest)

    def _held_cut_short(self) -> None:
        try:
            value = literal_json("".join(self._held))
        except BadValue:
            # A value cut before it could be read: without a header the list's text is content;
            # with one, the member is left out (Python source is no JSON) and the call is closed
            # after its last complete value by the chat choice's closer.
            return
        self._open_member(value)


_HANDLERS = {
    _CALL: PythonicParser._at_call,
    _NAME: PythonicParser._in_name,
    _ARG: PythonicParser._at_argument,
    _KEY: PythonicParser._in_key,
    _EQ: PythonicParser._at_equals,
    _VALUE: PythonicParser._at_value,
    _QUOTE1: PythonicParser._at_quote1,
    _QUOTE2: PythonicParser._at_quote2,
    _ESCAPE: PythonicParser._in_escape,
    _CLOSED: PythonicParser._after_string,
    _NEXT: PythonicParser._at_next,
    _SEP: PythonicParser._at_sep,
}

PYTHONIC = ToolFactory("pythonic", BoundPythonic, format_calls, forced_prefix)
LLAMA4_PYTHONIC = ToolFactory("llama4_pythonic", bind_llama4, format_calls, forced_prefix)
