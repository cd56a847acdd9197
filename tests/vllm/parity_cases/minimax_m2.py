"""onehop's minimax_m2 reasoning + tool parsing against vLLM 0.32's `minimax_m2`, through the parity oracle.

Each case is MiniMax M2 output encoded with the MiniMax test tokenizer (Qwen3's
BPE plus MiniMax's added tokens; what differs from MiniMax's own is in
`tests.support.minimax_m2`) after a prompt rendered with its test template, run
through vLLM's coupled chat serving in-process (`scripts/vllm_parse_oracle.py`,
one oracle process for the test session) and through onehop's derender, for six
chunkings and the non-streamed path. Reasoning, content, tool names,
arguments (parsed JSON), the id shape, finish_reason and reasoning tokens must
agree.

Where vLLM's streamed and non-streamed answers disagree, or vLLM loses text or
writes invalid JSON, onehop gives one answer (vLLM's non-streamed one unless it
is plainly wrong). Each such difference is a named `Deviation` carrying both
sides' exact values: the test fails if either side changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derender.parsers.minimax_m2 import END, START
from derender.vocab import vocab_for
from tests.support import parity
from tests.support.minimax_m2 import EOS, minimax_tokenizer_dir
from tests.support.parity import LOSSY, Deviation, both, encode
from tests.vllm.parity_cases.family import Built, Counted, Family, Fixture, StreamTokens, build_all

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "note": {"type": "string"},
        "days": {"type": "integer"},
        "temp": {"type": "number"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "maybe": {"type": ["string", "null"]},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]


def invoke(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f'<parameter name="{key}">{value}</parameter>\n' for key, value in params)
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return f"{START}\n{''.join(invokes)}{END}"


PARIS = invoke("get_weather", ("city", "Paris"), ("days", "2"))
ROME = invoke("get_weather", ("city", "Rome"))
UTC = invoke("get_time", ("tz", "UTC"))
TYPED = invoke(
    "get_weather",
    ("city", "Lyon"),
    ("days", "1e3"),
    ("temp", "3.0"),
    ("metric", "True"),
    ("opts", '{"wind": [1, 2.5], "gust": null}'),
    ("tags", '["a", "b"]'),
    ("maybe", "null"),
    ("unit", "c"),
    ("note", '{"not": "typed"}'),
)
BAD_TYPES = invoke("get_weather", ("days", "seven"), ("opts", '{"a": 1'), ("metric", "yes"), ("extra", "42"))
AFTER = "\nI will report back shortly."
NOTE = '\nline 1 < 2\n\t"quoted" \\ </p>\n'
OPEN_WEATHER = '\n<invoke name="get_weather">\n'
LAUNCH = invoke("launch", ("speed", "3"))


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output and the request around it."""

    output: tuple[str, ...]
    eos: bool = True
    stop: tuple[str, ...] = ()
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: bool = True
    reasoning_parser: str = "minimax_m2"
    request: dict[str, Any] = field(default_factory=dict)


