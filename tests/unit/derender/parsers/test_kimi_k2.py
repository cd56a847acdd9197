"""Kimi K2 reasoning and tool parsing (`kimi_k2` / `kimi_k2`) through the chat derender.

Every vector is fed in chunks of 1..8 tokens and in six random splits; the
folded stream must equal the non-streamed `response()` for every chunking
(DERENDER_CASES' master test), and that answer must be the expected one. The
tokenizer is the offline Qwen3 BPE with Kimi's special tokens added
(`tests.support.kimi_k2` says what differs from Kimi's own: other BPE and ids,
`<think>`/`</think>` non-special here but special in Kimi, `<|im_end|>` as the EOS),
so tests look ids up by token and never hard-code one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import kimi_k2
from derender.parsers.base import ParseOptions, ToolCallText
from derender.parsers.kimi_k2 import (
    ARGUMENT_BEGIN as AB,
    CALL_BEGIN as CB,
    CALL_END as CE,
    SECTION_BEGIN as SB,
    SECTION_END as SE,
)
from derender.parsers.json_arguments import ArgumentsText, coerce_text, coerce_value
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from tests.support.kimi_k2 import OPEN_TURN, kimi_tokenizer_dir
from tests.support.parity import Split, encode
from tests.support.streams import chunked_answer, comparable_response, fixed, stream
from tests.support.tools import WEATHER_TOOLS

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [*USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}]
PARIS: dict[str, Any] = {"city": "Paris", "days": 2}
UTC: dict[str, Any] = {"tz": "UTC"}


def call(
    name: str, arguments: dict[str, Any] | None, index: int, *, raw: str | None = None, indent: int | None = None
) -> str:
    body = raw if raw is not None else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"{CB}functions.{name}:{index}{AB}{body}{CE}"


def unmarked_call(name: str, arguments: dict[str, Any], index: int) -> str:
    """A call's text with its marker tokens skipped (`skip_special_tokens`)."""
    return f"functions.{name}:{index}{json.dumps(arguments, ensure_ascii=False)}"


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kimi_tokenizer_dir(qwen3_tokenizer_dir))


@pytest.fixture(scope="module")
def vocab(tokenizer: Any) -> TokenVocab:
    return vocab_for(tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer: Any) -> Callable[..., list[int]]:
    return lambda *segments: encode(tokenizer, segments)


@pytest.fixture(scope="module")
def im_end(tokenizer: Any) -> int:
    return int(tokenizer.convert_tokens_to_ids("<|im_end|>"))


def chat_options(*, tools: list[Any] | None = TOOLS, reasoning: str | None = "kimi_k2", **request: Any) -> ChatOptions:
    body: dict[str, Any] = {"model": "m", "messages": USER, **request}
    if tools:
        body["tools"] = tools
    parsed = msgspec.convert(body, ChatCompletionRequest)
    return ChatOptions.from_request(parsed, reasoning_parser=reasoning, tool_parser="kimi_k2")


def prompt_ids(tokenizer: Any, kind: str, messages: list[Any] = USER) -> list[int]:
    """`pre_open`: K2.5's template pre-opens `<think>`; `off`: thinking disabled
    (`<think></think>`); `open_turn`: the model writes `<think>` itself (K2-Thinking)."""
    kwargs = {"enable_thinking": False} if kind == "off" else {}
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=kind != "open_turn", tokenize=False, **kwargs
    )
    if kind == "open_turn":
        text += OPEN_TURN
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Vector:
    output: tuple[str | Split, ...]
    reasoning: str | None = None
    content: str | None = None
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    """(id, name, arguments parsed as JSON, or the raw text where it is not JSON)."""
    finish: str = "tool_calls"
    eos: bool = True
    prompt: str = "pre_open"
    request: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = field(default_factory=lambda: TOOLS)
    messages: list[Any] = field(default_factory=lambda: USER)


def weather(index: int = 0, **args: Any) -> tuple[str, str, Any]:
    return (f"functions.get_weather:{index}", "get_weather", args)


def clock(index: int = 0, tz: str = "UTC") -> tuple[str, str, Any]:
    return (f"functions.get_time:{index}", "get_time", {"tz": tz})


