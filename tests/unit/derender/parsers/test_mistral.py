"""Mistral reasoning and tool parsing (`mistral` / `mistral`) through the chat derender.

Every vector is fed in every `FAMILY_CHUNKINGS` chunking; the folded stream must
equal the non-streamed `response()` for each (DERENDER_CASES' master test), and that
answer must be the expected one. The tokenizer is the offline Qwen3 BPE with Mistral's
control tokens added as specials (`tests.support.mistral` says what differs from
Mistral's own: other BPE and ids), so tests look ids up by token and never hard-code one.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import mistral
from derender.parsers.base import ToolCallText, UnknownParser
from derender.parsers.mistral import ARGS as A, THINK_END as ET, THINK_START as T, TOOL_CALLS as TC
from derender.parsers.mistral import JsonValueEnd, call_id
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from tests.support.mistral import EOS, mistral_tokenizer_dir, mistral_v3_tokenizer_dir
from tests.support.parity import Split, encode_fast
from tests.support.streams import chunked_answer, comparable_response, fixed, stream
from tests.support.tools import WEATHER_TOOLS

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARIS: dict[str, Any] = {"city": "Paris", "days": 2}
UTC: dict[str, Any] = {"tz": "UTC"}


def call(name: str, arguments: dict[str, Any] | None, *, raw: str | None = None, indent: int | None = None) -> str:
    body = raw if raw is not None else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"{TC}{name}{A}{body}"


TIME = call("get_time", UTC)


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Tokenizer:
    # `tokenizers` alone: transformers' import would be most of this module's time.
    return Tokenizer.from_file(str(mistral_tokenizer_dir(qwen3_tokenizer_dir) / "tokenizer.json"))


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> Iterator[TokenVocab]:
    built = vocab_for(tokenizer)
    # The tokenizer and vocabulary are ~10^6 long-lived objects: out of the collector's
    # sight, each test's garbage collections stop re-walking them (~0.5 s a test here).
    gc.freeze()
    yield built
    gc.unfreeze()


@pytest.fixture(scope="module")
def enc(tokenizer: Tokenizer) -> Callable[..., list[int]]:
    return lambda *segments: encode_fast(tokenizer, segments)


@pytest.fixture(scope="module")
def eos(tokenizer: Tokenizer) -> int:
    found = tokenizer.token_to_id(EOS)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def prompt(enc: Callable[..., list[int]]) -> list[int]:
    """A generation prompt shaped like the test template's (`tests.support.mistral`)."""
    return enc(f"<s>[AVAILABLE_TOOLS]{json.dumps(TOOLS)}[/AVAILABLE_TOOLS][INST]{USER[0]['content']}[/INST]")


def chat_options(
    *, tools: list[Any] | None = TOOLS, reasoning: str | None = "mistral", tool: str | None = "mistral", **request: Any
) -> ChatOptions:
    body: dict[str, Any] = {"model": "m", "messages": USER, **request}
    if tools:
        body["tools"] = tools
    parsed = msgspec.convert(body, ChatCompletionRequest)
    return ChatOptions.from_request(parsed, reasoning_parser=reasoning, tool_parser=tool)


@dataclass(frozen=True)
class Vector:
    output: tuple[str | Split, ...]
    reasoning: str | None = None
    content: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    """(name, arguments parsed as JSON, or the raw text where it is not JSON)."""
    finish: str = "tool_calls"
    eos: bool = True
    request: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = field(default_factory=lambda: TOOLS)
    reasoning_parser: str | None = "mistral"


def weather(**args: Any) -> tuple[str, Any]:
    return ("get_weather", args)


def clock(tz: str = "UTC") -> tuple[str, Any]:
    return ("get_time", {"tz": tz})


