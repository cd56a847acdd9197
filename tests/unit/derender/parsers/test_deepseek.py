"""DeepSeek reasoning (`deepseek_r1`, `deepseek_v3`) and tools (`deepseek_v3`, `deepseek_v31`) through the chat derender.

Every vector is fed in chunks of 1..8 tokens and in six random splits; the
folded stream must equal the non-streamed `response()` for every chunking
(DERENDER_CASES' master test), and that answer must be the expected one. The
tokenizer is the offline Qwen3 BPE with DeepSeek's markers added; how it
differs from DeepSeek's own is written in `tests.support.deepseek`.
"""

from __future__ import annotations

import json
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import deepseek
from derender.parsers.base import ToolCallText
from derender.parsers.deepseek import CALL_BEGIN as CB
from derender.parsers.deepseek import CALL_END as CE
from derender.parsers.deepseek import CALLS_BEGIN as SB
from derender.parsers.deepseek import CALLS_END as SE
from derender.parsers.deepseek import SEP
from derender.parsers.registry import REASONING_PARSERS, TOOL_PARSERS
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from tests.support.deepseek import EOS, deepseek_tokenizer_dir
from tests.support.streams import chunked_answer, comparable_response, counter_ids, fixed, stream, whole
from tests.support.tools import WEATHER_TOOLS

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [*USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}]
PARIS = {"city": "Paris", "days": 2}
UTC = {"tz": "UTC"}
NON_ASCII = {"city": "Zürich 世界 🫠", "note": "Zeile 1\nZeile 2\t\"q\""}


@dataclass(frozen=True)
class Spelled:
    """Text written one character per token: marker spellings that are not the marker tokens."""

    text: str


def v3_call(name: str, arguments: Any, *, raw: str | None = None, indent: int | None = None) -> str:
    body = raw if raw is not None else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"{CB}function{SEP}{name}\n```json\n{body}\n```{CE}"


def v31_call(name: str, arguments: Any, *, raw: str | None = None, indent: int | None = None) -> str:
    body = raw if raw is not None else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"{CB}{name}{SEP}{body}{CE}"


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(deepseek_tokenizer_dir(qwen3_tokenizer_dir))


@pytest.fixture(scope="module")
def vocab(tokenizer: Any) -> TokenVocab:
    return vocab_for(tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer: Any) -> Callable[..., list[int]]:
    def encode(*segments: str | Spelled) -> list[int]:
        ids: list[int] = []
        for segment in segments:
            if isinstance(segment, Spelled):
                ids += [i for char in segment.text for i in tokenizer.encode(char, add_special_tokens=False)]
            else:
                ids += tokenizer.encode(segment, add_special_tokens=False)
        return ids

    return encode


@pytest.fixture(scope="module")
def eos(tokenizer: Any) -> int:
    return int(tokenizer.convert_tokens_to_ids(EOS))


def chat_options(
    tools: str | None = "deepseek_v3", *, reasoning: str | None = "deepseek_r1", offered: Any = TOOLS, **request: Any
) -> ChatOptions:
    body: dict[str, Any] = {"model": "m", "messages": USER, **request}
    if offered:
        body["tools"] = offered
    parsed = msgspec.convert(body, ChatCompletionRequest)
    return ChatOptions.from_request(parsed, reasoning_parser=reasoning, tool_parser=tools)


def prompt_ids(tokenizer: Any, kind: str = "thinking", messages: list[Any] = USER) -> list[int]:
    """`thinking`: the turn pre-opens `<think>`; `closed`: it is closed (`</think>`, V3.1
    without thinking); `bare`: `<｜Assistant｜>` alone (R1's and V3's original templates)."""
    kwargs: dict[str, Any] = {"thinking": kind == "thinking", "bare_turn": kind == "bare"}
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Vector:
    output: tuple[str | Spelled, ...]
    reasoning: str | None = None
    content: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    """(name, arguments parsed as JSON, or the raw text where it is not JSON)."""
    finish: str = "tool_calls"
    tools: str | None = "deepseek_v3"
    reasoning_parser: str = "deepseek_r1"
    eos: bool = True
    prompt: str = "thinking"
    request: dict[str, Any] = field(default_factory=dict)
    offered: Any = field(default_factory=lambda: TOOLS)
    messages: list[Any] = field(default_factory=lambda: USER)


V31 = "deepseek_v31"

