"""qwen3_coder / qwen3_xml tool calls through ChatDerender, fed in every chunking.

Each vector is model output text (or token pieces) after a Qwen3 prompt; it is
streamed one token per chunk, in fixed widths 2..8 and in random splits, and
every folded answer must equal the non-streamed `response()`. The expected
answers follow vLLM 0.32's `qwen3_coder` except where it loses text or writes
invalid JSON (see the module docstring of `derender.parsers.qwen3_coder`
and tests/vllm/parity_cases/qwen3_coder.py for those cases against vLLM).

The tokenizer is the offline Qwen3 one (`qwen3_tokenizer` fixture), which is
the tokenizer Qwen3-Coder ships. Qwen3.5 and later have a larger vocabulary:
there `<tool_call>`, `</tool_call>`, `<think>` and `</think>` are single added
tokens too and `<function=`, `<parameter=`, ... plain text, but every id and
the split of ordinary text differ, so nothing here relies on an id or a split
beyond the markers being single tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import TOOL_PARSERS
from derender.parsers.base import ToolCallText
from derender.parsers.qwen3_coder import forced_prefix, format_calls
from derender.parsers.typed_values import STRING_ONLY, coerce, parameter_types
from derender.text import TextParams
from derender.vocab import TokenVocab
from wire.openai_schema import ChatCompletionRequest
from engine.qwen3.vocab import IM_END_ID
from tests.support.streams import FAMILY_CHUNKINGS, comparable_response, counter_ids, fold_chunks, stream, whole

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "temp": {"type": "number"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "maybe": {"type": ["string", "null"]},
        "unit": {"enum": ["c", "f"]},
        "level": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "size": {"type": "int"},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
CHUNKINGS = FAMILY_CHUNKINGS
THINK = "<think>\nLet me see.\n</think>\n\n"


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@dataclass(frozen=True)
class Answer:
    content: str | None
    reasoning: str | None
    calls: list[tuple[str, Any]]
    """(name, parsed arguments) per call."""
    finish_reason: str | None
    raw_arguments: list[str]


def request(**extra: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    body.update(extra)
    return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)


def options(req: ChatCompletionRequest, *, stop: Sequence[str] = (), parser: str = "qwen3_coder") -> ChatOptions:
    text = TextParams(stop=tuple(stop)) if stop else None
    return ChatOptions.from_request(req, reasoning_parser="qwen3", tool_parser=parser, text=text)


def answer(
    vocab: TokenVocab,
    ids: Sequence[int],
    *,
    opts: ChatOptions,
    finish_reason: str | None = None,
    prompt_ids: Sequence[int] = (),
) -> Answer:
    """The answer for `ids`, asserting it is the same in every chunking and non-streamed."""
    reference = comparable_response(whole(vocab, opts, ids, finish_reason=finish_reason, prompt_ids=prompt_ids))
    for sizes in CHUNKINGS:
        folded = stream(vocab, opts, ids, sizes, finish_reason=finish_reason, prompt_ids=prompt_ids).folded
        assert folded.as_comparable() == reference
        headers = [d for delta in folded.deltas for d in delta.get("tool_calls", []) if "id" in d]
        assert [h["index"] for h in headers] == list(range(len(reference["tool_calls"])))
    calls = reference["tool_calls"]
    return Answer(
        content=reference["content"],
        reasoning=reference["reasoning"],
        calls=[(c["name"], json.loads(c["arguments"])) for c in calls],
        finish_reason=reference["finish_reason"],
        raw_arguments=[c["arguments"] for c in calls],
    )


@pytest.fixture
def enc(qwen3_tokenizer: Any) -> Any:
    return lambda *parts: [i for part in parts for i in qwen3_tokenizer.encode(part, add_special_tokens=False)]


@pytest.fixture
def auto() -> ChatOptions:
    return options(request(tool_choice="auto"))


# -- well-formed calls -----------------------------------------------------------


def test_call_after_reasoning_with_typed_values(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + call(
        "get_weather",
        ("city", "Paris"),
        ("days", "3"),
        ("temp", "-2.5"),
        ("metric", "True"),
        ("opts", '{"wind": [1, 2], "x": null}'),
        ("tags", '["a", "b"]'),
        ("maybe", "null"),
        ("unit", "c"),
        ("level", "7"),
        ("size", "4.0"),
    )
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    assert got.reasoning == "\nLet me see.\n"
    assert got.content is None
    assert got.finish_reason == "tool_calls"
    assert got.calls == [
        (
            "get_weather",
            {
                "city": "Paris",
                "days": 3,
                "temp": -2.5,
                "metric": True,
                "opts": {"wind": [1, 2], "x": None},
                "tags": ["a", "b"],
                "maybe": None,
                "unit": "c",
                "level": 7,
                "size": 4,
            },
        )
    ]
    # json.dumps spacing, as vLLM writes the final arguments.
    assert got.raw_arguments[0].startswith('{"city": "Paris", "days": 3, "temp": -2.5, "metric": true, ')


def test_call_right_after_think_end_and_inside_reasoning(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    tz = call("get_time", ("tz", "UTC"))
    right_after = answer(qwen3_vocab, [*enc("<think>\nGo.\n</think>" + tz), IM_END_ID], opts=auto)
    assert right_after.content is None
    assert right_after.calls == [("get_time", {"tz": "UTC"})]
    inside = answer(qwen3_vocab, [*enc("<think>\nI will call " + tz), IM_END_ID], opts=auto)
    assert inside.reasoning == "\nI will call "
    assert inside.content is None
    assert inside.calls == [("get_time", {"tz": "UTC"})]


def test_parallel_calls_and_a_parameterless_one(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    calls = (call("get_weather", ("city", "Paris")), call("get_weather", ("city", "Rome")), call("ping"))
    text = THINK + "\n".join(calls)
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    assert got.calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}), ("ping", {})]
    assert got.raw_arguments[2] == "{}"
    assert got.content is None


def test_multiline_non_ascii_values_keep_inner_newlines(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    code = 'def f(a, b):\n    return a < b and "</p>" != \'\\\\\'\n\n'
    text = THINK + call("get_weather", ("city", "Zürich 世界 🫠𓀀"), ("note", code)) + (
        "\n<tool_call>\n<function=get_time>\n<parameter=tz>Asia/東京</parameter>\n</function>\n</tool_call>"
    )
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    # One framing newline is trimmed at each end of a value, no more.
    assert got.calls == [
        ("get_weather", {"city": "Zürich 世界 🫠𓀀", "note": code}),
        ("get_time", {"tz": "Asia/東京"}),
    ]
    assert "\\u" not in got.raw_arguments[0]


def test_content_before_and_after_calls(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + "Let me check.\n" + call("get_time", ("tz", "UTC")) + "\nIt is noon.\n"
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    # Whitespace right before a call is dropped (issue #27), after it content starts from the
    # first non-space (trailing whitespace after a call is dropped).
    assert got.content == "\n\nLet me check.\nIt is noon."
    assert got.calls == [("get_time", {"tz": "UTC"})]


def test_whitespace_only_content_around_calls_is_null(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + call("get_time", ("tz", "UTC")) + "\n\n"
    assert answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto).content is None


def test_thinking_disabled_is_all_content(qwen3_vocab: TokenVocab, enc: Any) -> None:
    opts = options(request(tool_choice="auto", chat_template_kwargs={"enable_thinking": False}))
    got = answer(qwen3_vocab, [*enc("Sure.\n" + call("get_time", ("tz", "UTC"))), IM_END_ID], opts=opts)
    assert got.reasoning is None
    assert got.content == "Sure."
    assert got.calls == [("get_time", {"tz": "UTC"})]


def test_values_without_framing_newlines_and_spaced_tags(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + (
        "<tool_call>\n<function= get_weather >\n<parameter=city>Oslo</ parameter >"
        "< parameter = days>\n\n2\n\n</parameter>\n<parameter=unit >c</parameter></function>\n</tool_call>"
    )
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    # vLLM's regex: spaces inside tags are allowed, the name keeps trailing spaces.
    assert got.calls == [("get_weather", {"city": "Oslo", "days": 2, "unit ": "c"})]


# -- schema typing ---------------------------------------------------------------------


def test_values_the_schema_does_not_type_stay_strings(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + call("get_weather", ("city", "7"), ("extra", "42"), ("days", "seven"), ("opts", '{"a": 1')) + call(
        "ping", ("q", "5")
    ) + call("lookup", ("n", "1"), ("flag", "true"))
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    assert got.calls == [
        ("get_weather", {"city": "7", "extra": "42", "days": "seven", "opts": '{"a": 1'}),
        ("ping", {"q": "5"}),
        ("lookup", {"n": "1", "flag": "true"}),  # an unknown function is still a call, untyped
    ]


COERCIONS: list[tuple[dict[str, Any], str, Any]] = [
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " 7 ", 7),
    ({"type": "integer"}, "1e3", 1000.0),  # not an int: read as JSON
    ({"type": "integer"}, "seven", "seven"),
    ({"type": "integer"}, "[1, 2]", [1, 2]),
    ({"type": "number"}, "2.0", 2),
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "inf", "inf"),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "boolean"}, "TRUE", True),
    ({"type": "boolean"}, "0", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "null"}, "Null", None),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": "object"}, '{"a": 1}', {"a": 1}),
    ({"type": "object"}, "5", 5),
    ({"type": "array"}, "[1e999]", "[1e999]"),
    ({"type": "string"}, "42", "42"),
    ({"type": ["string", "integer"]}, "42", 42),
    ({"enum": [1, 2]}, "2", 2),
    ({"enum": [True]}, "true", True),
    ({"anyOf": [{"type": "number"}, {"type": "string"}]}, "x", "x"),
    ({"oneOf": [{"$ref": "#/x"}]}, "12", "12"),
    ({"type": "float64"}, "1.5", 1.5),
    ({"type": "dict"}, "{}", {}),
    ({"type": "weird"}, "12", 12),
    ({"type": "weird"}, "abc", "abc"),
    ({}, "12", "12"),
]


def test_coercion_follows_vllm_rules() -> None:
    for schema, text, value in COERCIONS:
        got = coerce(text, parameter_types({"p": schema}, "p"))
        assert (got, type(got)) == (value, type(value)), (schema, text)


def test_only_string_only_parameters_stream() -> None:
    props = {"s": {"type": "string"}, "e": {"enum": ["a"]}, "n": {"type": ["string", "null"]}, "x": "not a schema"}
    assert parameter_types(props, "s") == STRING_ONLY
    assert parameter_types(props, "e") == STRING_ONLY
    assert parameter_types(props, "x") == STRING_ONLY
    assert parameter_types(props, "missing") == STRING_ONLY
    assert parameter_types(props, "n") == frozenset(("string", "null"))
    assert parameter_types(None, "s") == STRING_ONLY


def test_string_values_stream_as_they_arrive(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + call("get_weather", ("days", "3"), ("city", "A long city name that streams"))
    run = stream(qwen3_vocab, auto, [*enc(text), IM_END_ID])
    fragments = [
        d["function"]["arguments"]
        for delta in run.folded.deltas
        for d in delta.get("tool_calls", [])
        if d.get("function", {}).get("arguments")
    ]
    # A typed value is written once complete; a string value piece by piece.
    assert '{"days": 3' in fragments
    assert len([f for f in fragments if f in (" long", " city", " name")]) == 3
    assert json.loads("".join(fragments)) == {"days": 3, "city": "A long city name that streams"}


# -- cut short ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tail", "arguments"),
    [
        ("<parameter=days>\n3\n</parameter>\n<parameter=city>\nPar", {"days": 3, "city": "Par"}),
        ("<parameter=city>\nRome\n</parameter>\n<parameter=days>\n1", {"city": "Rome", "days": 1}),
        ("<parameter=city>\nRome\n</parameter>\n<parameter=days>\n", {"city": "Rome"}),
        ("<parameter=city>\nRome\n</param", {"city": "Rome\n</param"}),
        ("<parameter=city>\nRome\n</parameter>\n<param", {"city": "Rome"}),
        ("<parameter=ci", {}),
        ("", {}),
    ],
)
def test_truncated_mid_call(
    qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions, tail: str, arguments: dict[str, Any]
) -> None:
    text = THINK + "<tool_call>\n<function=get_weather>\n" + tail
    got = answer(qwen3_vocab, enc(text), opts=auto, finish_reason="length")
    assert got.finish_reason == "length"
    assert got.calls == [("get_weather", arguments)]
    assert got.content is None


def test_truncated_in_the_name_or_before_it(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    cut_name = answer(qwen3_vocab, enc(THINK + "<tool_call>\n<function=get_ti"), opts=auto, finish_reason="length")
    assert cut_name.calls == [("get_ti", {})]  # vLLM's best effort: the name so far
    cut_open = answer(qwen3_vocab, enc(THINK + "Hm <tool_call>\n<func"), opts=auto, finish_reason="length")
    assert cut_open.calls == []
    assert cut_open.content == "\n\nHm <tool_call>\n<func"


def test_stop_string_inside_a_call(qwen3_vocab: TokenVocab, enc: Any) -> None:
    opts = options(request(tool_choice="auto"), stop=["Lyon"])
    text = THINK + call("get_weather", ("days", "2"), ("city", "Lyon"), ("note", "x"))
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=opts, finish_reason="stop")
    assert got.calls == [("get_weather", {"days": 2})]
    assert got.content is None
    opts = options(request(tool_choice="auto"), stop=["ly"])
    got = answer(qwen3_vocab, [*enc(THINK + call("get_weather", ("city", "Lyon is lovely"))), IM_END_ID], opts=opts)
    assert got.calls == [("get_weather", {"city": "Lyon is love"})]


# -- bad output ----------------------------------------------------------------------------


def test_unclosed_tags(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + (
        # </parameter> missing before the next <parameter=: the value ends there (vLLM's regex)
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n"
        # </parameter> missing before </function>: the value is kept as far as it came
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</function>\n</tool_call>\n"
        # </tool_call> missing before the next <tool_call>
        "<tool_call>\n<function=ping>\n</function>\n"
        # </function> missing: </tool_call> closes the call and the text after it is content
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</tool_call>\nDone."
    )
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    assert got.calls == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"tz": "UTC"}),
        ("ping", {}),
        ("get_time", {"tz": "CET"}),
    ]
    assert got.content == "\nDone."


def test_blocks_that_never_name_a_function_are_content(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    hermes_style = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    got = answer(qwen3_vocab, [*enc(THINK + hermes_style + "\n<tool_call>\n</tool_call>"), IM_END_ID], opts=auto)
    assert got.calls == []
    assert got.content == "\n\n" + hermes_style + "\n<tool_call>\n</tool_call>"
    assert got.finish_reason == "stop"
    nameless = answer(qwen3_vocab, [*enc(THINK + "<function=>\n</function> ok"), IM_END_ID], opts=auto)
    assert nameless.calls == []
    assert nameless.content == "\n\n<function=>\n</function> ok"


def test_bare_function_without_tool_call(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + "Sure <function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>\nThanks!"
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    assert got.calls == [("get_time", {"tz": "UTC"})]
    assert got.content == "\n\nSure\nThanks!"


def test_marker_text_split_across_tokens_is_text(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    # `<tool_call>` spelled by ordinary tokens is not the marker: content, and the
    # `<function=` after it opens a bare call, as in vLLM's streamed answer.
    rest = "_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
    ids = enc(THINK, "<tool", rest)
    got = answer(qwen3_vocab, [*ids, IM_END_ID], opts=auto)
    assert got.content == "\n\n<tool_call>"
    assert got.calls == [("get_time", {"tz": "UTC"})]


def test_literal_markers_and_tags_inside_a_value(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    value = "print('<tool_call>')  # </tool_call> <function=x> </para <parameterX"
    got = answer(qwen3_vocab, [*enc(THINK + call("get_weather", ("note", value))), IM_END_ID], opts=auto)
    assert got.calls == [("get_weather", {"note": value})]


def test_repeated_parameter_parses_to_its_last_value(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    text = THINK + call("get_weather", ("city", "A"), ("days", "1"), ("city", "B"))
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=auto)
    assert got.calls == [("get_weather", {"city": "B", "days": 1})]  # vLLM: first position, last value


def test_parallel_tool_calls_false_keeps_the_first(qwen3_vocab: TokenVocab, enc: Any) -> None:
    opts = options(request(tool_choice="auto", parallel_tool_calls=False))
    text = THINK + call("get_time", ("tz", "UTC")) + "\n" + call("ping") + "\n" + call("get_time", ("tz", "CET"))
    got = answer(qwen3_vocab, [*enc(text), IM_END_ID], opts=opts)
    assert got.calls == [("get_time", {"tz": "UTC"})]
    assert got.content is None


@pytest.mark.parametrize(
    "req", [request(tools=None), request(tool_choice="none")], ids=["no_tools", "tool_choice_none"]
)
def test_no_tool_parsing_without_tools(qwen3_vocab: TokenVocab, enc: Any, req: ChatCompletionRequest) -> None:
    text = call("get_time", ("tz", "UTC"))
    got = answer(qwen3_vocab, [*enc(THINK + text), IM_END_ID], opts=options(req))
    assert got.calls == []
    assert got.content == "\n\n" + text
    assert got.finish_reason == "stop"


# -- the factory: aliases, the writer, forcing ----------------------------------------------


def test_registered_under_both_vllm_names() -> None:
    assert TOOL_PARSERS["qwen3_coder"] is TOOL_PARSERS["qwen3_xml"]


def test_format_calls_round_trips(qwen3_vocab: TokenVocab, enc: Any, auto: ChatOptions) -> None:
    calls = [
        ToolCallText(
            "get_weather", {"city": "São Paulo\nBR", "days": 3, "metric": False, "opts": {"a": [1]}, "maybe": None}
        ),
        ToolCallText("ping", {}),
    ]
    text = format_calls(calls)
    assert text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\nBR\n</parameter>\n")
    assert '<parameter=opts>\n{"a": [1]}\n</parameter>\n' in text
    assert text.endswith("</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>")
    got = answer(qwen3_vocab, [*enc(THINK + text), IM_END_ID], opts=auto)
    assert got.calls == [(c.name, dict(c.arguments)) for c in calls]


def test_forced_named_and_required_tool_choice(qwen3_vocab: TokenVocab, enc: Any) -> None:
    assert forced_prefix("get_time") == "<tool_call>\n<function=get_time>\n"
    assert forced_prefix(None) == "<tool_call>\n<function="
    named = options(request(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.forced_prefix == "<tool_call>\n<function=get_time>\n"
    ids = [*enc("<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"), IM_END_ID]
    got = answer(qwen3_vocab, ids, opts=named)
    assert got.calls == [("get_time", {"tz": "UTC"})]
    assert got.reasoning is None and got.content is None
    required = options(request(tool_choice="required"))
    assert required.forced_prefix == "<tool_call>\n<function="
    got = answer(qwen3_vocab, [*enc("ping>\n</function>\n</tool_call>"), IM_END_ID], opts=required)
    assert got.calls == [("ping", {})]


def test_text_route_gives_the_token_route_answer(
    qwen3_vocab: TokenVocab, qwen3_tokenizer: Any, auto: ChatOptions
) -> None:
    """The text route recovers `<tool_call>` from text: same answer, text fed in uneven deltas."""
    text = THINK + "Ok.\n" + call("get_weather", ("city", "Paris"), ("days", "2")) + "\n" + call("ping") + "\nBye."
    ids = qwen3_tokenizer.encode(text, add_special_tokens=False)
    reference = answer(qwen3_vocab, [*ids, IM_END_ID], opts=auto)
    derender = ChatDerender(qwen3_vocab, auto, model="m", new_tool_call_id=counter_ids())
    chunks = derender.start()
    for start in range(0, len(text), 7):
        last = start + 7 >= len(text)
        chunk = derender.step_text(0, text[start : start + 7], finish_reason="stop" if last else None)
        if chunk is not None:
            chunks.append(chunk)
    folded = fold_chunks(chunks)
    assert folded.content == reference.content == "\n\nOk.\nBye."
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.tool_calls] == reference.calls
    assert reference.calls == [("get_weather", {"city": "Paris", "days": 2}), ("ping", {})]