VECTORS: dict[str, Vector] = {
    "reasoning_content_call": Vector(
        ("Plan it.\n</think>Let me check.\n", SB, call("get_weather", PARIS, 0), SE),
        reasoning="Plan it.",
        content="Let me check.",  # the whitespace right before a call is dropped (issue #27)
        calls=[weather(**PARIS)],
    ),
    "model_opens_think": Vector(
        ("<think>Plan.</think>", SB, call("get_time", UTC, 0), SE),
        reasoning="Plan.",
        calls=[clock()],
        prompt="open_turn",
    ),
    "call_ends_reasoning": Vector(
        ("Straight to it  \n", SB, call("get_time", UTC, 0), SE), reasoning="Straight to it", calls=[clock()]
    ),
    "parallel_calls": Vector(
        ("Two.</think>\n\n", SB, "\n", call("get_weather", PARIS, 0), "\n", call("get_time", UTC, 1), "\n", SE),
        reasoning="Two.",
        calls=[weather(**PARIS), clock(1)],
    ),
    "multiline_non_ascii": Vector(
        (
            "R.</think>",
            SB,
            call("get_weather", {"city": "Zürich 世界 🫠", "note": 'Zeile 1\nZeile 2\t"q"'}, 0, indent=2),
            SE,
        ),
        reasoning="R.",
        calls=[weather(city="Zürich 世界 🫠", note='Zeile 1\nZeile 2\t"q"')],
    ),
    "schema_typed_values": Vector(
        (
            "R.</think>",
            SB,
            call("get_weather", None, 0, raw='{"city": 75001, "days": "3", "metric": "true", "note": "4"}'),
            SE,
        ),
        reasoning="R.",
        calls=[weather(city="75001", days=3, metric=True, note="4")],
    ),
    "parameter_not_in_schema": Vector(
        ("R.</think>", SB, call("get_weather", None, 0, raw='{"city": "Oslo", "zoom": "2"}'), SE),
        reasoning="R.",
        calls=[weather(city="Oslo", zoom="2")],
    ),
    "unknown_function": Vector(
        ("R.</think>", SB, call("launch", {"speed": "3"}, 0), SE),
        reasoning="R.",
        calls=[("functions.launch:0", "launch", {"speed": "3"})],
    ),
    "invalid_json": Vector(
        ("R.</think>", SB, call("get_time", None, 0, raw="{tz: UTC"), SE),
        reasoning="R.",
        calls=[("functions.get_time:0", "get_time", "{tz: UTC")],
    ),
    "max_tokens_mid_call": Vector(
        ("R.</think>", SB, CB, "functions.get_weather:0", AB, '{"city": "Par'),
        reasoning="R.",
        calls=[("functions.get_weather:0", "get_weather", {"city": "Par"})],  # closed to valid JSON (issue #27)
        finish="length",
        eos=False,
    ),
    "max_tokens_mid_header": Vector(
        ("R.</think>", SB, CB, "functions.get_wea"),
        reasoning="R.",
        content=f"{CB}functions.get_wea",
        finish="length",
        eos=False,
    ),
    "text_after_last_call": Vector(
        ("R.</think>", SB, call("get_time", UTC, 0), SE, "\nChecking now. "),
        reasoning="R.",
        content="\nChecking now.",
        calls=[clock()],
    ),
    "text_between_calls": Vector(
        ("R.</think>", SB, call("get_time", UTC, 0), " then ", call("get_time", UTC, 1), SE),
        reasoning="R.",
        content=" then",
        calls=[clock(), clock(1)],
    ),
    "unclosed_call": Vector(
        ("R.</think>", SB, CB, "functions.get_time:0", AB, '{"tz": "A"}', call("get_time", {"tz": "B"}, 1), SE),
        reasoning="R.",
        calls=[clock(0, "A"), clock(1, "B")],
    ),
    "unclosed_section": Vector(("R.</think>", SB, call("get_time", UTC, 0)), reasoning="R.", calls=[clock()]),
    "calls_without_arguments": Vector(
        ("R.</think>", SB, CB, "functions.get_time:0", AB, CE, CB, "functions.get_time:1", CE, SE),
        reasoning="R.",
        calls=[("functions.get_time:0", "get_time", {}), ("functions.get_time:1", "get_time", {})],
    ),
    "header_without_index": Vector(
        ("R.</think>", SB, CB, "functions.get_time", AB, '{"tz": "UTC"}', CE, SE),
        reasoning="R.",
        content=f'{CB}functions.get_time{AB}{{"tz": "UTC"}}{CE}',
        finish="stop",
    ),
    "header_ids_verbatim": Vector(
        ("R.</think>", SB, CB, " functions.get_time:7 \n", AB, ' {"tz": "X"} ', CE, CB, "get_time:8", AB, "{}", CE, SE),
        reasoning="R.",
        calls=[clock(7, "X"), ("get_time:8", "get_time", {})],
    ),
    "markers_split_across_tokens": Vector(
        ("R.</think>", Split(SB + call("get_time", UTC, 0) + SE)),
        reasoning="R.",
        content=SB + call("get_time", UTC, 0) + SE,
        finish="stop",
    ),
    "stray_markers_in_content": Vector(
        ("R.</think>A</think>B<think>C", CE, "D<|im_user|>E"),
        reasoning="R.",
        content=f"AB<think>C{CE}DE",
        finish="stop",
    ),
    "tools_not_offered": Vector(
        ("R.</think>Hi ", SB, call("get_time", UTC, 0), SE, " tail"),
        reasoning="R.",
        content=f"Hi {unmarked_call('get_time', UTC, 0)} tail",  # special tokens skipped (issue #27)
        finish="stop",
        tools=None,
    ),
    "tool_choice_none": Vector(
        ("R.</think>Hi ", SB, call("get_time", UTC, 0), SE),
        reasoning="R.",
        content=f"Hi {unmarked_call('get_time', UTC, 0)}",  # special tokens skipped (issue #27)
        finish="stop",
        request={"tool_choice": "none"},
    ),
    "thinking_disabled": Vector(
        ("Sure. ", SB, call("get_time", UTC, 0), SE), content="Sure.", calls=[clock()], prompt="off"
    ),
    "thinking_kwarg_off": Vector(
        ("Plain answer.",),
        content="Plain answer.",
        finish="stop",
        prompt="open_turn",
        request={"chat_template_kwargs": {"thinking": False}},
    ),
    "thinking_kwarg_overrides_enable_thinking": Vector(
        ("<think>Yes.</think>On.",),
        reasoning="Yes.",
        content="On.",
        finish="stop",
        prompt="open_turn",
        request={"chat_template_kwargs": {"thinking": True, "enable_thinking": False}},
    ),
    "earlier_turn_does_not_end_reasoning": Vector(
        ("<think>New.</think>Rome is warm.",),
        reasoning="New.",
        content="Rome is warm.",
        finish="stop",
        prompt="open_turn",
        messages=HISTORY,
    ),
    "parallel_tool_calls_false": Vector(
        ("R.</think>", SB, call("get_weather", PARIS, 0), call("get_time", UTC, 1), SE),
        reasoning="R.",
        calls=[weather(**PARIS)],
        request={"parallel_tool_calls": False},
    ),
    "reasoning_whitespace": Vector(
        ("\n  Lead  \n\n</think>\n\nAnswer\n",), reasoning="\n  Lead", content="\n\nAnswer\n", finish="stop"
    ),
    "reasoning_cut_by_max_tokens": Vector(
        ("Still thinking \n ",), reasoning="Still thinking", finish="length", eos=False
    ),
}