VECTORS: dict[str, Vector] = {
    # -- reasoning ------------------------------------------------------------
    "r1_output_starts_inside_reasoning": Vector(
        ("Plan it.\n</think>\n\nParis is sunny.",), reasoning="Plan it.\n", content="\n\nParis is sunny.", finish="stop"
    ),
    "r1_model_writes_think_itself": Vector(
        ("<think>\nHm.\n</think>\n\nHello.",), reasoning="\nHm.\n", content="\n\nHello.", finish="stop", prompt="bare"
    ),
    "r1_bare_turn_starts_in_reasoning": Vector(("Hm.</think>Hello.",), reasoning="Hm.", content="Hello.", finish="stop", prompt="bare"),
    "r1_closed_in_prompt_is_content": Vector(("Hello </think> there.",), content="Hello </think> there.", finish="stop", prompt="closed"),
    "r1_never_closed_is_all_reasoning": Vector(("Still thinking \n ",), reasoning="Still thinking \n ", finish="length", eos=False),
    "r1_earlier_turn_does_not_decide": Vector(
        ("Hm.</think>Warm.",), reasoning="Hm.", content="Warm.", finish="stop", prompt="bare", messages=HISTORY
    ),
    "r1_second_think_end_stays_in_content": Vector(
        ("R.</think>A</think>B<think>C",), reasoning="R.", content="A</think>B<think>C", finish="stop"
    ),
    "v3_reasoning_thinking_turn": Vector(
        ("Deep.</think>", SB, v31_call("get_time", UTC), SE), reasoning="Deep.", calls=[("get_time", UTC)], tools=V31,
        reasoning_parser="deepseek_v3",
    ),
    "v3_reasoning_closed_turn_is_identity": Vector(
        ("Hi <think>x</think> there.",), content="Hi <think>x</think> there.", finish="stop", reasoning_parser="deepseek_v3",
        prompt="closed",
    ),
    "v3_reasoning_bare_turn_is_content": Vector(
        ("Hi.</think>there",), content="Hi.</think>there", finish="stop", reasoning_parser="deepseek_v3", prompt="bare"
    ),
    # A call section inside unclosed reasoning is reasoning (vLLM never ends R1 reasoning on a call).
    "r1_call_inside_reasoning": Vector(
        ("Maybe ", SB, v31_call("get_time", UTC), SE), reasoning=f"Maybe {SB}{v31_call('get_time', UTC)}{SE}", finish="stop",
        tools=V31,
    ),
    # -- V3 calls -------------------------------------------------------------
    "v3_call_right_after_reasoning": Vector(("R.</think>", SB, v3_call("get_time", UTC), SE), reasoning="R.", calls=[("get_time", UTC)]),
    "v3_content_then_parallel_calls": Vector(
        ("R.\n</think>\n\nLet me check.\n", SB, v3_call("get_weather", PARIS), "\n", v3_call("get_time", UTC), SE),
        reasoning="R.\n", content="\n\nLet me check.", calls=[("get_weather", PARIS), ("get_time", UTC)],
    ),
    "v3_whitespace_before_calls_is_dropped": Vector(
        ("R.</think>\n\n", SB, v3_call("get_time", UTC), SE), reasoning="R.", calls=[("get_time", UTC)]
    ),
    "v3_multiline_non_ascii": Vector(
        ("R.</think>", SB, v3_call("get_weather", NON_ASCII, indent=2), SE), reasoning="R.", calls=[("get_weather", NON_ASCII)]
    ),
    # JSON arguments are the model's: never typed by the schema, never checked against it.
    "v3_values_not_typed_by_schema": Vector(
        ("R.</think>", SB, v3_call("get_weather", {"city": 75001, "days": "3", "zoom": True}), SE),
        reasoning="R.", calls=[("get_weather", {"city": 75001, "days": "3", "zoom": True})],
    ),
    "v3_unknown_function": Vector(("R.</think>", SB, v3_call("launch", {"speed": 3}), SE), reasoning="R.", calls=[("launch", {"speed": 3})]),
    "v3_invalid_json": Vector(
        ("R.</think>", SB, v3_call("get_time", None, raw="{tz: UTC"), SE), reasoning="R.", calls=[("get_time", "{tz: UTC")]
    ),
    "v3_backticks_inside_arguments": Vector(
        ("R.</think>", SB, v3_call("get_weather", {"city": "a\n```b`"}), SE), reasoning="R.", calls=[("get_weather", {"city": "a\n```b`"})]
    ),
    "v3_without_fence": Vector(
        ("R.</think>", SB, CB, "function", SEP, "get_time\n", '{"tz": "UTC"}', CE, SE), reasoning="R.", calls=[("get_time", UTC)]
    ),
    "v3_without_arguments_block": Vector(
        ("R.</think>", SB, CB, "function", SEP, "get_time", CE, SE), reasoning="R.", calls=[("get_time", {})]
    ),
    "v3_empty_arguments": Vector(("R.</think>", SB, v3_call("get_time", None, raw=""), SE), reasoning="R.", calls=[("get_time", {})]),
    "v3_text_after_last_call": Vector(
        ("R.</think>", SB, v3_call("get_time", UTC), SE, "\nChecking now. "), reasoning="R.", content="\nChecking now.",
        calls=[("get_time", UTC)],
    ),
    "v3_text_between_calls": Vector(
        ("R.</think>", SB, v3_call("get_time", UTC), " then ", v3_call("get_time", UTC), SE),
        reasoning="R.", content=" then", calls=[("get_time", UTC), ("get_time", UTC)],
    ),
    "v3_max_tokens_mid_arguments": Vector(
        ("R.</think>", SB, CB, "function", SEP, 'get_weather\n```json\n{"city": "Par'),
        reasoning="R.", calls=[("get_weather", {"city": "Par"})], finish="length", eos=False,  # closed (issue #27)
    ),
    "v3_max_tokens_in_closing_fence": Vector(
        ("R.</think>", SB, CB, "function", SEP, 'get_weather\n```json\n{"city": "Paris"}\n``'),
        reasoning="R.", calls=[("get_weather", {"city": "Paris"})], finish="length", eos=False,
    ),
    "v3_max_tokens_in_opening_fence": Vector(
        ("R.</think>", SB, CB, "function", SEP, "get_weather\n```js"),
        reasoning="R.", calls=[("get_weather", {})], finish="length", eos=False,
    ),
    "v3_max_tokens_mid_name": Vector(
        ("R.</think>", SB, CB, "function", SEP, "get_wea"), reasoning="R.", content=f"{SB}{CB}function{SEP}get_wea",
        finish="length", eos=False,
    ),
    "v3_unclosed_call_then_next_call": Vector(
        ("R.</think>", SB, CB, "function", SEP, 'get_time\n```json\n{"tz": "A"}\n```', v3_call("get_time", {"tz": "B"}), SE),
        reasoning="R.", calls=[("get_time", {"tz": "A"}), ("get_time", {"tz": "B"})],
    ),
    "v3_section_closed_inside_call": Vector(
        ("R.</think>", SB, CB, "function", SEP, 'get_time\n```json\n{"tz": "A"}\n```', SE, "Done."),
        reasoning="R.", content="Done.", calls=[("get_time", {"tz": "A"})],
    ),
    "v3_unclosed_section": Vector(("R.</think>", SB, v3_call("get_time", UTC)), reasoning="R.", calls=[("get_time", UTC)]),
    "v3_section_without_calls": Vector(
        ("R.</think>Hi ", SB, "nothing", SE, " end"), reasoning="R.", content=f"Hi {SB}nothing{SE} end", finish="stop"
    ),
    # A section with nothing but whitespace in it is markup, not content (issue #27).
    "v3_empty_section": Vector(("R.</think>", SB, SE), reasoning="R.", finish="stop"),
    "v31_empty_section": Vector(("R.</think>", SB, SE), reasoning="R.", finish="stop", tools=V31),
    "v3_empty_section_between_text": Vector(
        ("R.</think>Hi\n\n", SB, " ", SE, "\nDone."), reasoning="R.", content="Hi\n\n\nDone.", finish="stop"
    ),
    "v3_empty_section_at_the_end": Vector(("R.</think>Hi\n", SB, "\n", SE), reasoning="R.", content="Hi\n", finish="stop"),
    "v3_section_opened_at_the_cut": Vector(
        ("R.</think>Hi", SB), reasoning="R.", content="Hi", finish="length", eos=False
    ),
    "v3_call_markers_outside_section": Vector(
        ("R.</think>", v3_call("get_time", UTC)), reasoning="R.", content=v3_call("get_time", UTC), finish="stop"
    ),
    "v3_markers_spelled_as_text": Vector(
        ("R.</think>", Spelled(SB + v3_call("get_time", UTC) + SE)), reasoning="R.", content=SB + v3_call("get_time", UTC) + SE,
        finish="stop",
    ),
    "v3_parallel_tool_calls_false": Vector(
        ("R.</think>", SB, v3_call("get_weather", PARIS), "\n", v3_call("get_time", UTC), SE),
        reasoning="R.", calls=[("get_weather", PARIS)], request={"parallel_tool_calls": False},
    ),
    "v3_tools_not_offered": Vector(
        ("R.</think>Hi ", SB, v3_call("get_time", UTC), SE), reasoning="R.", content=f"Hi {SB}{v3_call('get_time', UTC)}{SE}",
        finish="stop", offered=None,
    ),
    "v3_tool_choice_none": Vector(
        ("R.</think>Hi ", SB, v3_call("get_time", UTC), SE), reasoning="R.", content=f"Hi {SB}{v3_call('get_time', UTC)}{SE}",
        finish="stop", request={"tool_choice": "none"},
    ),
    # -- V3.1 calls -----------------------------------------------------------
    "v31_parallel_calls": Vector(
        ("R.</think>", SB, v31_call("get_weather", PARIS), v31_call("get_time", UTC), SE),
        reasoning="R.", calls=[("get_weather", PARIS), ("get_time", UTC)], tools=V31,
    ),
    "v31_multiline_non_ascii": Vector(
        ("R.</think>", SB, v31_call("get_weather", NON_ASCII, indent=2), SE), reasoning="R.", calls=[("get_weather", NON_ASCII)],
        tools=V31,
    ),
    "v31_unknown_function_and_parameter": Vector(
        ("R.</think>", SB, v31_call("launch", {"zoom": 2}), SE), reasoning="R.", calls=[("launch", {"zoom": 2})], tools=V31
    ),
    "v31_invalid_json": Vector(
        ("R.</think>", SB, v31_call("get_time", None, raw='{"tz": '), SE), reasoning="R.", calls=[("get_time", {"tz": None})], tools=V31
    ),
    "v31_empty_arguments": Vector(("R.</think>", SB, v31_call("get_time", None, raw=""), SE), reasoning="R.", calls=[("get_time", {})], tools=V31),
    "v31_max_tokens_mid_arguments": Vector(
        ("R.</think>", SB, CB, "get_weather", SEP, '{"city": "Par'),
        reasoning="R.", calls=[("get_weather", {"city": "Par"})], finish="length", eos=False, tools=V31,
    ),
    "v31_max_tokens_mid_name": Vector(
        ("R.</think>", SB, CB, "get_wea"), reasoning="R.", content=f"{SB}{CB}get_wea", finish="length", eos=False, tools=V31
    ),
    "v31_call_end_before_separator": Vector(
        ("R.</think>", SB, CB, "get_time", CE, SE), reasoning="R.", content=f"{SB}{CB}get_time{CE}{SE}", finish="stop", tools=V31
    ),
    "v31_empty_name": Vector(
        ("R.</think>", SB, CB, SEP, "{}", CE, SE), reasoning="R.", content=f"{SB}{CB}{SEP}{{}}{CE}{SE}", finish="stop", tools=V31
    ),
    "v31_text_after_last_call": Vector(
        ("R.</think>", SB, v31_call("get_time", UTC), SE, "\nChecking now."), reasoning="R.", content="\nChecking now.",
        calls=[("get_time", UTC)], tools=V31,
    ),
    "v31_parallel_tool_calls_false": Vector(
        ("R.</think>", SB, v31_call("get_weather", PARIS), v31_call("get_time", UTC), SE),
        reasoning="R.", calls=[("get_weather", PARIS)], request={"parallel_tool_calls": False}, tools=V31,
    ),
    "v31_thinking_closed_in_prompt": Vector(
        ("Sure. ", SB, v31_call("get_time", UTC), SE), content="Sure.", calls=[("get_time", UTC)], tools=V31, prompt="closed"
    ),
}