VECTORS: dict[str, Vector] = {
    "reasoning_content_call": Vector(
        (T, "Plan it.\n", ET, "Let me check.\n", call("get_weather", PARIS)),
        reasoning="Plan it.",
        content="Let me check.",
        calls=[weather(**PARIS)],
    ),
    "call_ends_reasoning": Vector((T, "Straight to it  \n", TIME), reasoning="Straight to it", calls=[clock()]),
    "reasoning_mid_content": Vector(
        ("Hello ", T, "aside", ET, "world"), reasoning="aside", content="Hello world", finish="stop"
    ),
    "parallel_calls": Vector(
        (T, "Two.", ET, "\n\n", call("get_weather", PARIS), "\n", TIME),
        reasoning="Two.",
        calls=[weather(**PARIS), clock()],
    ),
    "multiline_non_ascii": Vector(
        (call("get_weather", {"city": "Zürich 世界 🫠", "note": 'Zeile 1\nZeile 2\t"q"'}, indent=2),),
        calls=[weather(city="Zürich 世界 🫠", note='Zeile 1\nZeile 2\t"q"')],
    ),
    "schema_typed_values": Vector(
        (call("get_weather", None, raw='{"city": 75001, "days": "3", "metric": "true", "note": "4"}'),),
        calls=[weather(city="75001", days=3, metric=True, note="4")],
    ),
    "parameter_not_in_schema": Vector(
        (call("get_weather", None, raw='{"city": "Oslo", "zoom": "2"}'),), calls=[weather(city="Oslo", zoom="2")]
    ),
    "unknown_function": Vector((call("launch", {"speed": "3"}),), calls=[("launch", {"speed": "3"})]),
    "invalid_json": Vector((call("get_time", None, raw="{tz: UTC"),), calls=[("get_time", "{tz: UTC")]),
    "max_tokens_mid_call": Vector(
        (TC, "get_weather", A, '{"city": "Par'), calls=[("get_weather", {"city": "Par"})], finish="length", eos=False
    ),
    "max_tokens_mid_name": Vector((TC, "get_wea"), calls=[("get_wea", {})], finish="length", eos=False),
    "text_after_last_call": Vector((TIME, "\nChecking now. "), content="\nChecking now.", calls=[clock()]),
    "second_json_value": Vector(
        (call("get_time", None, raw='{"tz": "A"}{"tz": "B"}'),), content='{"tz": "B"}', calls=[clock("A")]
    ),
    "call_without_args_marker": Vector((TC, 'get_time{"tz": "UTC"}'), calls=[clock()]),
    "call_without_arguments": Vector((TC, "get_time", A, TC, "get_time"), calls=[("get_time", {}), ("get_time", {})]),
    "unclosed_json_then_call": Vector(
        (TC, "get_time", A, '{"tz": "A"', TIME), calls=[("get_time", {"tz": "A"}), clock()]
    ),
    "name_with_layout": Vector((TC, " get_time \n", A, ' {"tz": "UTC"} '), calls=[clock()]),
    "repeated_marker_before_name": Vector((TC, TIME), calls=[clock()]),
    "marker_alone_at_the_end": Vector(("Hi", TC), content="Hi", finish="stop"),
    "markers_split_across_tokens": Vector((Split(TIME),), content=TIME, finish="stop"),
    "stray_markers_in_content": Vector(("a", ET, "b", A, "c[INST]d"), content="ab[ARGS]cd", finish="stop"),
    "think_after_calls": Vector((TIME, T, "late", ET, "z"), reasoning="late", content="z", calls=[clock()]),
    "tools_not_offered": Vector(
        (T, "R.", ET, "Text ", TIME, " tail"), reasoning="R.", content=f"Text {TIME} tail", finish="stop", tools=None
    ),
    "tool_choice_none": Vector(
        (T, "R.", ET, "Text ", TIME),
        reasoning="R.",
        content=f"Text {TIME}",
        finish="stop",
        request={"tool_choice": "none"},
    ),
    "tool_parser_only": Vector(
        (T, "R.", ET, "Hi ", TIME), content=f"{T}R.{ET}Hi", calls=[clock()], reasoning_parser=None
    ),
    "parallel_tool_calls_false": Vector(
        (call("get_weather", PARIS), TIME), calls=[weather(**PARIS)], request={"parallel_tool_calls": False}
    ),
    "reasoning_whitespace": Vector(
        (T, "\n  Lead  \n\n", ET, "\n\nAnswer\n"), reasoning="\n  Lead", content="\n\nAnswer\n", finish="stop"
    ),
    "reasoning_cut_by_max_tokens": Vector(
        (T, "Still thinking \n "), reasoning="Still thinking", finish="length", eos=False
    ),
}


def _finish(vector_eos: bool) -> dict[str, Any]:
    return {"finish_reason": "stop" if vector_eos else "length"}


