"""Llama 3.x JSON tool calls (`llama3_json`, alias `llama4_json`) through the chat derender.

Every vector is fed in every `FAMILY_CHUNKINGS` chunking; the folded stream
must equal the non-streamed `response()` for each, and that answer must be the
expected one. The tokenizer is the offline Qwen3 BPE with Llama 3's special
tokens added (`tests.support.llama3` says what differs from Llama's own), so
tests look ids up by token and never hard-code one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import llama3_json
from derender.parsers.base import ToolCallText
from derender.parsers.llama3_json import PYTHON_TAG as TAG
from derender.parsers.registry import tool_factory
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from tests.support.llama3 import EOT, OPEN_TURN, llama3_tokenizer_dir
from tests.support.parity import Split, encode_fast
from tests.support.streams import chunked_answer, comparable_response
from tests.support.tools import WEATHER_TOOLS

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARIS: dict[str, Any] = {"city": "Paris", "days": 2}
UTC: dict[str, Any] = {"tz": "UTC"}
NON_ASCII: dict[str, Any] = {"city": "Zürich 世界 🫠", "note": 'Zeile 1\nZeile 2\t"q"'}


def call(name: str, arguments: Any, *, key: str = "parameters", indent: int | None = None) -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False, indent=indent)


W = call("get_weather", PARIS)
T = call("get_time", UTC)


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Tokenizer:
    # `tokenizers` alone: transformers' import would cost this module most of its time budget.
    return Tokenizer.from_file(str(llama3_tokenizer_dir(qwen3_tokenizer_dir) / "tokenizer.json"))


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> TokenVocab:
    return vocab_for(tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer: Tokenizer) -> Callable[..., list[int]]:
    """Each segment encoded on its own; a `Split` segment's marker spellings as ordinary tokens."""
    return lambda *segments: encode_fast(tokenizer, segments)


@pytest.fixture(scope="module")
def eot(vocab: TokenVocab) -> int:
    found = vocab.token_id(EOT)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def prompt(enc: Callable[..., list[int]]) -> list[int]:
    """A generation turn as the test template opens it (the parser does not read the prompt)."""
    return enc("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>", OPEN_TURN)


def chat_options(*, tools: list[Any] | None = TOOLS, reasoning: str | None = None, **request: Any) -> ChatOptions:
    body: dict[str, Any] = {"model": "m", "messages": USER, **request}
    if tools:
        body["tools"] = tools
    parsed = msgspec.convert(body, ChatCompletionRequest)
    return ChatOptions.from_request(parsed, reasoning_parser=reasoning, tool_parser="llama3_json")


def answer(
    vocab: TokenVocab, options: ChatOptions, ids: Sequence[int], prompt: Sequence[int], **finish: Any
) -> dict[str, Any]:
    """The non-streamed answer, after checking every chunking streams exactly it."""
    # The engine's finish: `stop` on the EOS (`<|eot_id|>` here, not the Qwen3 fixture's), else `length`.
    finish.setdefault("finish_reason", "stop" if ids and ids[-1] == vocab.token_id(EOT) else "length")
    return chunked_answer(vocab, options, ids, prompt, **finish)


@dataclass(frozen=True)
class Vector:
    output: tuple[str | Split, ...]
    content: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    """(name, arguments parsed as JSON, or the raw text where it is not JSON)."""
    finish: str = "tool_calls"
    eos: bool = True
    request: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = field(default_factory=lambda: TOOLS)


