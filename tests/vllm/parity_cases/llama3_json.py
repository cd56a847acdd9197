"""onehop's llama3_json tool parsing against vLLM 0.32's `llama3_json`, through the parity oracle.

Each case is Llama 3.x output encoded with the Llama 3 test tokenizer (Qwen3's
BPE plus Llama's special tokens; what differs from Llama's own is in
`tests.support.llama3`) after a prompt rendered with its test template, run
through vLLM's coupled chat serving in-process (`scripts/vllm_parse_oracle.py`,
one oracle process for the test session) and through onehop's derender, for six
chunkings and the non-streamed path.

Where vLLM's streamed and non-streamed answers disagree, or vLLM loses text or
writes invalid JSON, onehop gives one answer (vLLM's non-streamed one unless it
is plainly wrong). Each such difference is a named `Deviation` carrying both
sides' exact values: the test fails if either side changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derender.parsers.llama3_json import PYTHON_TAG as TAG
from derender.vocab import vocab_for
from tests.support import parity
from tests.support.llama3 import EOT, llama3_tokenizer_dir
from tests.support.parity import LOSSY, Deviation, Split, both, encode
from tests.support.tools import WEATHER_TOOLS
from tests.vllm.parity_cases.family import Built, Family, Fixture, build_all

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS: dict[str, Any] = {"city": "Paris", "days": 2}
UTC: dict[str, Any] = {"tz": "UTC"}
NON_ASCII = {"city": "Zürich", "note": 'Grüße aus 世界 🫠\nzweite Zeile\n\tein Tab, "Zitat"'}


def call(name: str, arguments: Any, *, key: str = "parameters", indent: int | None = None) -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False, indent=indent)


W = call("get_weather", PARIS)
T = call("get_time", UTC)


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output and the request around it."""

    output: tuple[str | Split, ...]
    eos: bool = True
    stop: tuple[str, ...] = ()
    tools: bool = True
    request: dict[str, Any] = field(default_factory=dict)


SPECS: dict[str, Spec] = {
    "plain_text": Spec(("Paris is sunny today.",)),
    "one_call": Spec((W,)),
    "python_tag_then_call": Spec((TAG, W)),
    "arguments_key": Spec((call("get_time", UTC, key="arguments"),)),
    "name_after_arguments": Spec(('{"parameters": {"tz": "UTC"}, "name": "get_time"}',)),
    "parallel_calls": Spec((W + "; " + T,)),
    "parallel_calls_each_tagged": Spec((TAG, W + "; ", TAG, T)),
    "parallel_calls_tagged_kept": Spec((TAG, W + "; ", TAG, T), request={"skip_special_tokens": False}),
    "parallel_calls_newline": Spec((W + "\n" + T,)),
    "whitespace_before_call": Spec(("\n " + W,)),
    "non_ascii_multiline_arguments": Spec((call("get_weather", NON_ASCII, indent=2),)),
    "values_not_retyped": Spec(('{"name": "get_weather", "parameters": {"city": 75001, "days": "3"}}',)),
    "parameter_not_in_schema": Spec((call("get_weather", {"city": "Oslo", "zoom": 2}),)),
    "unknown_function": Spec((call("launch", {"speed": 3}),)),
    "empty_arguments": Spec((call("get_time", {}),)),
    "text_before_call": Spec(("Let me check. " + W,)),
    "tag_then_text": Spec((TAG, 'print("hi")')),
    "tag_then_text_kept": Spec((TAG, 'print("hi")'), request={"skip_special_tokens": False}),
    "text_after_last_call": Spec((W + " I will check.",)),
    "text_between_calls": Spec((W + " then " + T,)),
    "json_without_name": Spec(('{"answer": 42}',)),
    "call_without_arguments": Spec(('{"name": "get_time"}',)),
    "second_object_not_a_call": Spec((W + '; {"answer": 1}',)),
    "invalid_json_arguments": Spec(('{"name": "get_time", "parameters": {tz: UTC}}',)),
    "max_tokens_mid_call": Spec(('{"name": "get_weather", "parameters": {"city": "Par',), eos=False),
    "stop_string_inside_call": Spec((call("get_weather", {"city": "Lyon", "days": 3}),), stop=("Lyon",)),
    "tag_split_across_tokens": Spec((Split(TAG + W),)),
    "tools_not_offered": Spec((W,), tools=False),
    "parallel_tool_calls_false": Spec((W + "; " + T,), request={"parallel_tool_calls": False}),
}

