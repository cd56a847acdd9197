"""Pythonic tool calls (`pythonic`, `llama4_pythonic`) through the chat derender.

Every vector is fed in each of `FAMILY_CHUNKINGS`; the folded stream must equal
the non-streamed `response()` for every chunking, and that answer must be the
expected one. The tokenizer is the offline Qwen3 BPE with Llama 4's
`<|python_start|>`, `<|python_end|>` and `<|eot|>` added as specials
(`tests.support.pythonic` says what differs from Llama's own), so tests look ids
up by token and never hard-code one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import pythonic
from derender.parsers.base import ParseOptions, ToolCallText
from derender.parsers.pythonic import PYTHON_END as PE, PYTHON_START as PS, BadValue, literal_json
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from tests.support.parity import Split
from tests.support.pythonic import EOT, pythonic_tokenizer_dir
from tests.support.streams import chunked_answer, comparable_response
from tests.support.tools import WEATHER_TOOLS

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = '[get_weather(city="Paris", days=2)]'
UTC = '[get_time(tz="UTC")]'


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Tokenizer:
    # `tokenizers` directly: importing transformers would cost this module most of its time budget.
    return Tokenizer.from_file(str(pythonic_tokenizer_dir(qwen3_tokenizer_dir) / "tokenizer.json"))


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> TokenVocab:
    return vocab_for(tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer: Tokenizer) -> Callable[..., list[int]]:
    """Segments to ids; a `Split` segment one character at a time, so no marker is its token."""

    def encode(*segments: str | Split) -> list[int]:
        ids: list[int] = []
        for segment in segments:
            parts = list(segment.text) if isinstance(segment, Split) else [segment]
            for part in parts:
                ids += tokenizer.encode(part, add_special_tokens=False).ids
        return ids

    return encode


@pytest.fixture(scope="module")
def eot(tokenizer: Tokenizer) -> int:
    found = tokenizer.token_to_id(EOT)
    assert found is not None
    return int(found)


def chat_options(*, tools: list[Any] | None = TOOLS, parser: str = "pythonic", **request: Any) -> ChatOptions:
    body: dict[str, Any] = {"model": "m", "messages": USER, **request}
    if tools:
        body["tools"] = tools
    parsed = msgspec.convert(body, ChatCompletionRequest)
    return ChatOptions.from_request(parsed, reasoning_parser=None, tool_parser=parser)


@dataclass(frozen=True)
class Vector:
    output: tuple[str | Split, ...]
    content: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    """(name, arguments parsed as JSON, or the raw text where it is not JSON)."""
    finish: str = "tool_calls"
    eos: bool = True
    parser: str = "pythonic"
    request: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = field(default_factory=lambda: TOOLS)


def weather(**args: Any) -> tuple[str, Any]:
    return ("get_weather", args)


def clock(tz: str = "UTC") -> tuple[str, Any]:
    return ("get_time", {"tz": tz})


VECTORS: dict[str, Vector] = {
    "one_call": Vector((PARIS,), calls=[weather(city="Paris", days=2)]),
    "parallel_calls": Vector(
        ("[get_weather(city='Paris', days=2), get_time(tz=\"UTC\")]",), calls=[weather(city="Paris", days=2), clock()]
    ),
    "escapes_and_non_ascii": Vector(
        (
            '[get_weather(city="Zürich 世界 🫠", note="Zeile 1\\nZeile 2\\t\\"q\\" \\\\ '
            '\\u00e9\\x41\\101\\N{BULLET}\\q\\ud83d\\ude00\\\n.")]',
        ),
        calls=[weather(city="Zürich 世界 🫠", note='Zeile 1\nZeile 2\t"q" \\ éAA•\\q😀.')],
    ),
    "triple_quoted_multiline": Vector(
        ("[get_weather(city='Oslo', note='''line 1\nit's \"2\"\nline 3''')]",),
        calls=[weather(city="Oslo", note="line 1\nit's \"2\"\nline 3")],
    ),
    "raw_line_break_in_string": Vector(
        ('[get_weather(city="Oslo", note="a\nb")]',), calls=[weather(city="Oslo", note="a\nb")]
    ),
    "laid_out_over_lines": Vector(
        ('[get_weather(city="Paris",\n             days=2),\n get_time( tz = "UTC" ),\n]',),
        calls=[weather(city="Paris", days=2), clock()],
    ),
    "python_literals": Vector(
        (
            "[get_weather(city='Rome', days=-3, metric=True, note=None, extra=[1, 2.5, 'x,)]'],"
            " opts={'a': (1, 2), 'b': null, 3: {''}}, flag=false, raw=r'C:\\dir', s=\"\")]",
        ),
        calls=[
            weather(
                city="Rome",
                days=-3,
                metric=True,
                note=None,
                extra=[1, 2.5, "x,)]"],
                opts={"a": [1, 2], "b": None, "3": [""]},
                flag=False,
                raw="C:\\dir",
                s="",
            )
        ],
    ),
    "string_holding_brackets": Vector(
        ("[get_weather(city=\"a), b](c='\", note='x\\')')]",), calls=[weather(city="a), b](c='", note="x')")]
    ),
    "call_without_arguments": Vector(("[get_time(), get_time()]",), calls=[("get_time", {}), ("get_time", {})]),
    "dotted_later_call": Vector(
        ('[get_time(tz="UTC"), tools.lookup(q="x")]',), calls=[clock(), ("tools.lookup", {"q": "x"})]
    ),
    "unknown_function": Vector(('[launch(speed="3")]',), calls=[("launch", {"speed": "3"})]),
    "parameter_not_in_schema": Vector(
        ('[get_weather(city="Oslo", zoom=2)]',), calls=[weather(city="Oslo", zoom=2)]
    ),
    "text_after_last_call": Vector((UTC, "\n\nChecking now. "), content="\n\nChecking now.", calls=[clock()]),
    "whitespace_after_list": Vector((UTC, "\n\n"), calls=[clock()]),
    "list_left_open": Vector(('[get_time(tz="A"), get_time(tz="B")',), calls=[clock("A"), clock("B")]),
    "plain_answer": Vector(("Sure: it is sunny.",), content="Sure: it is sunny.", finish="stop"),
    "leading_space": Vector((" " + UTC,), content=" " + UTC, finish="stop"),
    "markdown_link": Vector(("[docs](https://x.y) say hi",), content="[docs](https://x.y) say hi", finish="stop"),
    "empty_list": Vector(("[]",), content="[]", finish="stop"),
    "spaced_first_call": Vector(('[ get_time(tz="UTC")]',), content='[ get_time(tz="UTC")]', finish="stop"),
    "positional_argument": Vector(('[get_time("UTC")]',), content='[get_time("UTC")]', finish="stop"),
    "bad_value_after_header": Vector(
        ('[get_weather(city="Paris", days=1 + 2)]',),
        content=", days=1 + 2)]",
        calls=[weather(city="Paris")],
    ),
    "unquoted_value": Vector(
        ("[get_weather(city=Paris)]",), content="[get_weather(city=Paris)]", finish="stop"
    ),  # no value proved good: no call was announced
    "second_call_breaks": Vector(
        ('[get_time(tz="UTC"), get_time(UTC)] done',), content=", get_time(UTC)] done", calls=[clock()]
    ),
    "max_tokens_mid_string": Vector(
        ('[get_weather(city="Par',), calls=[("get_weather", {"city": "Par"})], finish="length", eos=False
    ),
    "max_tokens_mid_number": Vector(
        ('[get_weather(city="Oslo", days=12',),
        calls=[("get_weather", {"city": "Oslo", "days": 12})],
        finish="length",
        eos=False,
    ),
    "max_tokens_mid_escape": Vector(
        ('[get_weather(city="Os\\u00',), calls=[("get_weather", {"city": "Os\\u00"})], finish="length", eos=False
    ),
    "max_tokens_mid_name": Vector(("[get_wea",), content="[get_wea", finish="length", eos=False),
    "max_tokens_mid_held_value": Vector(  # a value cut before it could be read is left out (issue #27)
        ('[get_weather(city="Oslo", tags=[\'a\', \'b',),
        calls=[("get_weather", {"city": "Oslo"})],
        finish="length",
        eos=False,
    ),
    "tools_not_offered": Vector((UTC,), content=UTC, finish="stop", tools=None),
    "tool_choice_none": Vector((UTC,), content=UTC, finish="stop", request={"tool_choice": "none"}),
    "parallel_tool_calls_false": Vector(
        ('[get_time(tz="A"), get_time(tz="B")]',), calls=[clock("A")], request={"parallel_tool_calls": False}
    ),
    "llama4_wrapped": Vector((PS, UTC, PE), calls=[clock()], parser="llama4_pythonic"),
    "llama4_wrapped_specials_kept": Vector(
        (PS, UTC, PE), calls=[clock()], parser="llama4_pythonic", request={"skip_special_tokens": False}
    ),
    "llama4_unwrapped": Vector((UTC,), calls=[clock()], parser="llama4_pythonic"),
    "llama4_wrapped_text": Vector(
        (PS, "Just text.", PE),
        content=PS + "Just text." + PE,
        finish="stop",
        parser="llama4_pythonic",
        request={"skip_special_tokens": False},
    ),
    "llama4_wrapped_not_a_call": Vector(
        (PS, "[docs](x)", PE), content=PS + "[docs](x)" + PE, finish="stop", parser="llama4_pythonic",
        request={"skip_special_tokens": False},
    ),
    "llama4_marker_text_split": Vector(
        (Split(PS + UTC + PE),), content=PS + UTC + PE, finish="stop", parser="llama4_pythonic"
    ),
    "pythonic_skips_wrapper": Vector((PS, UTC, PE), calls=[clock()]),
    "pythonic_keeps_wrapper_text": Vector(
        (PS, UTC, PE), content=PS + UTC + PE, finish="stop", request={"skip_special_tokens": False}
    ),
}


def test_vectors_in_every_chunking(vocab: TokenVocab, enc: Any, eot: int) -> None:
    """All vectors in one test: the suite collects garbage after each test, ~0.2 s with a
    tokenizer loaded, which would be most of this module's budget as one test per vector."""
    failures: dict[str, str] = {}
    for name, vector in VECTORS.items():
        try:
            check_vector(vector, vocab, enc, eot)
        except AssertionError as exc:
            failures[name] = str(exc)
    assert not failures