VECTORS: dict[str, Vector] = {
    "one_call": Vector((W,), calls=[("get_weather", PARIS)]),
    "python_tag_then_call": Vector((TAG, W), calls=[("get_weather", PARIS)]),
    "arguments_key": Vector((call("get_time", UTC, key="arguments"),), calls=[("get_time", UTC)]),
    "name_after_arguments": Vector(('{"parameters": {"tz": "UTC"}, "name": "get_time"}',), calls=[("get_time", UTC)]),
    "parallel_calls": Vector((W + "; " + T,), calls=[("get_weather", PARIS), ("get_time", UTC)]),
    "parallel_calls_each_tagged": Vector(
        (TAG, W, "; ", TAG, T), calls=[("get_weather", PARIS), ("get_time", UTC)]
    ),
    "parallel_calls_newline": Vector((W + "\n" + T,), calls=[("get_weather", PARIS), ("get_time", UTC)]),
    "whitespace_before_call": Vector(("\n ", TAG, " " + W), calls=[("get_weather", PARIS)]),
    "multiline_non_ascii": Vector(
        (call("get_weather", NON_ASCII, indent=2),), calls=[("get_weather", NON_ASCII)]
    ),
    # The JSON carries typed values and vLLM's llama3_json does not retype them: neither does onehop.
    "values_not_retyped": Vector(
        ('{"name": "get_weather", "parameters": {"city": 75001, "days": "3"}}',),
        calls=[("get_weather", {"city": 75001, "days": "3"})],
    ),
    "parameter_not_in_schema": Vector(
        (call("get_weather", {"city": "Oslo", "zoom": 2}),), calls=[("get_weather", {"city": "Oslo", "zoom": 2})]
    ),
    "unknown_function": Vector((call("launch", {"speed": 3}),), calls=[("launch", {"speed": 3})]),
    "empty_arguments": Vector((call("get_time", {}),), calls=[("get_time", {})]),
    "scalar_arguments": Vector(('{"name": "get_time", "parameters": "UTC"}',), calls=[("get_time", "UTC")]),
    "plain_text": Vector(("Hello there.",), content="Hello there.", finish="stop"),
    "whitespace_only": Vector((" \n",), content=" \n", finish="stop"),
    "text_before_call_is_content": Vector(("Let me check. " + W,), content="Let me check. " + W, finish="stop"),
    "tag_then_text": Vector((TAG, 'print("hi")'), content='print("hi")', finish="stop"),
    "text_after_last_call": Vector(
        (W + " I will check. \n",), content=" I will check.", calls=[("get_weather", PARIS)]
    ),
    "separator_then_text": Vector((W + "; Done.",), content="; Done.", calls=[("get_weather", PARIS)]),
    "text_between_calls": Vector(
        (W + " then " + T + ";",), content=" then", calls=[("get_weather", PARIS), ("get_time", UTC)]
    ),
    "json_without_name_is_content": Vector(('{"answer": 42}',), content='{"answer": 42}', finish="stop"),
    "call_without_arguments_is_content": Vector(
        ('{"name": "get_time"} ok',), content='{"name": "get_time"} ok', finish="stop"
    ),
    "second_object_not_a_call": Vector(
        (W + '; {"answer": 1}',), content='; {"answer": 1}', calls=[("get_weather", PARIS)]
    ),
    "invalid_json_arguments": Vector(
        ('{"name": "get_time", "parameters": {tz: UTC}}',), calls=[("get_time", "{tz: UTC}")]
    ),
    "unclosed_object_before_arguments": Vector(
        ('{"name": "get_time", "param',), content='{"name": "get_time", "param', finish="length", eos=False
    ),
    "max_tokens_mid_call": Vector(
        ('{"name": "get_weather", "parameters": {"city": "Par',),
        calls=[("get_weather", {"city": "Par"})],  # closed to valid JSON (issue #27)
        finish="length",
        eos=False,
    ),
    "tag_split_across_tokens": Vector((Split(TAG + W),), content=TAG + W, finish="stop"),
    "tools_not_offered": Vector((W,), content=W, finish="stop", tools=None),
    "tool_choice_none": Vector((W,), content=W, finish="stop", request={"tool_choice": "none"}),
    "parallel_tool_calls_false": Vector(
        (W + "; " + T,), calls=[("get_weather", PARIS)], request={"parallel_tool_calls": False}
    ),
}


def test_vectors_in_every_chunking(vocab: TokenVocab, enc: Any, eot: int, prompt: list[int]) -> None:
    # One test for all vectors: the per-test garbage collection (tests/conftest.py) costs ~0.5 s here.
    failures: dict[str, Any] = {}
    for name, vector in VECTORS.items():
        ids = enc(*vector.output) + ([eot] if vector.eos else [])
        got = answer(vocab, chat_options(tools=vector.tools, **vector.request), ids, prompt)
        calls = [(c["name"], _json_or_raw(c["arguments"])) for c in got["tool_calls"]]
        seen = (got["content"], got["finish_reason"], calls)
        if got["reasoning"] is not None or seen != (vector.content, vector.finish, vector.calls):
            failures[name] = seen
        if not all(c["id"].startswith("chatcmpl-tool-") for c in got["tool_calls"]):
            failures[name] = [c["id"] for c in got["tool_calls"]]
    assert not failures


def _json_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def test_calls_right_after_reasoning(vocab: TokenVocab, enc: Any, eot: int, prompt: list[int]) -> None:
    """Llama 3 has no reasoning parser of its own; a distilled reasoning model (DeepSeek-R1-Distill-Llama)
    pairs one with llama3_json: the output after `</think>` is what is read for calls."""
    options = chat_options(reasoning="deepseek_r1")
    got = answer(vocab, options, [*enc("Plan.</think>\n\n", TAG, W + "; " + T), eot], prompt)
    assert (got["reasoning"], got["content"]) == ("Plan.", None)
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        ("get_weather", PARIS),
        ("get_time", UTC),
    ]
    text = answer(vocab, options, [*enc("Plan.</think>Sunny, 20 degrees."), eot], prompt)
    assert (text["reasoning"], text["content"], text["tool_calls"]) == ("Plan.", "Sunny, 20 degrees.", [])