WEATHER = ("get_weather", json.dumps(PARIS))
TIME = ("get_time", json.dumps(UTC))
CUT = '{"name": "get_weather", "parameters": {"city": "'
BAD_TAIL = '; {"answer": 1}'

DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    # vLLM's stream steps from one call to the next by exactly two characters (`; `) and sees
    # no second call after another separator, or after `; <|python_tag|>` with the tag's text
    # kept; its full answer, and onehop, find every call.
    "parallel_calls_tagged_kept": (
        Deviation(
            "vllm_stream_drops_calls_after_other_separators",
            "stream",
            "calls",
            ([WEATHER], [("get_weather", "")], [("get_weather", '{"city": "Paris"')]),
            [WEATHER, TIME],
        ),
    ),
    "parallel_calls_newline": (
        Deviation("vllm_stream_drops_calls_after_other_separators", "stream", "calls", ([WEATHER],), [WEATHER, TIME]),
    ),
    # vLLM's stream needs `{` (or the tag's text) as the very first character; its full answer,
    # and onehop, allow whitespace before the call.
    "whitespace_before_call": (
        Deviation("vllm_stream_needs_call_at_first_character", "stream", "content", ("\n " + W,), None),
        Deviation("vllm_stream_needs_call_at_first_character", "stream", "calls", ([],), [WEATHER]),
        Deviation("vllm_stream_needs_call_at_first_character", "stream", "finish_reason", ("stop",), "tool_calls"),
    ),
    # `{}` arguments: vLLM's stream sends none on some chunkings ("", not JSON).
    "empty_arguments": (Deviation("vllm_streams_no_arguments", "stream", "calls", LOSSY, [("get_time", "{}")]),),
    # Text before the first object: vLLM's full answer takes the call from the middle and drops
    # the text; its stream, and onehop, keep the whole output as content.
    "text_before_call": (
        Deviation("vllm_full_drops_text_before_call", "full", "content", (None,), "Let me check. " + W),
        Deviation("vllm_full_drops_text_before_call", "full", "calls", ([WEATHER],), []),
        Deviation("vllm_full_drops_text_before_call", "full", "finish_reason", ("tool_calls",), "stop"),
    ),
    # The tag's text kept (`skip_special_tokens=false`) and no JSON after it: vLLM's stream loses it all.
    "tag_then_text_kept": (
        Deviation("vllm_stream_drops_text_after_tag", "stream", "content", (None,), TAG + 'print("hi")'),
    ),
    # vLLM drops text after and between calls, and its stream loses the second call and, on
    # some chunkings, the first call's arguments; onehop keeps the text as content.
    "text_after_last_call": (
        *both("vllm_drops_text_after_calls", "content", None, " I will check."),
        Deviation("vllm_streams_no_arguments", "stream", "calls", LOSSY, [WEATHER]),
    ),
    "text_between_calls": (
        *both("vllm_drops_text_between_calls", "content", None, " then"),
        Deviation(
            "vllm_stream_drops_calls_after_text",
            "stream",
            "calls",
            (
                [WEATHER],
                [("get_weather", "")],
                [("get_weather", '{"city": "')],
                [("get_weather", '{"city": "Paris"')],
            ),
            [WEATHER, TIME],
        ),
    ),
    # An object that is no call (no name, or no arguments): vLLM's full answer, and onehop, make
    # it content; vLLM's stream loses the text, and sends a call without arguments on some chunkings.
    "json_without_name": (
        Deviation("vllm_stream_drops_json_that_is_no_call", "stream", "content", (None,), '{"answer": 42}'),
    ),
    "call_without_arguments": (
        Deviation("vllm_stream_drops_json_that_is_no_call", "stream", "content", (None,), '{"name": "get_time"}'),
        Deviation(
            "vllm_stream_calls_without_arguments", "stream", "calls", ([("get_time", "")], [("get_time", "{}")], []), []
        ),
        Deviation("vllm_stream_calls_without_arguments", "stream", "finish_reason", ("tool_calls", "stop"), "stop"),
    ),
    # A later object that is no call: vLLM's full answer turns the whole output into content,
    # calls included, which a stream cannot take back; onehop keeps the call and makes the rest content.
    "second_object_not_a_call": (
        Deviation("vllm_full_drops_calls_for_a_bad_object", "full", "content", (W + BAD_TAIL,), BAD_TAIL),
        Deviation("vllm_full_drops_calls_for_a_bad_object", "full", "calls", ([],), [WEATHER]),
        Deviation("vllm_full_drops_calls_for_a_bad_object", "full", "finish_reason", ("stop",), "tool_calls"),
        Deviation("vllm_stream_drops_json_that_is_no_call", "stream", "content", (None,), BAD_TAIL),
    ),
    # Invalid or cut arguments once the header is out: vLLM's full answer makes the output content;
    # its stream sends no arguments, or closes cut JSON itself. onehop keeps a best-effort call
    # with the model's text.
    "invalid_json_arguments": (
        Deviation(
            "vllm_full_content_for_bad_arguments",
            "full",
            "content",
            ('{"name": "get_time", "parameters": {tz: UTC}}',),
            None,
        ),
        Deviation("vllm_full_content_for_bad_arguments", "full", "calls", ([],), [("get_time", "{tz: UTC}")]),
        Deviation("vllm_full_content_for_bad_arguments", "full", "finish_reason", ("stop",), "tool_calls"),
        Deviation(
            "vllm_streams_no_arguments", "stream", "calls", ([("get_time", "")], []), [("get_time", "{tz: UTC}")]
        ),
        Deviation("vllm_streams_no_arguments", "stream", "finish_reason", ("tool_calls", "stop"), "tool_calls"),
    ),
    # onehop closes a cut call's arguments to valid JSON, streamed and not (issue #27).
    "max_tokens_mid_call": (
        Deviation("vllm_full_content_for_bad_arguments", "full", "content", (CUT + "Par",), None),
        Deviation("vllm_full_content_for_bad_arguments", "full", "calls", ([],), [("get_weather", '{"city": "Par"}')]),
        Deviation(
            "vllm_streams_closed_or_no_arguments",
            "stream",
            "calls",
            ([("get_weather", '{"city": "Par"}')], [("get_weather", "")]),
            [("get_weather", '{"city": "Par"}')],
        ),
    ),
    "stop_string_inside_call": (
        Deviation("vllm_full_content_for_bad_arguments", "full", "content", (CUT,), None),
        Deviation("vllm_full_content_for_bad_arguments", "full", "calls", ([],), [("get_weather", '{"city": ""}')]),
        Deviation(
            "vllm_streams_no_arguments", "stream", "calls", ([("get_weather", "")],), [("get_weather", '{"city": ""}')]
        ),
        # onehop (chat.py): `stop`, not `tool_calls`, when a stop string cut the call short.
        Deviation("onehop_stop_string_cut_call_finishes_stop", "stream", "finish_reason", ("tool_calls",), "stop"),
    ),
    # The tag written as ordinary tokens: vLLM reads its text (and its stream leaks part of it as
    # content); onehop follows the ids, as its token route always does, so the output is content.
    "tag_split_across_tokens": (
        Deviation("onehop_reads_the_tag_by_id", "full", "content", (None,), TAG + W),
        Deviation("onehop_reads_the_tag_by_id", "full", "calls", ([WEATHER],), []),
        Deviation("onehop_reads_the_tag_by_id", "full", "finish_reason", ("tool_calls",), "stop"),
        Deviation(
            "onehop_reads_the_tag_by_id", "stream", "content", ("<|python_tag|", "<|python_tag", "<|python"), TAG + W
        ),
        Deviation("onehop_reads_the_tag_by_id", "stream", "calls", ([WEATHER],), []),
        Deviation("onehop_reads_the_tag_by_id", "stream", "finish_reason", ("tool_calls",), "stop"),
    ),
}
# Calls whose arguments are not JSON on either side: compared as text.
RAW_ARGUMENTS = frozenset({"max_tokens_mid_call", "stop_string_inside_call", "invalid_json_arguments"})


def prompt_ids(tokenizer: Any, spec: Spec) -> list[int]:
    tools = TOOLS if spec.tools else None
    text = tokenizer.apply_chat_template(USER, tools=tools, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_case(tokenizer: Any, folder: Path, spec: Spec, seed: int) -> dict[str, Any]:
    output = encode(tokenizer, spec.output) + ([tokenizer.convert_tokens_to_ids(EOT)] if spec.eos else [])
    return parity.oracle_case(
        folder,
        prompt_ids(tokenizer, spec),
        output,
        seed,
        tool_parser="llama3_json",
        tools=TOOLS if spec.tools else [],
        messages=USER,
        stop=spec.stop,
        chat_template_kwargs={},
        model_type="llama",
        request=spec.request,
    )


def build(fixture: Fixture) -> Built:
    from transformers import AutoTokenizer

    folder = llama3_tokenizer_dir(fixture("qwen3_tokenizer_dir"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = vocab_for(tokenizer)
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="llama3_json",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    raw_arguments=RAW_ARGUMENTS,
)
