"""onehop's `pythonic` / `llama4_pythonic` tool parsing against vLLM 0.32's, through the parity oracle.

Each case is Llama-style pythonic output encoded with the pythonic test
tokenizer (Qwen3's BPE plus Llama 4's `<|python_start|>`, `<|python_end|>` and
`<|eot|>`; what differs from Llama's own is in `tests.support.pythonic`), run
through vLLM's coupled chat serving in-process (`scripts/vllm_parse_oracle.py`,
one oracle process for the test session) and through onehop's derender, for six
chunkings and the non-streamed path. Content, tool names, arguments (parsed
JSON), the id shape and finish_reason must agree.

vLLM re-parses the whole text with `ast` per chunk: its stream sends what
parsed so far, and its full answer is a call list only when all of the output
is one. Where the two disagree, or vLLM loses text, onehop gives one answer
(vLLM's non-streamed one unless it is plainly wrong; a call already streamed
cannot be taken back). Each such difference is a named `Deviation` carrying
both sides' exact values: the test fails if either side changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derender.parsers.pythonic import PYTHON_END as PE, PYTHON_START as PS
from derender.vocab import vocab_for
from tests.support import parity
from tests.support.parity import LOSSY, Deviation, Split, encode, parsed_calls
from tests.support.pythonic import EOT, pythonic_tokenizer_dir
from tests.support.tools import WEATHER_TOOLS
from tests.vllm.parity_cases.family import Built, Family, Fixture, build_all

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
UTC = '[get_time(tz="UTC")]'


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output and the request around it."""

    output: tuple[str | Split, ...]
    eos: bool = True
    stop: tuple[str, ...] = ()
    parser: str = "pythonic"
    tools: bool = True
    request: dict[str, Any] = field(default_factory=dict)


SPECS: dict[str, Spec] = {
    "one_call": Spec(('[get_weather(city="Paris", days=2)]',)),
    "parallel_calls": Spec(("[get_weather(city='Paris', days=2), get_time(tz=\"UTC\")]",)),
    "escapes_and_non_ascii": Spec(
        ('[get_weather(city="Zürich 世界 🫠", note="Zeile 1\\nZeile 2\\t\\"q\\" \\\\ \\u00e9\\x41")]',)
    ),
    "triple_quoted_multiline": Spec(("[get_weather(city='Oslo', note='''line 1\nit's \"2\"\nline 3''')]",)),
    "raw_line_break_in_string": Spec(('[get_weather(city="Oslo", note="a\nb")]',)),
    "laid_out_over_lines": Spec(('[get_weather(city="Paris",\n             days=2),\n get_time( tz = "UTC" )]',)),
    "python_literals": Spec(
        (
            "[get_weather(city='Rome', days=-3, metric=True, note=None, extra=[1, 2.5, 'x,)]'],"
            " opts={'a': (1, 2), 'b': null}, flag=false)]",
        )
    ),
    "call_without_arguments": Spec(("[get_time(), get_time()]",)),
    "dotted_later_call": Spec(('[get_time(tz="UTC"), tools.lookup(q="x")]',)),
    "unknown_function": Spec(('[launch(speed="3")]',)),
    "text_after_last_call": Spec((UTC, "\n\nChecking now.")),
    "whitespace_after_list": Spec((UTC, "\n\n")),
    "list_left_open": Spec(('[get_time(tz="A"), get_time(tz="B")',)),
    "plain_answer": Spec(("Sure: it is sunny.",)),
    "leading_space": Spec((" " + UTC,)),
    "markdown_link": Spec(("[docs](https://x.y) say hi",)),
    "empty_list": Spec(("[]",)),
    "spaced_first_call": Spec(('[ get_time(tz="UTC")]',)),
    "positional_argument": Spec(('[get_time("UTC")]',)),
    "bad_value_after_header": Spec(('[get_weather(city="Paris", days=1 + 2)]',)),
    "unquoted_value": Spec(("[get_weather(city=Paris)]",)),
    "max_tokens_mid_string": Spec(('[get_weather(city="Par',), eos=False),
    "max_tokens_mid_number": Spec(('[get_weather(city="Oslo", days=12',), eos=False),
    "max_tokens_mid_name": Spec(("[get_wea",), eos=False),
    "stop_string_inside_call": Spec(('[get_weather(city="Lyon", days=3)]',), stop=("Lyon",)),
    "tools_not_offered": Spec((UTC,), tools=False),
    "tool_choice_none": Spec((UTC,), request={"tool_choice": "none"}),
    "parallel_tool_calls_false": Spec(
        ('[get_time(tz="A"), get_time(tz="B")]',), request={"parallel_tool_calls": False}
    ),
    "llama4_plain": Spec((UTC,), parser="llama4_pythonic"),
    "llama4_wrapped": Spec((PS, UTC, PE), parser="llama4_pythonic"),
    "llama4_wrapped_specials_kept": Spec(
        (PS, UTC, PE), parser="llama4_pythonic", request={"skip_special_tokens": False}
    ),
    "llama4_wrapped_text": Spec(
        (PS, "Just text.", PE), parser="llama4_pythonic", request={"skip_special_tokens": False}
    ),
    "llama4_marker_text_split": Spec((Split(PS + UTC + PE),), parser="llama4_pythonic"),
    "pythonic_skips_wrapper": Spec((PS, UTC, PE)),
    "pythonic_keeps_wrapper_text": Spec((PS, UTC, PE), request={"skip_special_tokens": False}),
}