@pytest.mark.parametrize("name", list(VECTORS))
def test_vector_in_every_chunking(name: str, vocab: TokenVocab, tokenizer: Any, enc: Any, eos: int) -> None:
    vector = VECTORS[name]
    ids = enc(*vector.output) + ([eos] if vector.eos else [])
    options = chat_options(vector.tools, reasoning=vector.reasoning_parser, offered=vector.offered, **vector.request)
    prompt = prompt_ids(tokenizer, vector.prompt, vector.messages)
    got = chunked_answer(vocab, options, ids, prompt, finish_reason="stop" if vector.eos else "length")
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (vector.reasoning, vector.content, vector.finish)
    assert [(c["name"], _json_or_raw(c["arguments"])) for c in got["tool_calls"]] == vector.calls
    assert all(c["id"].startswith("chatcmpl-tool-") for c in got["tool_calls"])


def _json_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@pytest.mark.parametrize("tools", ["deepseek_v3", V31])
def test_stop_string_inside_a_call(vocab: TokenVocab, tokenizer: Any, enc: Any, eos: int, tools: str) -> None:
    write = v3_call if tools == "deepseek_v3" else v31_call
    ids = [*enc("R.</think>", SB, write("get_weather", {"city": "Lyon", "days": 3}), SE), eos]
    got = chunked_answer(vocab, chat_options(tools, stop=["Lyon"]), ids, prompt_ids(tokenizer), finish_reason="stop")
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"city": ""}')]
    # onehop: `stop`, not `tool_calls`, when a stop string cut the call short (chat.py).
    assert (got["reasoning"], got["content"], got["finish_reason"], got["stop_reason"]) == ("R.", None, "stop", "Lyon")