@pytest.mark.parametrize("name", list(VECTORS))
def test_vector_in_every_chunking(name: str, vocab: TokenVocab, tokenizer: Any, enc: Any, im_end: int) -> None:
    vector = VECTORS[name]
    ids = enc(*vector.output) + ([im_end] if vector.eos else [])
    options = chat_options(tools=vector.tools, **vector.request)
    prompt = prompt_ids(tokenizer, vector.prompt, vector.messages)
    got = chunked_answer(vocab, options, ids, prompt)
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (vector.reasoning, vector.content, vector.finish)
    calls = [(c["id"], c["name"], _json_or_raw(c["arguments"])) for c in got["tool_calls"]]
    assert calls == vector.calls


def _json_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def test_stop_string_inside_a_call(vocab: TokenVocab, tokenizer: Any, enc: Any, im_end: int) -> None:
    ids = [*enc("R.</think>", SB, call("get_weather", {"city": "Lyon", "days": 3}, 0), SE), im_end]
    got = chunked_answer(vocab, chat_options(stop=["Lyon"]), ids, prompt_ids(tokenizer, "pre_open"))
    assert [(c["id"], c["arguments"]) for c in got["tool_calls"]] == [("functions.get_weather:0", '{"city": ""}')]
    # onehop: `stop`, not `tool_calls`, when a stop string cut the call short (chat.py).
    assert (got["content"], got["finish_reason"], got["stop_reason"]) == (None, "stop", "Lyon")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_either_way(vocab: TokenVocab, tokenizer: Any, enc: Any, im_end: int, skip: bool) -> None:
    ids = [*enc("R.</think>Hi<|im_user|> ", SB, call("get_time", UTC, 0), SE), im_end]
    got = chunked_answer(vocab, chat_options(skip_special_tokens=skip), ids, prompt_ids(tokenizer, "pre_open"))
    assert (got["reasoning"], got["content"]) == ("R.", "Hi")  # the space before the call is dropped
    assert [c["arguments"] for c in got["tool_calls"]] == ['{"tz": "UTC"}']
    for off_options in (chat_options(tools=None, skip_special_tokens=skip), chat_options(tool_choice="none", skip_special_tokens=skip)):
        off = chunked_answer(vocab, off_options, ids, prompt_ids(tokenizer, "pre_open"))
        # No tool parsing: the markers are special tokens like any other, shown only when not skipped (issue #27).
        assert off["content"] == (f"Hi {SB}{call('get_time', UTC, 0)}{SE}" if not skip else f"Hi {unmarked_call('get_time', UTC, 0)}")