Calls = list[tuple[str, str]]
CLOCK: Calls = [("get_time", '{"tz": "UTC"}')]


def full_as_text(name: str, text: str, content: str | None, calls: Calls, finish: str | None) -> tuple[Deviation, ...]:
    """vLLM's full answer takes the whole output as content (it is not one complete call list);
    onehop streamed calls before it could know, and cannot take them back. `finish`: onehop's
    finish_reason where vLLM's is `stop` (None: both agree)."""
    return (
        Deviation(name, "full", "content", (text,), content),
        Deviation(name, "full", "calls", ([],), calls),
        *((Deviation(name, "full", "finish_reason", ("stop",), finish),) if finish is not None else ()),
    )


def stream_calls(name: str, vllm: tuple[Calls, ...], onehop: Calls, finish: str) -> tuple[Deviation, ...]:
    """vLLM's stream sends the calls that parsed so far, by chunking; `finish_reason` follows them."""
    finishes = tuple(dict.fromkeys("tool_calls" if calls else "stop" for calls in vllm))
    return (
        Deviation(name, "stream", "calls", vllm, onehop),
        Deviation(name, "stream", "finish_reason", finishes, finish),
    )


def stream_loses_content(name: str, onehop: str) -> Deviation:
    """vLLM's stream holds back every chunk of an output that starts with `[` and never parses."""
    return Deviation(name, "stream", "content", LOSSY, onehop)


