"""onehop's mistral reasoning + tool parsing against vLLM 0.32's `mistral`, through the parity oracle.

Each case is Mistral v11+ output (`[THINK]...[/THINK]`, `[TOOL_CALLS]NAME[ARGS]{json}`)
encoded with the Mistral test tokenizer (Qwen3's BPE plus Mistral's control tokens as
specials; what differs from Mistral's own is in `tests.support.mistral`), after a prompt
rendered with its test template, run through vLLM's coupled chat serving in-process
(`scripts/vllm_parse_oracle.py`, one oracle process for the test session) and through onehop's
derender, for six chunkings and the non-streamed path. vLLM reads an HF tokenizer's
format from its vocabulary: `[ARGS]` makes it v11+, `[THINK]` special-token reasoning.

Where vLLM's streamed and non-streamed answers disagree, or vLLM loses text or
writes invalid JSON, onehop gives one answer (vLLM's non-streamed one unless it
is plainly wrong). Each such difference is a named `Deviation` carrying both
sides' exact values: the test fails if either side changes. Call ids are random
on both sides: both must be Mistral's 9 alphanumerics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derender.parsers.mistral import ARGS as A, THINK_END as ET, THINK_START as T, TOOL_CALLS as TC
from derender.vocab import vocab_for
from tests.support import parity
from tests.support.mistral import EOS, mistral_tokenizer_dir, mistral_v3_tokenizer_dir
from tests.support.parity import Deviation, Split, both, encode
from tests.support.tools import WEATHER_TOOLS
from tests.vllm.parity_cases.family import Built, Counted, Family, Fixture, build_all

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
PARIS: dict[str, Any] = {"city": "Paris", "days": 2}
UTC: dict[str, Any] = {"tz": "UTC"}
NON_ASCII = {"city": "Zürich", "note": 'Grüße aus 世界 🫠\nzweite Zeile\n\tein Tab, "Zitat"'}


def call(name: str, arguments: dict[str, Any] | None, *, raw: str | None = None, indent: int | None = None) -> str:
    body = raw if raw is not None else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"{TC}{name}{A}{body}"


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output and the request around it."""

    output: tuple[str | Split, ...]
    eos: bool = True
    stop: tuple[str, ...] = ()
    tools: bool = True
    reasoning_parser: str | None = "mistral"
    tool_parser: str | None = "mistral"
    request: dict[str, Any] = field(default_factory=dict)
    legacy: bool = False
    """Encoded with the pre-v11 tokenizer (no `[ARGS]`): the `[TOOL_CALLS][{...}]` format."""


TIME = call("get_time", UTC)


def legacy(*calls: tuple[str, Any]) -> str:
    return json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls], ensure_ascii=False)


def old(*output: str | Split, eos: bool = True) -> Spec:
    return Spec(tuple(output), eos=eos, reasoning_parser=None, legacy=True)