def test_reasoning_tokens_are_the_ids_routed_to_reasoning(vocab: TokenVocab, tokenizer: Any, enc: Any, eos: int) -> None:
    inner = enc("Two short thoughts.")
    for prompt, head in ((prompt_ids(tokenizer), []), (prompt_ids(tokenizer, "bare"), enc("<think>"))):
        ids = head + inner + enc("</think>ok") + [eos]
        run = stream(vocab, chat_options(), ids, fixed(3), prompt_ids=prompt, finish_reason="stop")
        assert run.folded.usage.completion_tokens_details.reasoning_tokens == len(inner)
    closed = stream(vocab, chat_options(), [*inner, eos], prompt_ids=prompt_ids(tokenizer, "closed"), finish_reason="stop")
    assert closed.folded.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("tools", ["deepseek_v3", V31])
@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_forced_tool_choice_primes_the_call(vocab: TokenVocab, tokenizer: Any, enc: Any, eos: int, tools: str, tool_choice: str) -> None:
    if tool_choice == "named":
        options = chat_options(tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        rest = '{"city": "Oslo"}'
        expected = [("get_weather", {"city": "Oslo"})]
    else:
        options = chat_options(tools, tool_choice="required")
        rest = "get_time" + ("\n```json\n" if tools == "deepseek_v3" else SEP) + '{"tz": "UTC"}'
        expected = [("get_time", UTC)]
    closing = "\n```" if tools == "deepseek_v3" else ""
    assert options.forced_prefix is not None and options.forced_prefix.startswith(SB + CB)
    prompt = prompt_ids(tokenizer) + enc(options.forced_prefix)
    got = chunked_answer(vocab, options, [*enc(rest + closing, CE, SE), eos], prompt, finish_reason="stop")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == expected
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (None, None, "tool_calls")


@pytest.mark.parametrize("tools", ["deepseek_v3", V31])
def test_written_calls_parse_back(vocab: TokenVocab, tokenizer: Any, enc: Any, eos: int, tools: str) -> None:
    calls = [ToolCallText("get_weather", {"city": "Zürich", "days": 3}), ToolCallText("get_time", {})]
    factory = TOOL_PARSERS[tools]
    assert factory.format_calls is not None
    reasoning = REASONING_PARSERS["deepseek_r1"].format_reasoning
    assert reasoning is not None
    text = reasoning("Check both.") + "On it." + factory.format_calls(calls)
    prompt = prompt_ids(tokenizer, "bare")
    got = chunked_answer(vocab, chat_options(tools), [*enc(text), eos], prompt, finish_reason="stop")
    assert (got["reasoning"], got["content"]) == ("\nCheck both.\n", "\n\nOn it.")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        ("get_weather", {"city": "Zürich", "days": 3}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize("tools", ["deepseek_v3", V31])
def test_text_route_gives_the_token_route_answer(vocab: TokenVocab, tokenizer: Any, enc: Any, eos: int, tools: str) -> None:
    write = v3_call if tools == "deepseek_v3" else v31_call
    ids = [*enc("Plan.</think>Sure.\n", SB, write("get_weather", NON_ASCII), write("get_time", UTC), SE, " bye"), eos]
    options = chat_options(tools)
    prompt = prompt_ids(tokenizer)
    reference = comparable_response(whole(vocab, options, ids, prompt_ids=prompt, finish_reason="stop"))
    derender = ChatDerender(vocab, options, model="m", prompt_token_ids=prompt, new_tool_call_id=counter_ids())
    text = tokenizer.decode(ids[:-1])
    cuts = [*range(0, len(text), 3), len(text)]
    for start, end in itertools.pairwise(cuts):
        derender.step_text(0, text[start:end], finish_reason="stop" if end == len(text) else None)
    assert comparable_response(derender.response()) == reference


def test_markers_must_be_single_tokens(qwen3_vocab: TokenVocab) -> None:
    from derender.parsers.base import UnknownParser

    with pytest.raises(UnknownParser):
        deepseek.bind_v3(qwen3_vocab)