HELD_TEXT = "vllm_stream_holds_text_opening_with_bracket"
WEATHER_ARGS = '{"city": "Paris"}'
TRIPLE_ARGS = json.dumps({"city": "Oslo", "note": "line 1\nit's \"2\"\nline 3"}, ensure_ascii=False)
DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    # vLLM's stream cannot complete a triple-quoted string that holds line breaks: the value is lost.
    "triple_quoted_multiline": (
        Deviation("vllm_stream_loses_triple_quoted", "stream", "calls", LOSSY, [("get_weather", TRIPLE_ARGS)]),
    ),
    # A raw line break inside a quoted string is no Python: vLLM's full answer is all text, its
    # stream loses the value; onehop keeps the string as written.
    "raw_line_break_in_string": (
        *full_as_text(
            "vllm_rejects_raw_line_break",
            '[get_weather(city="Oslo", note="a\nb")]',
            None,
            [("get_weather", '{"city": "Oslo", "note": "a\\nb"}')],
            "tool_calls",
        ),
        *stream_calls(
            "vllm_rejects_raw_line_break",
            (
                [("get_weather", '{"city": "Oslo", "note": "a')],
                [("get_weather", '{"city": "Oslo", "note": "')],
                [],
            ),
            [("get_weather", '{"city": "Oslo", "note": "a\\nb"}')],
            "tool_calls",
        ),
    ),
    # Text after the list: vLLM's full answer drops the calls, its stream drops the text.
    "text_after_last_call": (
        *full_as_text(
            "vllm_drops_calls_or_text_after_list",
            '[get_time(tz="UTC")]\n\nChecking now.',
            "\n\nChecking now.",
            CLOCK,
            "tool_calls",
        ),
        *stream_calls("vllm_drops_calls_or_text_after_list", (CLOCK, []), CLOCK, "tool_calls"),
        stream_loses_content("vllm_drops_calls_or_text_after_list", "\n\nChecking now."),
    ),
    # A list the model never closed: vLLM's stream has the calls, its full answer is text.
    "list_left_open": full_as_text(
        "vllm_full_needs_closed_list",
        '[get_time(tz="A"), get_time(tz="B")',
        None,
        [("get_time", '{"tz": "A"}'), ("get_time", '{"tz": "B"}')],
        "tool_calls",
    ),
    "markdown_link": (stream_loses_content(HELD_TEXT, "[docs](https://x.y) say hi"),),
    "empty_list": (stream_loses_content(HELD_TEXT, "[]"),),
    "max_tokens_mid_name": (stream_loses_content(HELD_TEXT, "[get_wea"),),
    "unquoted_value": (
        stream_loses_content(HELD_TEXT, "[get_weather(city=Paris)]"),
    ),
    "llama4_wrapped_text": (
        stream_loses_content(HELD_TEXT, f"{PS}Just text.{PE}"),
    ),
    # vLLM's full answer wants the first call unspaced and keyword-only (its regex); its stream does
    # not, and drops a positional argument. onehop gives the full answer.
    "spaced_first_call": (
        *stream_calls("vllm_stream_ignores_opening_rule", (CLOCK,), [], "stop"),
        stream_loses_content("vllm_stream_ignores_opening_rule", '[ get_time(tz="UTC")]'),
    ),
    "positional_argument": (
        *stream_calls("vllm_stream_drops_positional_argument", ([("get_time", "{}")],), [], "stop"),
        stream_loses_content("vllm_stream_drops_positional_argument", '[get_time("UTC")]'),
    ),
    # A value that is no literal after a call was announced: vLLM's full answer is all text, its
    # stream keeps a cut string; onehop keeps the good part of the call and gives the rest as content.
    "bad_value_after_header": (
        *full_as_text(
            "vllm_loses_call_before_bad_value",
            '[get_weather(city="Paris", days=1 + 2)]',
            ", days=1 + 2)]",
            [("get_weather", WEATHER_ARGS)],
            "tool_calls",
        ),
        *stream_calls(
            "vllm_loses_call_before_bad_value",
            ([("get_weather", '{"city": "Paris')], [("get_weather", '{"city": "')], []),
            [("get_weather", WEATHER_ARGS)],
            "tool_calls",
        ),
        stream_loses_content("vllm_loses_call_before_bad_value", ", days=1 + 2)]"),
    ),
    # Cut by max_tokens: vLLM's full answer is the text, its stream the call so far (a number that
    # may still grow is held back); onehop streams the call as far as it got, then closes its
    # arguments to valid JSON, streamed and not (issue #27).
    "max_tokens_mid_string": (
        *full_as_text(
            "vllm_full_cut_call_is_text", '[get_weather(city="Par', None, [("get_weather", '{"city": "Par"}')], None
        ),
        Deviation(
            parity.CLOSES_CUT_CALL, "stream", "calls", ([("get_weather", '{"city": "Par')],), [("get_weather", '{"city": "Par"}')]
        ),
    ),
    "max_tokens_mid_number": (
        *full_as_text(
            "vllm_full_cut_call_is_text",
            '[get_weather(city="Oslo", days=12',
            None,
            [("get_weather", '{"city": "Oslo", "days": 12}')],
            None,
        ),
        Deviation(
            "vllm_stream_holds_number",
            "stream",
            "calls",
            (
                [("get_weather", '{"city": "Oslo')],
                [("get_weather", '{"city": "Os')],
                [("get_weather", '{"city": "')],
                [],
            ),
            [("get_weather", '{"city": "Oslo", "days": 12}')],
        ),
    ),
    "stop_string_inside_call": (
        *full_as_text(
            "vllm_full_cut_call_is_text", '[get_weather(city="', None, [("get_weather", '{"city": ""}')], None
        ),
        Deviation(parity.CLOSES_CUT_CALL, "stream", "calls", ([("get_weather", '{"city": "')],), [("get_weather", '{"city": ""}')]),
        # onehop (chat.py): `stop`, not `tool_calls`, when a stop string cut the call short.
        Deviation("onehop_stop_string_cut_call_finishes_stop", "stream", "finish_reason", ("tool_calls",), "stop"),
    ),
    # `<|python_start|>` written as ordinary tokens: vLLM reads text only and takes the call; onehop
    # follows the ids (a marker is its token), as its token route always does.
    "llama4_marker_text_split": (
        Deviation("vllm_parses_marker_text", "full", "content", (None,), f"{PS}{UTC}{PE}"),
        Deviation("vllm_parses_marker_text", "full", "calls", (CLOCK,), []),
        Deviation("vllm_parses_marker_text", "full", "finish_reason", ("tool_calls",), "stop"),
        Deviation("vllm_parses_marker_text", "stream", "content", LOSSY, f"{PS}{UTC}{PE}"),
        *stream_calls("vllm_parses_marker_text", (CLOCK,), [], "stop"),
    ),
}
# Calls cut short: arguments are not JSON on either side and compare as text.
RAW_ARGUMENTS = frozenset({"max_tokens_mid_string", "max_tokens_mid_number", "stop_string_inside_call"})


def build_case(tokenizer: Any, folder: Path, spec: Spec, seed: int) -> dict[str, Any]:
    output = encode(tokenizer, spec.output) + ([tokenizer.convert_tokens_to_ids(EOT)] if spec.eos else [])
    tools = TOOLS if spec.tools else None
    prompt = tokenizer.apply_chat_template(USER, tools=tools, add_generation_prompt=True, tokenize=False)
    return parity.oracle_case(
        folder,
        tokenizer.encode(prompt, add_special_tokens=False),
        output,
        seed,
        tool_parser=spec.parser,
        tools=TOOLS if spec.tools else [],
        messages=USER,
        stop=spec.stop,
        chat_template_kwargs={},
        model_type="llama4" if spec.parser == "llama4_pythonic" else "llama",
        request=spec.request,
    )


def build(fixture: Fixture) -> Built:
    from transformers import AutoTokenizer

    folder = pythonic_tokenizer_dir(fixture("qwen3_tokenizer_dir"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = vocab_for(tokenizer)
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="pythonic",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    raw_arguments=RAW_ARGUMENTS,
    normal_calls=parsed_calls,
)