def check_vector(vector: Vector, vocab: TokenVocab, enc: Any, eot: int) -> None:
    ids = enc(*vector.output) + ([eot] if vector.eos else [])
    options = chat_options(tools=vector.tools, parser=vector.parser, **vector.request)
    got = chunked_answer(vocab, options, ids, finish_reason="stop" if vector.eos else "length")
    assert (got["content"], got["finish_reason"]) == (vector.content, vector.finish)
    assert [(c["name"], _json_or_raw(c["arguments"])) for c in got["tool_calls"]] == vector.calls
    assert all(c["id"].startswith("chatcmpl-tool-") for c in got["tool_calls"])


def _json_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def test_stop_string_inside_a_call(vocab: TokenVocab, enc: Any, eot: int) -> None:
    ids = [*enc('[get_weather(city="Lyon", days=3)]'), eot]
    got = chunked_answer(vocab, chat_options(stop=["Lyon"]), ids, finish_reason="stop")
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"city": ""}')]
    # onehop: `stop`, not `tool_calls`, when a stop string cut the call short (chat.py).
    assert (got["content"], got["finish_reason"], got["stop_reason"]) == (None, "stop", "Lyon")


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_forced_tool_choice_primes_the_call(vocab: TokenVocab, enc: Any, eot: int, tool_choice: str) -> None:
    if tool_choice == "named":
        options = chat_options(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        output, expected = 'city="Oslo")]', [weather(city="Oslo")]
    else:
        options = chat_options(tool_choice="required")
        output, expected = 'get_time(tz="UTC")]', [clock()]
    assert options.forced_prefix == ("[get_weather(" if tool_choice == "named" else "[")
    got = chunked_answer(vocab, options, [*enc(output), eot], finish_reason="stop")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == expected
    assert (got["content"], got["finish_reason"]) == (None, "tool_calls")


@pytest.mark.parametrize("parser", ["pythonic", "llama4_pythonic"])
def test_written_calls_parse_back(vocab: TokenVocab, enc: Any, eot: int, parser: str) -> None:
    arguments: list[dict[str, Any]] = [
        {"city": "Zürich \"'\n\\", "days": 3, "metric": False, "note": None},
        {},
        {"extra": [1, 2.5, {"k": [True, None]}], "s": "a)b]c,"},
    ]
    calls = [ToolCallText(name, args) for name, args in zip(("get_weather", "get_time", "x.y"), arguments, strict=True)]
    text = pythonic.format_calls(calls)
    assert text.startswith("[get_weather(city=") and text.endswith(")]")
    got = chunked_answer(vocab, chat_options(parser=parser), [*enc(text), eot], finish_reason="stop")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        (c.name, c.arguments) for c in calls
    ]