def test_reasoning_tokens_are_the_ids_inside_reasoning(
    vocab: TokenVocab, tokenizer: Any, enc: Any, im_end: int
) -> None:
    inner = enc("Two short thoughts.")
    for tail, finish in (([im_end], "stop"), ([], "length")):
        ids = inner + enc("</think>ok") + tail
        run = stream(
            vocab, chat_options(), ids, fixed(3), prompt_ids=prompt_ids(tokenizer, "pre_open"), finish_reason=finish
        )
        assert run.folded.usage.completion_tokens_details.reasoning_tokens == len(inner)
    unended = stream(vocab, chat_options(), [*inner, im_end], prompt_ids=prompt_ids(tokenizer, "pre_open")).folded
    assert unended.usage.completion_tokens_details.reasoning_tokens == len(inner)  # the EOS is not reasoning


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_forced_tool_choice_primes_the_call(
    vocab: TokenVocab, tokenizer: Any, enc: Any, im_end: int, tool_choice: str
) -> None:
    if tool_choice == "named":
        options = chat_options(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        output = [*enc('{"city": "Oslo"}', CE, SE), im_end]
    else:
        options = chat_options(tool_choice="required")
        output = [*enc("get_time:0", AB, '{"tz": "UTC"}', CE, SE), im_end]
    assert options.forced_prefix is not None and options.forced_prefix.startswith(SB + CB + "functions.")
    prompt = prompt_ids(tokenizer, "pre_open") + enc(options.forced_prefix)
    got = chunked_answer(vocab, options, output, prompt)
    expected = [weather(city="Oslo")] if tool_choice == "named" else [clock()]
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == expected
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (None, None, "tool_calls")


def test_written_calls_parse_back(vocab: TokenVocab, tokenizer: Any, enc: Any, im_end: int) -> None:
    calls = [ToolCallText("get_weather", {"city": "Zürich", "days": 3}), ToolCallText("get_time", {})]
    text = kimi_k2.format_reasoning("Check both.") + "On it." + kimi_k2.format_calls(calls)
    got = chunked_answer(vocab, chat_options(), [*enc(text), im_end], prompt_ids(tokenizer, "open_turn"))
    assert (got["reasoning"], got["content"]) == ("Check both.", "On it.")
    assert [(c["id"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        ("functions.get_weather:0", {"city": "Zürich", "days": 3}),
        ("functions.get_time:1", {}),
    ]


def test_skipped_special_markers_still_count(vocab: TokenVocab) -> None:
    """Kimi's `<think>` / `</think>` are special: with `skip_special_tokens` their piece is
    `("", id)`. Such a piece is the marker; one holding part of its text is only text."""
    bound = kimi_k2.BoundKimiReasoning(vocab)
    end = vocab.token_id("</think>")
    assert end is not None
    parser = bound.new(ParseOptions(tools_enabled=True), in_reasoning=True, tool_starts={})
    reasoning: list[str] = []
    rest = parser.feed([("a", 1), ("</thi", end), ("b ", 2), ("", end), ("c", 3)], reasoning)
    assert ("".join(reasoning), list(rest)) == ("a</thib", [("c", 3)])
    assert parser.reasoning_tokens == 3


def test_plain_string_values_stream_as_they_arrive() -> None:
    args = ArgumentsText({"note": {"type": "string"}, "days": {"type": "integer"}})
    out = []
    for char in '{"note": "a long note", "days": "3"}':
        args.feed(char)
        out.append(args.take())
    args.finish()
    out.append(args.take())
    assert "".join(out) == '{"note": "a long note", "days": 3}'
    assert all(out[i] for i in range(10, 21))  # the string-typed value is never held
    schemaless = ArgumentsText(None)
    schemaless.feed('  {"days": "3"}')
    assert schemaless.take() == '  {"days": "3"}'


def test_schema_fix_up_follows_vllm_rules() -> None:
    assert coerce_text("12", {"integer"}) == 12
    assert coerce_text("1.0", {"number"}) == 1 and isinstance(coerce_text("1.0", {"number"}), int)
    assert coerce_text("inf", {"number"}) == "inf"
    assert coerce_text("null", {"string", "null"}) is None
    assert coerce_text("yes", {"boolean"}) == "yes"
    assert coerce_text("[1]", {"integer"}) == [1]  # not an integer, but JSON
    assert coerce_text("7", {"long"}) == 7  # type aliases
    assert coerce_value(2, {"type": "string"}) == ("2", True)
    assert coerce_value(2.0, {"type": "integer"}) == (2.0, False)
    assert coerce_value([1, "2"], {"items": {"type": "integer"}}) == ([1, 2], True)
    assert coerce_value({"n": "5"}, {"properties": {"n": {"type": "number"}}}) == ({"n": 5}, True)
    assert coerce_value("x", {"enum": ["x", None]}) == ("x", False)


def test_parser_work_does_not_grow_with_output(vocab: TokenVocab, enc: Any, im_end: int) -> None:
    """Each step hands over its own text at once: nothing is re-joined or held beyond a
    whitespace run, so a long reasoning and a long argument stream token by token."""
    words = enc(" word" * 400)
    opening = enc("</think>", SB, CB, "functions.get_weather:0", AB, '{"note": "')
    ids = words + opening + words + enc('"}', CE, SE) + [im_end]
    in_arguments = range(len(words) + len(opening), 2 * len(words) + len(opening))
    derender = ChatDerender(vocab, chat_options(), model="m")
    for i, token_id in enumerate(ids[:-1]):
        chunk = derender.step(0, [token_id])
        if i < len(words) or i in in_arguments:
            assert chunk is not None  # every word is visible in its own step


def test_text_route_gives_the_token_route_answer(vocab: TokenVocab, tokenizer: Any, enc: Any, im_end: int) -> None:
    """An engine in `text` mode (special tokens kept) sends text without ids: the markers are
    found by their strings, and the answer is the token route's."""
    vector = VECTORS["parallel_calls"]
    ids = [*enc(*vector.output), im_end]
    prompt = prompt_ids(tokenizer, "pre_open")
    expected = chunked_answer(vocab, chat_options(), ids, prompt)
    text = "".join(s if isinstance(s, str) else s.text for s in vector.output)
    for width in (1, 3, 7, 40):
        derender = ChatDerender(vocab, chat_options(), model="m", prompt_token_ids=prompt)
        pieces = [text[i : i + width] for i in range(0, len(text), width)]
        for i, piece in enumerate(pieces):
            derender.step_text(0, piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        assert comparable_response(derender.response()) == expected  # ids are the model's: no counter