def test_stop_string_inside_a_call(vocab: TokenVocab, enc: Any, eot: int, prompt: list[int]) -> None:
    ids = [*enc(call("get_weather", {"city": "Lyon", "days": 3})), eot]
    got = answer(vocab, chat_options(stop=["Lyon"]), ids, prompt)
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"city": ""}')]
    # onehop: `stop`, not `tool_calls`, when a stop string cut the call short (chat.py).
    assert (got["content"], got["finish_reason"], got["stop_reason"]) == (None, "stop", "Lyon")


def test_skip_special_tokens_either_way(vocab: TokenVocab, enc: Any, eot: int, prompt: list[int]) -> None:
    for skip in (True, False):
        ids = [*enc(TAG, W, "; ", TAG, T), eot]
        got = answer(vocab, chat_options(skip_special_tokens=skip), ids, prompt)
        assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
            ("get_weather", PARIS),
            ("get_time", UTC),
        ]
        assert got["content"] is None
        text = [*enc(TAG, "Not a call."), eot]
        kept = answer(vocab, chat_options(skip_special_tokens=skip), text, prompt)
        assert kept["content"] == ("" if skip else TAG) + "Not a call."


def test_forced_tool_choice_primes_the_call(vocab: TokenVocab, enc: Any, eot: int, prompt: list[int]) -> None:
    named = chat_options(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = chat_options(tool_choice="required")
    for options, output, expected in (
        (named, '{"city": "Oslo"}}', ("get_weather", {"city": "Oslo"})),
        (required, 'get_time", "parameters": {"tz": "UTC"}}', ("get_time", UTC)),
    ):
        assert options.forced_prefix is not None and options.forced_prefix.startswith('{"name": ')
        got = answer(vocab, options, [*enc(output), eot], prompt + enc(options.forced_prefix))
        assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [expected]
        assert (got["content"], got["finish_reason"]) == (None, "tool_calls")


def test_written_calls_parse_back(vocab: TokenVocab, enc: Any, eot: int, prompt: list[int]) -> None:
    calls = [ToolCallText("get_weather", {"city": "Zürich", "days": 3}), ToolCallText("get_time", {})]
    text = llama3_json.format_calls(calls)
    # A forced call is the written call's opening, so a model (or the sim) continues it as it writes calls.
    assert text.startswith(llama3_json.forced_prefix("get_weather"))
    assert text.startswith(llama3_json.forced_prefix(None))
    got = answer(vocab, chat_options(), [*enc(text), eot], prompt)
    assert got["content"] is None
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        (c.name, dict(c.arguments)) for c in calls
    ]


def test_llama4_json_is_the_same_family() -> None:
    assert tool_factory("llama4_json") is tool_factory("llama3_json") is llama3_json.FACTORY


def test_parser_work_does_not_grow_with_output(vocab: TokenVocab, enc: Any, eot: int) -> None:
    """Once the header is out, each step hands over its argument text at once."""
    opening = enc('{"name": "get_weather", "parameters": {"note": "')
    words = enc(" word" * 400)
    ids = opening + words + enc('"}}') + [eot]
    derender = ChatDerender(vocab, chat_options(), model="m")
    for i, token_id in enumerate(ids[:-1]):
        chunk = derender.step(0, [token_id])
        if len(opening) <= i < len(opening) + len(words):
            assert chunk is not None  # every word is visible in its own step


def test_text_route_gives_the_token_route_answer(vocab: TokenVocab, enc: Any, eot: int, prompt: list[int]) -> None:
    """An engine in `text` mode sends text without ids: the tag is found by its string."""
    text = TAG + W + "; " + T
    expected = answer(vocab, chat_options(), [*enc(TAG, W + "; " + T), eot], prompt)
    for width in (1, 3, 7, 40):
        derender = ChatDerender(vocab, chat_options(), model="m", prompt_token_ids=prompt)
        pieces = [text[i : i + width] for i in range(0, len(text), width)]
        for i, piece in enumerate(pieces):
            derender.step_text(0, piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        got = comparable_response(derender.response())
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [
            (c["name"], c["arguments"]) for c in expected["tool_calls"]
        ]
        assert (got["content"], got["finish_reason"]) == (expected["content"], expected["finish_reason"])