LEGACY_TIME = legacy(("get_time", UTC))
SPECS: dict[str, Spec] = {
    "reasoning_content_call": Spec((T, "Plan it.\n", ET, "Let me check.\n", call("get_weather", PARIS))),
    "parallel_calls": Spec(
        (T, "Two cities.", ET, "\n\n", call("get_weather", PARIS), call("get_weather", {"city": "Rome"}))
    ),
    "call_ends_reasoning": Spec((T, "Straight to the call  \n", TIME)),
    "reasoning_opens_mid_content": Spec(("Hello ", T, "aside", ET, " world",)),
    "reasoning_twice": Spec((T, "a", T, "b", ET, "c", ET, "d")),
    "non_ascii_multiline_arguments": Spec((T, "Umlaute 世界.", ET, call("get_weather", NON_ASCII, indent=2))),
    "schema_typed_values": Spec((call("get_weather", None, raw='{"city": 75001, "days": "3", "metric": "true"}'),)),
    "max_tokens_mid_call": Spec((TC, "get_weather", A, '{"city": "Par'), eos=False),
    "max_tokens_mid_name": Spec((TC, "get_wea"), eos=False),
    "stop_string_inside_call": Spec((call("get_weather", {"city": "Lyon", "days": 3}),), stop=("Lyon",)),
    "text_after_last_call": Spec((TIME, "\nI will report back shortly. ")),
    "second_json_value": Spec((call("get_time", None, raw='{"tz": "A"}{"tz": "B"}'),)),
    "args_marker_inside_arguments": Spec((TIME, A, "x")),
    "call_without_args_marker": Spec((TC, 'get_time{"tz": "UTC"}')),
    "call_without_arguments": Spec((TC, "get_time", A)),
    "name_cut_by_eos": Spec((TC, "get_time")),
    "unclosed_json_then_call": Spec((TC, "get_time", A, '{"tz": "A"', TIME)),
    "name_with_layout": Spec((TC, " get_time \n", A, ' {"tz": "UTC"} ')),
    "repeated_tool_calls_marker": Spec((TC, TIME)),
    "invalid_json": Spec((call("get_time", None, raw="{tz: UTC"),)),
    "unknown_function": Spec((call("launch", {"speed": "3"}),)),
    "markers_split_across_tokens": Spec((Split(TIME),)),
    "stray_markers_in_content": Spec(("a", ET, "b", A, "c[INST]d")),
    "leading_whitespace_before_call": Spec(("\n\n", TIME)),
    "leading_whitespace_with_text": Spec(("\n\nHello  ", TIME)),
    "reasoning_whitespace": Spec((T, "\n  Lead and trail  \n\n", ET, "\n\nAnswer\n")),
    "reasoning_cut_by_max_tokens": Spec((T, "Still thinking about it \n "), eos=False),
    "think_after_calls": Spec((TIME, T, "late", ET, "z")),
    "parallel_tool_calls_false": Spec(
        (call("get_weather", PARIS), TIME), request={"parallel_tool_calls": False}
    ),
    "tools_not_offered": Spec((T, "R.", ET, "Text ", TIME, " tail"), tools=False),
    "tool_choice_none": Spec((T, "R.", ET, "Text ", TIME, " tail"), request={"tool_choice": "none"}),
    "tool_parser_only": Spec((T, "R.", ET, "Hi ", TIME), reasoning_parser=None),
    "reasoning_parser_only": Spec((T, "R.", ET, "Hi ", TIME), tool_parser=None),
    "skip_special_tokens_false": Spec((T, "R.", ET, "Hi ", TIME), request={"skip_special_tokens": False}),
    "legacy_one_call": old("Hi ", TC, " " + LEGACY_TIME),
    "legacy_parallel_calls": old(
        TC, legacy(("get_weather", {"city": "Zürich\n世界", "days": "2"}), ("get_time", UTC))
    ),
    "legacy_bare_object": old(TC, json.dumps({"name": "get_time", "arguments": UTC})),
    "legacy_text_after_list": old(TC, LEGACY_TIME, " then"),
    "legacy_no_arguments": old(TC, '[{"name": "get_time"}]'),
    "legacy_whitespace_before_calls": old("\n\n", TC, LEGACY_TIME),
    "legacy_repeated_marker": old(TC, TC, LEGACY_TIME),
    "legacy_cut_mid_arguments": old(TC, '[{"name": "get_time", "arguments": {"tz": "U', eos=False),
    "legacy_name_not_a_string": old(TC, '[{"name": get_time}]'),
}

TRAILING = "\nI will report back shortly."
BAD_SPLIT = Split(TIME).text

DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    # vLLM retypes values by the schema only when it builds the full answer; onehop streams that answer.
    "schema_typed_values": (
        Deviation(
            "vllm_streams_untyped_values",
            "stream",
            "calls",
            ([("get_weather", '{"city": 75001, "days": "3", "metric": "true"}')],),
            [("get_weather", '{"city": "75001", "days": 3, "metric": true}')],
        ),
    ),
    # vLLM's full answer strips content around calls, its stream does not; onehop holds the
    # trailing whitespace of content and drops it when a call follows.
    "reasoning_content_call": (
        Deviation("vllm_streams_whitespace_before_call", "stream", "content", ("Let me check.\n",), "Let me check."),
    ),
    "tool_parser_only": (
        Deviation(
            "vllm_streams_whitespace_before_call", "stream", "content", ("[THINK]R.[/THINK]Hi ",), "[THINK]R.[/THINK]Hi"
        ),
    ),
    "skip_special_tokens_false": (
        Deviation("vllm_streams_whitespace_before_call", "stream", "content", ("Hi ",), "Hi"),
    ),
    # Leading whitespace streams before onehop knows a call follows; vLLM's full answer strips it.
    "leading_whitespace_with_text": (
        Deviation(
            "vllm_streams_whitespace_before_call", "stream", "content", ("\n\nHello  ", "\n\nHello"), "\n\nHello"
        ),
        Deviation("vllm_full_strips_leading_whitespace", "full", "content", ("Hello",), "\n\nHello"),
    ),
    # vLLM's full answer says `tool_calls` for any call, even one cut by max_tokens; its
    # stream and onehop keep `length`.
    "max_tokens_mid_call": (
        Deviation("vllm_full_tool_calls_after_length", "full", "finish_reason", ("tool_calls",), "length"),
        # onehop closes a cut call's arguments to valid JSON, streamed and not (issue #27).
        *both(parity.CLOSES_CUT_CALL, "calls", [("get_weather", '{"city": "Par')], [("get_weather", '{"city": "Par"}')]),
    ),
    # A call left open before the next one is closed before the next header (issue #27).
    "unclosed_json_then_call": both(
        parity.CLOSES_CUT_CALL,
        "calls",
        [("get_time", '{"tz": "A"'), ("get_time", '{"tz": "UTC"}')],
        [("get_time", '{"tz": "A"}'), ("get_time", '{"tz": "UTC"}')],
    ),
    # vLLM keeps the whitespace before the call; onehop drops it (issue #27).
    "legacy_one_call": both(parity.DROPS_SPACE_BEFORE_CALL, "content", "Hi ", "Hi"),
    "max_tokens_mid_name": (
        Deviation("vllm_full_tool_calls_after_length", "full", "finish_reason", ("tool_calls",), "length"),
        Deviation("vllm_streams_empty_arguments", "stream", "calls", ([("get_wea", "")],), [("get_wea", "{}")]),
    ),
    # vLLM streams no arguments ("", not JSON) for a call without them; its full answer has `{}`.
    "call_without_arguments": (
        Deviation("vllm_streams_empty_arguments", "stream", "calls", ([("get_time", "")],), [("get_time", "{}")]),
    ),
    "name_cut_by_eos": (
        Deviation("vllm_streams_empty_arguments", "stream", "calls", ([("get_time", "")],), [("get_time", "{}")]),
    ),
    "stop_string_inside_call": (
        # The stop string's hold-back lags vLLM's text behind the ids: by chunking the call
        # streams as content. onehop never splits a marker from its id.
        Deviation(
            "vllm_streams_held_marker_text",
            "stream",
            "content",
            (None, '[TOOL_CALLS]get_weather[ARGS]{"city": "'),
            None,
        ),
        Deviation(
            "vllm_streams_held_marker_text",
            "stream",
            "calls",
            ([("get_weather", '{"city": "')], [("get_weather[ARGS", ']{"city": "')], []),
            [("get_weather", '{"city": ""}')],
        ),
        Deviation(parity.CLOSES_CUT_CALL, "full", "calls", ([("get_weather", '{"city": "')],), [("get_weather", '{"city": ""}')]),
        Deviation("vllm_streams_held_marker_text", "stream", "finish_reason", ("tool_calls", "stop"), "stop"),
        # onehop (chat.py): `stop`, not `tool_calls`, when a stop string cut the call short.
        Deviation("onehop_stop_string_cut_call_finishes_stop", "full", "finish_reason", ("tool_calls",), "stop"),
    ),
    # The format has no call terminator: vLLM's full answer drops text after the JSON value,
    # its stream appends it to the arguments (invalid JSON). onehop: the text is content.
    "text_after_last_call": (
        Deviation(
            "vllm_streams_text_after_call_as_arguments",
            "stream",
            "calls",
            ([("get_time", '{"tz": "UTC"}' + TRAILING + " ")],),
            [("get_time", '{"tz": "UTC"}')],
        ),
        *both("vllm_drops_text_after_call", "content", None, TRAILING),
    ),
    "second_json_value": (
        Deviation(
            "vllm_streams_text_after_call_as_arguments",
            "stream",
            "calls",
            ([("get_time", '{"tz": "A"}{"tz": "B"}')],),
            [("get_time", '{"tz": "A"}')],
        ),
        *both("vllm_drops_text_after_call", "content", None, '{"tz": "B"}'),
    ),
    "args_marker_inside_arguments": (
        Deviation(
            "vllm_streams_text_after_call_as_arguments",
            "stream",
            "calls",
            ([("get_time", '{"tz": "UTC"}[ARGS]x')],),
            [("get_time", '{"tz": "UTC"}')],
        ),
        *both("vllm_drops_text_after_call", "content", None, "[ARGS]x"),
    ),
    "think_after_calls": (
        Deviation(
            "vllm_streams_text_after_call_as_arguments",
            "stream",
            "calls",
            ([("get_time", '{"tz": "UTC"}[THINK]late[/THINK]z')],),
            [("get_time", '{"tz": "UTC"}')],
        ),
        Deviation("vllm_streams_text_after_call_as_arguments", "stream", "reasoning", (None,), "late"),
        *both("vllm_drops_text_after_call", "content", None, "z"),
        # vLLM counts no reasoning tokens once a call has opened, though its answer has the reasoning.
        Deviation("vllm_counts_no_reasoning_after_calls", "full", "reasoning_tokens", (0,), 1),
    ),
    # vLLM's stream keeps the name's layout (`" get_time \\n"`); its full answer and onehop strip it.
    "name_with_layout": (
        Deviation(
            "vllm_streams_unstripped_name",
            "stream",
            "calls",
            ([(" get_time \n", ' {"tz": "UTC"} ')],),
            [("get_time", ' {"tz": "UTC"}')],
        ),
    ),
    # A second `[TOOL_CALLS]` before any name: vLLM makes its text part of the name.
    "repeated_tool_calls_marker": both(
        "vllm_names_call_with_marker",
        "calls",
        [("[TOOL_CALLS]get_time", '{"tz": "UTC"}')],
        [("get_time", '{"tz": "UTC"}')],
    ),
    # Marker text written as ordinary tokens: vLLM's stream (by token id) keeps it as text, its full
    # answer (text only) parses a call. onehop follows the ids, as its token route always does.
    "markers_split_across_tokens": (
        Deviation("vllm_full_parses_marker_text", "full", "content", (None,), BAD_SPLIT),
        Deviation("vllm_full_parses_marker_text", "full", "calls", ([("get_time", '{"tz": "UTC"}')],), []),
        Deviation("vllm_full_parses_marker_text", "full", "finish_reason", ("tool_calls",), "stop"),
    ),
    # Without tools (or with tool_choice none) vLLM still parses the call and drops it and the
    # text after it; onehop does no tool parsing then and keeps the model's text, markers included.
    "tools_not_offered": (
        Deviation("vllm_drops_calls_without_tools", "stream", "content", ("Text ",), f"Text {TIME} tail"),
        Deviation("vllm_drops_calls_without_tools", "full", "content", ("Text",), f"Text {TIME} tail"),
    ),
    "tool_choice_none": both("vllm_drops_calls_without_tools", "content", "Text ", f"Text {TIME} tail"),
    # Pre-v11: vLLM's full answer drops text after the list, its stream keeps it (as onehop).
    "legacy_text_after_list": (Deviation("vllm_drops_text_after_calls", "full", "content", (None,), " then"),),
    "legacy_no_arguments": (
        Deviation("vllm_streams_empty_arguments", "stream", "calls", ([("get_time", "")],), [("get_time", "{}")]),
    ),
    "legacy_whitespace_before_calls": (
        Deviation("vllm_streams_whitespace_before_call", "stream", "content", ("\n\n",), None),
    ),
    # A list cut mid-call: vLLM's stream has the call, its full answer gives the text back
    # as content (the JSON does not parse). onehop: the call, as streamed.
    "legacy_cut_mid_arguments": (
        Deviation(
            "vllm_full_cut_call_is_content", "full", "content", ('[{"name": "get_time", "arguments": {"tz": "U',), None
        ),
        Deviation("vllm_full_cut_call_is_content", "full", "calls", ([],), [("get_time", '{"tz": "U"}')]),
        Deviation(parity.CLOSES_CUT_CALL, "stream", "calls", ([("get_time", '{"tz": "U')],), [("get_time", '{"tz": "U"}')]),
    ),
    # An object whose name is not a string: vLLM's stream loses the text, its full answer and
    # onehop give it back as content.
    "legacy_name_not_a_string": (
        Deviation("vllm_streams_nothing_for_a_bad_list", "stream", "content", (None,), '[{"name": get_time}]'),
    ),
}
# onehop's reasoning_tokens where vLLM's full count is a deviation (above).
REASONING_TOKENS = {"think_after_calls": 1}
# Calls whose arguments are not JSON on either side: compared as text.
RAW_ARGUMENTS = frozenset(
    {
        "max_tokens_mid_call",
        "stop_string_inside_call",
        "invalid_json",
        "unclosed_json_then_call",
        "legacy_cut_mid_arguments",
    }
)
# Usage, not parsing: vLLM's full answer counts 0 reasoning tokens with no reasoning parser, onehop none.
NO_REASONING_PARSER = Deviation("vllm_counts_reasoning_without_parser", "full", "reasoning_tokens", (0,), None)


