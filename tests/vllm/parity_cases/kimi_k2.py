"""onehop's kimi_k2 reasoning + tool parsing against vLLM 0.32's `kimi_k2`, through the parity oracle.

Each case is Kimi K2 output encoded with the Kimi test tokenizer (Qwen3's BPE
plus Kimi's special tokens; what differs from Kimi's own is in
`tests.support.kimi_k2`) after a prompt rendered with its test template, run
through vLLM's coupled chat serving in-process (`scripts/vllm_parse_oracle.py`,
one oracle process for the test session, `model_type` `kimi_k2`) and through onehop's
derender, for six chunkings and the non-streamed path.

Where vLLM's streamed and non-streamed answers disagree, or vLLM loses text or
writes invalid JSON, onehop gives one answer (vLLM's non-streamed one unless it
is plainly wrong). Each such difference is a named `Deviation` carrying both
sides' exact values: the test fails if either side changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from derender.parsers.kimi_k2 import (
    ARGUMENT_BEGIN as AB,
    CALL_BEGIN as CB,
    CALL_END as CE,
    SECTION_BEGIN as SB,
    SECTION_END as SE,
)
from derender.vocab import vocab_for
from tests.support import parity
from tests.support.kimi_k2 import OPEN_TURN, kimi_tokenizer_dir
from tests.support.parity import Deviation, Split, both, encode
from tests.support.tools import WEATHER_TOOLS
from tests.vllm.parity_cases.family import Built, Counted, Family, Fixture, StreamTokens, build_all

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
HISTORY = [*USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And tomorrow?"}]
PARIS: dict[str, Any] = {"city": "Paris", "days": 2}
UTC: dict[str, Any] = {"tz": "UTC"}
NON_ASCII = {"city": "Zürich", "note": 'Grüße aus 世界 🫠\nzweite Zeile\n\tein Tab, "Zitat"'}


def call(
    name: str, arguments: dict[str, Any] | None, index: int, *, raw: str | None = None, indent: int | None = None
) -> str:
    body = raw if raw is not None else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"{CB}functions.{name}:{index}{AB}{body}{CE}"


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output and the request around it."""

    output: tuple[str | Split, ...]
    eos: bool = True
    stop: tuple[str, ...] = ()
    prompt: Literal["pre_open", "open_turn"] = "pre_open"
    """`pre_open`: the template opens `<think>` (K2.5); `open_turn`: the model writes it (K2-Thinking)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: bool = True
    reasoning_parser: str | None = "kimi_k2"
    messages: list[dict[str, Any]] = field(default_factory=lambda: USER)
    request: dict[str, Any] = field(default_factory=dict)


SPECS: dict[str, Spec] = {
    "reasoning_content_call": Spec(("Plan it.\n</think>Let me check.\n", SB, call("get_weather", PARIS, 0), SE)),
    "parallel_calls_with_layout": Spec(
        (
            "Two cities.\n\n</think>\n\n",
            SB,
            "\n",
            call("get_weather", PARIS, 0),
            "\n",
            call("get_weather", {"city": "Rome"}, 1),
            "\n",
            SE,
        )
    ),
    "section_ends_reasoning": Spec(("Straight to the call  ", SB, call("get_time", UTC, 0), SE)),
    "model_opens_think": Spec(("<think>Short.</think>Hello", SB, call("get_time", UTC, 0), SE), prompt="open_turn"),
    "thinking_kwarg_off": Spec(("Sure. ", SB, call("get_time", UTC, 0), SE), template_kwargs={"thinking": False}),
    "enable_thinking_off": Spec(
        ("Sure.", SB, call("get_time", UTC, 0), SE), template_kwargs={"enable_thinking": False}
    ),
    "non_ascii_multiline_arguments": Spec(
        ("Umlaute 世界.</think>", SB, call("get_weather", NON_ASCII, 0, indent=2), SE)
    ),
    "schema_typed_values": Spec(
        (
            "R.</think>",
            SB,
            call("get_weather", None, 0, raw='{"city": 75001, "days": "3", "metric": "true", "note": "4"}'),
            SE,
        )
    ),
    "max_tokens_mid_call": Spec(("Cut.</think>", SB, CB, "functions.get_weather:0", AB, '{"city": "Par'), eos=False),
    "stop_string_inside_call": Spec(
        ("Stop.</think>", SB, call("get_weather", {"city": "Lyon", "days": 3}, 0), SE), stop=("Lyon",)
    ),
    "text_after_last_call": Spec(
        ("Then talk.</think>", SB, call("get_time", UTC, 0), SE, "\nI will report back shortly.")
    ),
    "text_between_calls": Spec(
        ("R.</think>", SB, call("get_time", UTC, 0), " and then ", call("get_time", UTC, 1), SE)
    ),
    "call_left_open": Spec(
        ("R.</think>", SB, CB, "functions.get_weather:0", AB, '{"city": "A"}', call("get_time", {"tz": "B"}, 1), SE)
    ),
    "calls_without_arguments": Spec(
        ("R.</think>", SB, CB, "functions.get_time:0", AB, CE, CB, "functions.get_time:1", CE, SE)
    ),
    "header_without_index": Spec(("R.</think>", SB, CB, "functions.get_time", AB, '{"tz": "UTC"}', CE, SE)),
    "markers_split_across_tokens": Spec(("R.</think>", Split(SB + call("get_time", UTC, 0) + SE))),
    "earlier_turn_ends_with_think": Spec(("<think>New.</think>Warm.",), prompt="open_turn", messages=HISTORY),
    "tools_not_offered": Spec(("R.</think>Text ", SB, call("get_time", UTC, 0), SE, " tail"), tools=False),
    "parallel_tool_calls_false": Spec(
        ("R.</think>", SB, call("get_weather", PARIS, 0), call("get_time", UTC, 1), SE),
        request={"parallel_tool_calls": False},
    ),
    "invalid_json": Spec(("R.</think>", SB, call("get_time", None, 0, raw="{tz: UTC"), SE)),
    "unknown_function": Spec(("R.</think>", SB, call("launch", {"speed": "3"}, 0), SE)),
    "stray_markers_in_content": Spec(("R.</think>A</think>B<think>C", CE, "D<|im_user|> ", SE, "E")),
    "reasoning_whitespace": Spec(("\n  Lead and trail  \n\n</think>\n\nAnswer\n",)),
    "reasoning_cut_by_max_tokens": Spec(("Still thinking about it \n ",), eos=False),
    "skip_special_tokens_false": Spec(
        ("R.</think>Hi ", SB, call("get_time", UTC, 0), SE), request={"skip_special_tokens": False}
    ),
    "tool_parser_only": Spec(("<think>R.</think>Hi ", SB, call("get_time", UTC, 0), SE), reasoning_parser=None),
    "reasoning_ended_by_eos": Spec(("Unfinished thought",)),
    "thinking_kwarg_off_open_turn": Spec(("Plain answer.",), prompt="open_turn", template_kwargs={"thinking": False}),
    "thinking_kwarg_overrides_enable_thinking": Spec(
        ("<think>Yes.</think>On.",), prompt="open_turn", template_kwargs={"thinking": True, "enable_thinking": False}
    ),
}


TRAILING = "\nI will report back shortly."
LEFT_OPEN_ARGS = f'{{"city": "A"}}{CB}functions.get_time:1{AB}{{"tz": "B"}}'
BAD_HEADER = f'{CB}functions.get_time{AB}{{"tz": "UTC"}}{CE}'

DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    # vLLM retypes values by the schema only when it builds the full answer; onehop streams that answer.
    "schema_typed_values": (
        Deviation(
            "vllm_streams_untyped_values",
            "stream",
            "calls",
            ([("get_weather", '{"city": 75001, "days": "3", "metric": "true", "note": "4"}')],),
            [("get_weather", '{"city": "75001", "days": 3, "metric": true, "note": "4"}')],
        ),
    ),
    # vLLM's full answer says `tool_calls` for any call, even one cut by max_tokens; its
    # stream and onehop keep `length`.
    "max_tokens_mid_call": (
        Deviation("vllm_full_tool_calls_after_length", "full", "finish_reason", ("tool_calls",), "length"),
        # onehop closes a cut call's arguments to valid JSON, streamed and not (issue #27).
        *both(parity.CLOSES_CUT_CALL, "calls", [("get_weather", '{"city": "Par')], [("get_weather", '{"city": "Par"}')]),
    ),
    "stop_string_inside_call": (
        # The stop string's hold-back lags vLLM's text behind the ids: the part of the section
        # marker it held streams as content, or lands in the tool name, by chunking. onehop
        # never splits a marker from its id.
        Deviation("vllm_streams_held_marker_text", "stream", "content", (None, "<|tool_calls_section_begi"), None),
        Deviation(
            "vllm_streams_held_marker_text",
            "stream",
            "calls",
            ([("get_weather", '{"city": "')], [("n|>functions.get_weather", '{"city": "')]),
            [("get_weather", '{"city": ""}')],
        ),
        Deviation(parity.CLOSES_CUT_CALL, "full", "calls", ([("get_weather", '{"city": "')],), [("get_weather", '{"city": ""}')]),
        # onehop (chat.py): `stop`, not `tool_calls`, when a stop string cut the call short.
        *both("onehop_stop_string_cut_call_finishes_stop", "finish_reason", "tool_calls", "stop"),
    ),
    # vLLM drops all text after the section opens; onehop keeps it (nothing lost).
    "text_after_last_call": both("vllm_drops_text_after_calls", "content", None, TRAILING),
    "text_between_calls": both("vllm_drops_text_between_calls", "content", None, " and then"),
    # A call opened inside another's arguments: vLLM folds it into the first call's
    # arguments (invalid JSON); onehop closes the first call and opens the second.
    "call_left_open": both(
        "vllm_folds_a_new_call_into_open_arguments",
        "calls",
        [("get_weather", LEFT_OPEN_ARGS)],
        [("get_weather", '{"city": "A"}'), ("get_time", '{"tz": "B"}')],
    ),
    # vLLM streams no arguments at all ("", not JSON) for a call without them; its full answer has `{}`.
    "calls_without_arguments": (
        Deviation(
            "vllm_streams_empty_arguments",
            "stream",
            "calls",
            ([("get_time", ""), ("get_time", "")],),
            [("get_time", "{}"), ("get_time", "{}")],
        ),
    ),
    # A header without `:IDX` is no call to vLLM, and it drops the text; onehop gives it back as content.
    "header_without_index": both("vllm_drops_call_without_index", "content", None, BAD_HEADER),
    # Marker text written as ordinary tokens: vLLM's stream (by token id) keeps it as text, its full
    # answer (text only) parses a call. onehop follows the ids, as its token route always does.
    "markers_split_across_tokens": (
        Deviation("vllm_full_parses_marker_text", "full", "content", (None,), SB + call("get_time", UTC, 0) + SE),
        Deviation("vllm_full_parses_marker_text", "full", "calls", ([("get_time", '{"tz": "UTC"}')],), []),
        Deviation("vllm_full_parses_marker_text", "full", "finish_reason", ("tool_calls",), "stop"),
    ),
    # vLLM's stream scans the whole prompt, so an earlier turn's `</think>` makes it all content;
    # its full answer, and onehop, look at the generation turn only.
    "earlier_turn_ends_with_think": (
        Deviation("vllm_stream_reads_earlier_turns", "stream", "reasoning", (None,), "New."),
        Deviation("vllm_stream_reads_earlier_turns", "stream", "content", ("<think>New.Warm.",), "Warm."),
    ),
    # Without tools vLLM still strips the section, and the text after it; onehop does no tool
    # parsing then and keeps the model's text, its markers skipped as special tokens (issue #27).
    "tools_not_offered": both(
        "vllm_drops_tool_section_without_tools", "content", "Text ", 'Text functions.get_time:0{"tz": "UTC"} tail'
    ),
    # vLLM keeps the whitespace before the call section; onehop drops it (issue #27).
    "reasoning_content_call": both(parity.DROPS_SPACE_BEFORE_CALL, "content", "Let me check.\n", "Let me check."),
    "thinking_kwarg_off": both(parity.DROPS_SPACE_BEFORE_CALL, "content", "Sure. ", "Sure."),
    "skip_special_tokens_false": both(parity.DROPS_SPACE_BEFORE_CALL, "content", "Hi ", "Hi"),
    # Usage, not parsing: vLLM's full answer counts 0 reasoning tokens with no reasoning parser, onehop none.
    "tool_parser_only": (
        Deviation("vllm_counts_reasoning_without_parser", "full", "reasoning_tokens", (0,), None),
        *both(parity.DROPS_SPACE_BEFORE_CALL, "content", "<think>R.</think>Hi ", "<think>R.</think>Hi"),
    ),
}
# Calls whose arguments are not JSON on either side: compared as text.
RAW_ARGUMENTS = frozenset({"max_tokens_mid_call", "stop_string_inside_call", "invalid_json"})
# vLLM's streamed reasoning_tokens misses the tokens that arrive in the chunk carrying the
# EOS when reasoning never closed; onehop counts ids, vLLM's non-streamed count.
# (case, chunking index) -> vLLM's streamed count.
STREAM_REASONING_TOKENS: StreamTokens = {
    ("reasoning_ended_by_eos", 1): 2,
    **{("reasoning_ended_by_eos", k): 0 for k in range(2, 6)},
}


def prompt_ids(tokenizer: Any, spec: Spec) -> list[int]:
    tools = TOOLS if spec.tools else None
    generation = spec.prompt == "pre_open"
    text = tokenizer.apply_chat_template(
        spec.messages, tools=tools, add_generation_prompt=generation, tokenize=False, **spec.template_kwargs
    )
    if not generation:
        text += OPEN_TURN
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_case(tokenizer: Any, folder: Path, spec: Spec, seed: int) -> dict[str, Any]:
    output = encode(tokenizer, spec.output) + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] if spec.eos else [])
    return parity.oracle_case(
        folder,
        prompt_ids(tokenizer, spec),
        output,
        seed,
        tool_parser="kimi_k2",
        reasoning_parser=spec.reasoning_parser,
        tools=TOOLS if spec.tools else [],
        messages=spec.messages,
        stop=spec.stop,
        chat_template_kwargs=spec.template_kwargs,
        model_type="kimi_k2",
        request=spec.request,
    )


def build(fixture: Fixture) -> Built:
    from transformers import AutoTokenizer

    folder = kimi_tokenizer_dir(fixture("qwen3_tokenizer_dir"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = vocab_for(tokenizer)
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="kimi_k2",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    raw_arguments=RAW_ARGUMENTS,
    reasoning_tokens=Counted(STREAM_REASONING_TOKENS),
)