SPECS: dict[str, Spec] = {
    "reasoning_content_call": Spec(("Plan it.\n</think>\n\nLet me check.\n", block(PARIS))),
    "parallel_typed_calls": Spec(("Two.\n</think>\n\n", block(PARIS, ROME, TYPED, invoke("ping")))),
    "call_inside_reasoning": Spec(("I will call ", block(UTC))),
    "non_ascii_multiline_values": Spec(
        (
            "R.</think>",
            block(invoke("get_weather", ("city", " Zürich 世界 🫠 "), ("note", NOTE))),
        )
    ),
    "untyped_values_and_parameter_not_in_schema": Spec(("R.</think>", block(BAD_TYPES, invoke("ping", ("q", "5"))))),
    "unknown_function": Spec(("R.</think>", block(LAUNCH), "\nDone.")),
    "unknown_function_after_a_call": Spec(("R.</think>", block(UTC, LAUNCH))),
    "text_after_last_call": Spec(("R.</think>", block(ROME), AFTER)),
    "parallel_tool_calls_false": Spec(("R.</think>", block(UTC, ROME)), request={"parallel_tool_calls": False}),
    "truncated_in_a_string_value": Spec(
        ("R.</think>", START, OPEN_WEATHER, '<parameter name="days">3</parameter>\n<parameter name="city">Par'),
        eos=False,
    ),
    "truncated_in_a_typed_value": Spec(
        ("R.</think>", START, OPEN_WEATHER, '<parameter name="city">Rome</parameter>\n<parameter name="days">1'),
        eos=False,
    ),
    "stop_string_inside_a_call": Spec(
        ("R.</think>", block(invoke("get_weather", ("days", "2"), ("city", "Lyon")))), stop=("Lyon",)
    ),
    "tools_not_offered": Spec(("R.</think>Hi ", block(UTC), " tail"), tools=False),
    "tool_choice_none": Spec(("R.</think>Hi ", block(UTC)), request={"tool_choice": "none"}),
    "unclosed_parameter_at_invoke_end": Spec(
        ("R.</think>", START, '\n<invoke name="get_weather">\n<parameter name="city">Paris\n</invoke>\n', END)
    ),
    "next_parameter_without_close": Spec(
        (
            "R.</think>",
            START,
            OPEN_WEATHER + '<parameter name="city">Paris\n<parameter name="days">2</parameter>\n</invoke>\n',
            END,
        )
    ),
    "missing_invoke_end": Spec(
        ("R.</think>", START, '\n<invoke name="get_time">\n<parameter name="tz">UTC</parameter>\n', END, "\nAfter.")
    ),
    "block_without_invoke": Spec(("R.</think>", START, "\nnothing to call\n", END, "ok")),
    "bare_invoke_then_text": Spec(("R.</think>", UTC, "Thanks, bye.")),
    # The marker spellings as ordinary tokens (each half encoded on its own), around a bare invoke.
    "markers_split_across_tokens": Spec(("R.</think>", "<minimax:tool", "_call>\n", UTC, "</minimax:tool", "_call>")),
    "quote_styles": Spec(
        (
            "R.</think>",
            block(
                "<invoke name='get_time'><parameter name='tz'>UTC</parameter></invoke>",
                "<invoke name=get_weather><parameter  name = city >Oslo</parameter></invoke>",
            ),
        )
    ),
    "repeated_parameter": Spec(
        ("R.</think>", block(invoke("get_weather", ("city", "A"), ("days", "1"), ("city", "B"))))
    ),
    "thinking_disabled_prompt": Spec(("Sure. ", block(UTC)), template_kwargs={"enable_thinking": False}),
    "reasoning_whitespace": Spec(("\n  Lead and trail  \n\n</think>\n\nAnswer\n",)),
    "reasoning_cut_by_max_tokens": Spec(("Still thinking about it \n ",), eos=False),
    "stray_markers_in_content": Spec(("R.</think>A</think>B<think>C", END, "D")),
    "reasoning_ended_by_eos": Spec(("Unfinished thought",)),
    "call_without_parameters": Spec(("R.</think>", block('<invoke name="ping"></invoke>\n', invoke("ping")))),
    "marker_inside_a_value": Spec(
        ("R.</think>", START, OPEN_WEATHER, '<parameter name="note">a ', END, " b</parameter>\n</invoke>\n", END)
    ),
    "append_think": Spec(("R.</think>\n\nHi ", block(UTC)), reasoning_parser="minimax_m2_append_think"),
}


def weather(arguments: str) -> list[tuple[str, str]]:
    """The `calls` value of one get_weather call."""
    return [("get_weather", arguments)]


TWICE = '{"city": "A", "days": 1, "city": "B"}'
SPLIT_CONTENT = f"{START}\n{END}"  # the line break right before the bare call is dropped (issue #27)

DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    # vLLM strips content when calls were made, non-streamed only; a stream cannot take back
    # what it sent, so onehop keeps the streamed text (as vLLM streams it) in both shapes.
    "reasoning_content_call": (
        Deviation("vllm_full_strips_content_with_calls", "full", "content", ("Let me check.",), "\n\nLet me check."),
        # The line break right before the call: vLLM streams it, onehop drops it (issue #27).
        Deviation(parity.DROPS_SPACE_BEFORE_CALL, "stream", "content", ("\n\nLet me check.\n",), "\n\nLet me check."),
    ),
    # An invoke of a function the request did not offer is no call (vLLM's validate_tool_names);
    # vLLM drops its text, and its stream also drops the newline after it on some chunkings.
    "unknown_function": (
        Deviation("vllm_drops_unknown_function", "stream", "content", LOSSY, block(LAUNCH) + "\nDone."),
        Deviation("vllm_drops_unknown_function", "full", "content", ("\nDone.",), block(LAUNCH) + "\nDone."),
    ),
    "unknown_function_after_a_call": both(
        "vllm_drops_unknown_function", "content", None, LAUNCH.rstrip()
    ),
    # vLLM's non-streamed answer loses text after calls; its stream drops the newline when it
    # arrives alone in a chunk.
    "text_after_last_call": (
        Deviation("vllm_full_drops_text_after_calls", "full", "content", (None,), AFTER),
        Deviation("vllm_stream_drops_newline_after_calls", "stream", "content", (AFTER.lstrip(), AFTER), AFTER),
    ),
    # vLLM streams the cut string unclosed (invalid JSON) and its full answer drops it (and says
    # tool_calls); onehop keeps what arrived and closes it.
    "truncated_in_a_string_value": (
        Deviation("vllm_streams_cut_value_unclosed", "stream", "calls", (weather('{"days": 3, "city": "Par'),),
                  weather('{"days": 3, "city": "Par"}')),
        Deviation("vllm_full_drops_cut_value", "full", "calls", (weather('{"days": 3}'),),
                  weather('{"days": 3, "city": "Par"}')),
        Deviation("vllm_full_tool_calls_after_length", "full", "finish_reason", ("tool_calls",), "length"),
    ),
    "truncated_in_a_typed_value": (
        Deviation("vllm_streams_cut_value_unclosed", "stream", "calls", (weather('{"city": "Rome", "days": '),),
                  weather('{"city": "Rome", "days": 1}')),
        Deviation("vllm_full_drops_cut_value", "full", "calls", (weather('{"city": "Rome"}'),),
                  weather('{"city": "Rome", "days": 1}')),
        Deviation("vllm_full_tool_calls_after_length", "full", "finish_reason", ("tool_calls",), "length"),
    ),
    "stop_string_inside_a_call": (
        # The stop string's hold-back lags vLLM's text behind the ids: part of the block marker
        # streams as content, and the cut value streams unclosed. onehop never splits a marker
        # from its id; the value the stop string cut before any text arrived leaves nothing.
        Deviation("vllm_streams_held_marker_text", "stream", "content",
                  ("<minimax:tool_ca", "<minimax:tool_cal", None), None),
        Deviation("vllm_streams_cut_value_unclosed", "stream", "calls", (weather('{"days": 2, "city": "'),),
                  weather('{"days": 2}')),
        # onehop (chat.py): `stop`, not `tool_calls`, when a stop string cut the call short.
        *both("onehop_stop_string_cut_call_finishes_stop", "finish_reason", "tool_calls", "stop"),
    ),
    # Without tools (or with tool_choice none) vLLM still strips the block, and its full answer
    # the text after it; onehop does no tool parsing then and keeps the model's text.
    "tools_not_offered": (
        Deviation("vllm_drops_tool_block_without_tools", "stream", "content", ("Hi  tail",),
                  f"Hi {block(UTC)} tail"),
        Deviation("vllm_drops_tool_block_without_tools", "full", "content", ("Hi",), f"Hi {block(UTC)} tail"),
    ),
    "tool_choice_none": both("vllm_drops_tool_block_without_tools", "content", "Hi ", f"Hi {block(UTC)}"),
    # A value still open at `</invoke>`: vLLM streams it unclosed and its full answer drops it.
    "unclosed_parameter_at_invoke_end": (
        Deviation("vllm_streams_cut_value_unclosed", "stream", "calls", (weather('{"city": "Paris\\n'),),
                  weather('{"city": "Paris\\n"}')),
        Deviation("vllm_full_drops_cut_value", "full", "calls", (weather("{}"),), weather('{"city": "Paris\\n"}')),
    ),
    # vLLM reads everything after a missing `</invoke>` as arguments: the text is lost.
    "missing_invoke_end": both("vllm_reads_on_after_missing_invoke_end", "content", None, "\nAfter."),
    # A block with no invoke in it: vLLM drops it; onehop gives it back.
    "block_without_invoke": both(
        "vllm_drops_block_without_calls", "content", "ok", f"{START}\nnothing to call\n{END}ok"
    ),
    # Text after a bare invoke (no wrapper): vLLM drops it as framing.
    "bare_invoke_then_text": both("vllm_drops_text_after_bare_call", "content", None, "\nThanks, bye."),
    # Text that spells the markers is not the marker tokens: onehop keeps it as content around
    # the bare call. vLLM's stream drops the text after the bare call; its full answer reads the
    # text as markers.
    "markers_split_across_tokens": (
        Deviation("vllm_drops_text_after_bare_call", "stream", "content", (f"{START}\n",), SPLIT_CONTENT),
        Deviation("vllm_full_parses_marker_text", "full", "content", (None,), SPLIT_CONTENT),
    ),
    # vLLM: first position, last value; its stream cannot retract and stops (invalid JSON).
    # onehop writes the key again, which parses to the same object.
    "repeated_parameter": (
        Deviation("vllm_streams_repeated_parameter_cut", "stream", "calls", (weather('{"city": "A", "days": '),),
                  weather(TWICE)),
        Deviation("vllm_full_repeated_parameter", "full", "calls", (weather('{"city": "B", "days": 1}'),),
                  weather(TWICE)),
    ),
    # A prompt that closes `<think>` (thinking off): vLLM's full answer still starts in reasoning;
    # its stream, and onehop, read the prompt and give content.
    "thinking_disabled_prompt": (
        Deviation("vllm_full_ignores_closed_think_in_prompt", "full", "reasoning", ("Sure.",), None),
        Deviation("vllm_full_ignores_closed_think_in_prompt", "full", "content", (None,), "Sure."),
        Deviation(parity.DROPS_SPACE_BEFORE_CALL, "stream", "content", ("Sure. ",), "Sure."),
        Deviation("vllm_full_ignores_closed_think_in_prompt", "full", "reasoning_tokens", (3,), 0),
    ),
    # append_think: vLLM's tool pass drops the model's `</think>` from the content it was meant
    # to keep whole, and its full answer strips the content; onehop keeps the output verbatim.
    "append_think": (
        Deviation("vllm_append_think_drops_think_end", "stream", "content", ("<think>R.\n\nHi ",),
                  "<think>R.</think>\n\nHi"),
        Deviation("vllm_append_think_drops_think_end", "full", "content", ("<think>R.\n\nHi",),
                  "<think>R.</think>\n\nHi"),
    ),
}
# Calls whose arguments are not JSON on either side: compared as text.
RAW_ARGUMENTS: frozenset[str] = frozenset()
# (case, chunking index or None for all) -> vLLM's streamed reasoning_tokens where it differs
# from its non-streamed count: the stop string's hold-back undercounts on fine chunkings, and
# the tokens that arrive in the chunk carrying the EOS are missed when reasoning never closed.
# onehop counts ids, vLLM's non-streamed count.
# A case whose full count is a deviation lists vLLM's streamed count too (its full count there).
STREAM_REASONING_TOKENS: StreamTokens = {
    ("thinking_disabled_prompt", None): 3,
    ("stop_string_inside_a_call", 0): 0,
    ("stop_string_inside_a_call", 1): 0,
    ("reasoning_ended_by_eos", 1): 2,
    **{("reasoning_ended_by_eos", k): 0 for k in range(2, 6)},
}