def test_values_follow_vllm_reading() -> None:
    assert literal_json("(1, 'a')") == '[1, "a"]'
    assert literal_json("{'b', }") == '["b"]'
    assert literal_json("f'plain'") == '"plain"'
    assert literal_json("+2.5") == "2.5"
    assert literal_json("'\\d'") == '"\\\\d"'  # an unknown escape keeps its backslash, no warning
    assert json.loads(literal_json("'\\ud83d\\ude00'")) == "😀"  # surrogate halves pair up
    for bad in ("b'x'", "-True", "x", "1 + 2", "f'{x}'", "{**a}", "", "[1,", "{b'k': 1}", "[" * 5000):
        with pytest.raises(BadValue):
            literal_json(bad)


def test_string_values_stream_as_they_arrive(vocab: TokenVocab, enc: Any, eot: int) -> None:
    """A long string value is streamed token by token: no step waits for the value to end."""
    words = enc(" word" * 300)
    opening = enc('[get_weather(city="Oslo", note="')
    ids = opening + words + enc('")]') + [eot]
    derender = ChatDerender(vocab, chat_options(), model="m")
    for i, token_id in enumerate(ids[:-1]):
        chunk = derender.step(0, [token_id])
        if len(opening) <= i < len(opening) + len(words):
            assert chunk is not None  # every word is visible in its own step