@pytest.mark.parametrize("name", list(VECTORS))
def test_vector_in_every_chunking(name: str, vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    vector = VECTORS[name]
    ids = enc(*vector.output) + ([eos] if vector.eos else [])
    options = chat_options(tools=vector.tools, reasoning=vector.reasoning_parser, **vector.request)
    got = chunked_answer(vocab, options, ids, prompt, **_finish(vector.eos))
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (vector.reasoning, vector.content, vector.finish)
    assert [(c["name"], _json_or_raw(c["arguments"])) for c in got["tool_calls"]] == vector.calls
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got["tool_calls"])  # Mistral's id shape


def _json_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def test_stop_string_inside_a_call(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    ids = [*enc(call("get_weather", {"city": "Lyon", "days": 3})), eos]
    got = chunked_answer(vocab, chat_options(stop=["Lyon"]), ids, prompt, finish_reason="stop", stop_reason="Lyon")
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"city": ""}')]
    # onehop: `stop`, not `tool_calls`, when a stop string cut the call short (chat.py).
    assert (got["content"], got["finish_reason"], got["stop_reason"]) == (None, "stop", "Lyon")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_either_way(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int], skip: bool) -> None:
    ids = [*enc(T, "R.", ET, "Hi[INST] ", TIME), eos]
    got = chunked_answer(vocab, chat_options(skip_special_tokens=skip), ids, prompt, finish_reason="stop")
    assert (got["reasoning"], got["content"]) == ("R.", "Hi")
    assert [c["arguments"] for c in got["tool_calls"]] == ['{"tz": "UTC"}']
    off = chunked_answer(vocab, chat_options(tools=None, skip_special_tokens=skip), ids, prompt, finish_reason="stop")
    assert off["content"] == f"Hi {TIME}"  # markers keep their text, other special tokens never show