def prompt_ids(tokenizer: Any, spec: Spec) -> list[int]:
    tools = TOOLS if spec.tools else None
    text = tokenizer.apply_chat_template(
        USER, tools=tools, add_generation_prompt=True, tokenize=False, **spec.template_kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_case(tokenizer: Any, folder: Path, spec: Spec, seed: int) -> dict[str, Any]:
    output = encode(tokenizer, spec.output)
    output += [tokenizer.convert_tokens_to_ids(EOS)] if spec.eos else []
    return parity.oracle_case(
        folder,
        prompt_ids(tokenizer, spec),
        output,
        seed,
        tool_parser="minimax_m2",
        reasoning_parser=spec.reasoning_parser,
        tools=TOOLS if spec.tools else [],
        messages=USER,
        stop=spec.stop,
        chat_template_kwargs=spec.template_kwargs,
        request=spec.request,
    )


def build(fixture: Fixture) -> Built:
    from transformers import AutoTokenizer

    folder = minimax_tokenizer_dir(fixture("qwen3_tokenizer_dir"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = vocab_for(tokenizer)
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="minimax_m2",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    raw_arguments=RAW_ARGUMENTS,
    reasoning_tokens=Counted(STREAM_REASONING_TOKENS),
    lossy_must_bite=True,
)