def deviations_of(name: str) -> tuple[Deviation, ...]:
    extra = (NO_REASONING_PARSER,) if SPECS[name].reasoning_parser is None else ()
    return DEVIATIONS.get(name, ()) + extra


def build_case(tokenizer: Any, folder: Path, spec: Spec, seed: int) -> dict[str, Any]:
    tools = TOOLS if spec.tools else None
    prompt = tokenizer.apply_chat_template(USER, tools=tools, add_generation_prompt=True, tokenize=False)
    output = encode(tokenizer, spec.output) + ([tokenizer.convert_tokens_to_ids(EOS)] if spec.eos else [])
    return parity.oracle_case(
        folder,
        tokenizer.encode(prompt, add_special_tokens=False),
        output,
        seed,
        tool_parser=spec.tool_parser,
        reasoning_parser=spec.reasoning_parser,
        tools=tools or [],
        messages=USER,
        stop=spec.stop,
        chat_template_kwargs={},
        request=spec.request,
    )


def build(fixture: Fixture) -> Built:
    from transformers import AutoTokenizer

    qwen3_dir = fixture("qwen3_tokenizer_dir")
    folders = {False: mistral_tokenizer_dir(qwen3_dir), True: mistral_v3_tokenizer_dir(qwen3_dir)}
    tokenizers = {legacy: AutoTokenizer.from_pretrained(folder) for legacy, folder in folders.items()}
    vocabs = {legacy: vocab_for(tokenizer) for legacy, tokenizer in tokenizers.items()}

    def case(spec: Spec, seed: int) -> dict[str, Any]:
        return build_case(tokenizers[spec.legacy], folders[spec.legacy], spec, seed)

    return build_all(SPECS, case, lambda spec: vocabs[spec.legacy], tokenizers[False])


def mistral_id(call_id: str) -> bool:
    """Mistral's call ids are 9 alphanumerics (mistral-common rejects others)."""
    return len(call_id) == 9 and call_id.isalnum()


FAMILY = Family(
    name="mistral",
    build=build,
    cases=tuple(SPECS),
    deviations={name: deviations_of(name) for name in SPECS},
    raw_arguments=RAW_ARGUMENTS,
    # onehop counts ids: vLLM's non-streamed count (REASONING_TOKENS where that is a deviation).
    reasoning_tokens=Counted(check_vllm=False),
    call_id=mistral_id,
)