def test_reasoning_tokens_are_the_ids_inside_reasoning(
    vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]
) -> None:
    inner = enc("Two short thoughts.")
    for tail, finish in (([eos], "stop"), ([], "length")):
        ids = enc(T) + inner + enc(ET, "ok") + tail
        run = stream(vocab, chat_options(), ids, fixed(3), prompt_ids=prompt, finish_reason=finish)
        assert run.folded.usage.completion_tokens_details.reasoning_tokens == len(inner)


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_forced_tool_choice_primes_the_call(
    vocab: TokenVocab, enc: Any, eos: int, prompt: list[int], tool_choice: str
) -> None:
    if tool_choice == "named":
        options = chat_options(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        output = [*enc('{"city": "Oslo"}'), eos]
    else:
        options = chat_options(tool_choice="required")
        output = [*enc("get_time", A, '{"tz": "UTC"}'), eos]
    assert options.forced_prefix is not None and options.forced_prefix.startswith(TC)
    primed = prompt + enc(options.forced_prefix)
    got = chunked_answer(vocab, options, output, primed, finish_reason="stop")
    expected = [weather(city="Oslo")] if tool_choice == "named" else [clock()]
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == expected
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (None, None, "tool_calls")


def test_written_calls_parse_back(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    calls = [ToolCallText("get_weather", {"city": "Zürich", "days": 3}), ToolCallText("get_time", {})]
    text = mistral.format_reasoning("Check both.") + "On it." + mistral.format_calls(calls)
    got = chunked_answer(vocab, chat_options(), [*enc(text), eos], prompt, finish_reason="stop")
    assert (got["reasoning"], got["content"]) == ("Check both.", "On it.")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        ("get_weather", {"city": "Zürich", "days": 3}),
        ("get_time", {}),
    ]


def test_call_ids_have_mistral_shape() -> None:
    ids = {call_id(f"chatcmpl-tool-{i:032x}") for i in range(200)}
    assert len(ids) == 200 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert call_id("seed") == call_id("seed")  # the same id source gives the same id in every chunking


def test_json_value_end_across_pieces() -> None:
    scanner = JsonValueEnd()
    assert [scanner.feed(part) for part in (" {", '"a": "}\\"', '{", "b": [1, {}]', "} tail")] == [-1, -1, -1, 1]
    assert JsonValueEnd().feed('[1] {"x": 1}') == 3
    assert JsonValueEnd().feed("tz: UTC}") == -1  # not an object: never closes


def test_parser_work_does_not_grow_with_output(vocab: TokenVocab, enc: Any, eos: int) -> None:
    """Each step hands over its own text at once: a long reasoning and a long argument
    stream token by token."""
    words = enc(" word" * 400)
    opening = enc(ET, TC, "get_weather", A, '{"note": "')
    ids = enc(T) + words + opening + words + enc('"}') + [eos]
    start = 1 + len(words) + len(opening)
    derender = ChatDerender(vocab, chat_options(), model="m")
    for i, token_id in enumerate(ids[:-1]):
        chunk = derender.step(0, [token_id])
        if 1 <= i <= len(words) or start <= i < start + len(words):
            assert chunk is not None  # every word is visible in its own step


def test_text_route_gives_the_token_route_answer(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    """An engine in `text` mode (special tokens kept) sends text without ids: the markers are
    found by their strings, and the answer is the token route's."""
    vector = VECTORS["parallel_calls"]
    ids = [*enc(*vector.output), eos]
    expected = chunked_answer(vocab, chat_options(), ids, prompt, finish_reason="stop")
    text = "".join(s if isinstance(s, str) else s.text for s in vector.output)
    for width in (1, 3, 7, 40):
        derender = ChatDerender(vocab, chat_options(), model="m", prompt_token_ids=prompt)
        pieces = [text[i : i + width] for i in range(0, len(text), width)]
        for i, piece in enumerate(pieces):
            derender.step_text(0, piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        got = comparable_response(derender.response())
        assert {**got, "tool_calls": _no_ids(got)} == {**expected, "tool_calls": _no_ids(expected)}


def _no_ids(response: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in response["tool_calls"]]


# -- pre-v11 tokenizers: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` ------------------


@pytest.fixture(scope="module")
def v3_tokenizer(qwen3_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(mistral_v3_tokenizer_dir(qwen3_tokenizer_dir) / "tokenizer.json"))


@pytest.fixture(scope="module")
def v3_vocab(v3_tokenizer: Tokenizer) -> Iterator[TokenVocab]:
    built = vocab_for(v3_tokenizer)
    gc.freeze()
    yield built
    gc.unfreeze()


def legacy(*calls: tuple[str, Any]) -> str:
    return json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls], ensure_ascii=False)


LEGACY_VECTORS: dict[str, Vector] = {
    "one_call": Vector(("Hi ", TC, " " + legacy(clock())), content="Hi", calls=[clock()]),
    "parallel_calls_not_retyped": Vector(
        (TC, legacy(("get_weather", {"city": "Zürich\n世界", "days": "2"}), clock())),
        calls=[weather(city="Zürich\n世界", days="2"), clock()],
    ),
    "bare_object": Vector((TC, json.dumps({"name": "get_time", "arguments": UTC})), calls=[clock()]),
    "text_after_the_list": Vector((TC, legacy(clock()), " then"), content=" then", calls=[clock()]),
    "no_arguments": Vector((TC, '[{"name": "get_time"}]'), calls=[("get_time", {})]),
    "whitespace_before_calls": Vector(("\n\n", TC, legacy(clock())), calls=[clock()]),
    "repeated_marker": Vector((TC, TC, legacy(clock())), calls=[clock()]),
    "cut_mid_arguments": Vector(
        (TC, '[{"name": "get_time", "arguments": {"tz": "U'),
        calls=[("get_time", {"tz": "U"})],
        finish="length",
        eos=False,
    ),
    "name_not_a_string": Vector((TC, '[{"name": get_time}]'), content='[{"name": get_time}]', finish="stop"),
    "not_a_list": Vector((TC, "get_time(UTC)"), content="get_time(UTC)", finish="stop"),
}


@pytest.mark.parametrize("name", list(LEGACY_VECTORS))
def test_legacy_vector_in_every_chunking(name: str, v3_vocab: TokenVocab, v3_tokenizer: Tokenizer) -> None:
    vector = LEGACY_VECTORS[name]
    eos_id = v3_tokenizer.token_to_id(EOS)
    assert eos_id is not None
    ids = encode_fast(v3_tokenizer, vector.output) + ([eos_id] if vector.eos else [])
    got = chunked_answer(v3_vocab, chat_options(reasoning=None), ids, [], **_finish(vector.eos))
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (vector.reasoning, vector.content, vector.finish)
    assert [(c["name"], _json_or_raw(c["arguments"])) for c in got["tool_calls"]] == vector.calls
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got["tool_calls"])


def test_legacy_tokenizer_has_no_reasoning_family(v3_vocab: TokenVocab) -> None:
    assert mistral.TOOLS.bind(v3_vocab).markers.by_text.keys() == {TC}
    with pytest.raises(UnknownParser, match=r"\[THINK\]"):
        mistral.REASONING.bind(v3_vocab)