def test_wrapper_markers_need_their_ids(vocab: TokenVocab) -> None:
    """`<|python_start|>` counts by id: skipped (empty text) or whole; a piece with only part of it is text."""
    start = vocab.token_id(PS)
    assert start is not None
    parser = pythonic.bind_llama4(vocab).new(ParseOptions(tools_enabled=True), strays={})
    parser.feed([("", start), ('[get_time(tz="UTC")]', -1)])
    parser.finish()
    content, deltas = parser.drain()
    assert content == "" and [d.name for d in deltas if d.name] == ["get_time"]
    other = pythonic.bind_llama4(vocab).new(ParseOptions(tools_enabled=True), strays={})
    other.feed([("<|python_st", start), ("[get_time()]", -1)])
    other.finish()
    assert other.drain() == ("<|python_st[get_time()]", [])


def test_text_route_gives_the_token_route_answer(vocab: TokenVocab, enc: Any, eot: int) -> None:
    """An engine in `text` mode sends text without ids: the answer is the token route's."""
    text = "[get_weather(city='Paris', days=2), get_time(tz=\"UTC\")]\nDone."
    expected = chunked_answer(vocab, chat_options(), [*enc(text), eot], finish_reason="stop")
    for width in (1, 3, 7, 40):
        derender = ChatDerender(vocab, chat_options(), model="m")
        pieces = [text[i : i + width] for i in range(0, len(text), width)]
        for i, piece in enumerate(pieces):
            derender.step_text(0, piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        got = comparable_response(derender.response())
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [
            (c["name"], c["arguments"]) for c in expected["tool_calls"]
        ]
        assert (got["content"], got["finish_reason"]) == (expected["content"], expected["finish_reason"])
