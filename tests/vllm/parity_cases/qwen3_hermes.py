"""onehop's qwen3 + hermes parsing against vLLM 0.32's, through the parity oracle (opt-in).

The harness's end-to-end proof on parsers both sides already have: each case
is model output text encoded with the Qwen3 tokenizer after a prompt rendered
with its chat template, run through vLLM's coupled chat serving in-process
(``scripts/vllm_parse_oracle.py``, one oracle process for the test session) and
through onehop's derender, for six chunkings and the non-streaming path.

Where the answers differ on purpose, or vLLM disagrees with itself, the
difference is a named ``Deviation`` with both sides' exact values: the test
fails if either side changes, so nothing is papered over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.qwen3.vocab import IM_END_ID
from tests.support import parity
from tests.support.parity import Deviation, both
from tests.support.tools import WEATHER_TOOLS
from tests.vllm.parity_cases.family import Built, Counted, Family, Fixture, StreamTokens, build_all

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
PARIS = {"city": "Paris", "days": 2}
ROME = {"city": "Rome"}
NON_ASCII = {"city": "Zürich", "note": "Grüße aus 世界 🫠\nzweite Zeile\n\tein Tab, \"Zitat\""}


def call(name: str, arguments: dict[str, Any], *, indent: int | None = None) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, indent=indent)
    return f"<tool_call>\n{body}\n</tool_call>"


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output text and the request around it."""

    output: str
    eos: bool = True
    stop: tuple[str, ...] = ()
    enable_thinking: bool = True
    cut_after: str | None = None
    """Keep ``output`` only up to the end of this text's first occurrence (a truncated generation)."""


SPECS: dict[str, Spec] = {
    "reasoning_then_two_parallel_calls": Spec(
        f"<think>\nTwo cities, two calls.\n</think>\n\n{call('get_weather', PARIS)}\n{call('get_weather', ROME)}"
    ),
    "call_right_after_reasoning": Spec(f"<think>\nJust call it.\n</think>{call('get_time', {'tz': 'Europe/Paris'})}"),
    "content_then_call": Spec(f"<think>\nCheck first.\n</think>\n\nLet me look that up.\n{call('get_weather', PARIS)}"),
    "non_ascii_multiline_arguments": Spec(
        f"<think>\nUmlaute 世界.\n</think>\n\n{call('get_weather', NON_ASCII, indent=2)}"
    ),
    "truncated_mid_call": Spec(
        f"<think>\nCut short.\n</think>\n\n{call('get_weather', {'city': 'Paris', 'note': 'a long note here'})}",
        eos=False,
        cut_after='"city": "Pa',
    ),
    "stop_string_inside_call": Spec(
        f"<think>\nStop inside.\n</think>\n\n{call('get_weather', {'city': 'Lyon', 'days': 3})}",
        stop=("Lyon",),
    ),
    "text_after_last_call": Spec(
        f"<think>\nThen talk.\n</think>\n\n{call('get_weather', ROME)}\nI will report back shortly."
    ),
    "thinking_disabled": Spec(f"Sure.\n{call('get_weather', ROME)}", enable_thinking=False),
}


def whitespace_before_call(vllm: tuple[Any, ...] = ("\n\n",)) -> Deviation:
    # DESIGN.md: vLLM streams the whitespace between </think> and <tool_call> but drops it
    # non-streamed; onehop drops it in both shapes (docs/derender.md, "Behaviour").
    return Deviation("vllm_streams_whitespace_before_call", "stream", "content", vllm, None)


def call_cut_short_full(raw: str, arguments: str) -> tuple[Deviation, ...]:
    # vLLM's non-streaming hermes parse fails on an unclosed call and returns the raw markup as
    # content with no call, while its stream sent the header and the partial arguments;
    # onehop's non-streamed answer is the fold of its stream (header + partial arguments).
    return (
        Deviation("vllm_full_returns_cut_call_as_raw_text", "full", "content", (raw,), None),
        Deviation("vllm_full_drops_cut_call", "full", "calls", ([],), [("get_weather", arguments)]),
    )


CUT_RAW = '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
TRAILING_TEXT = "\nI will report back shortly."

DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    "reasoning_then_two_parallel_calls": (whitespace_before_call(),),
    "non_ascii_multiline_arguments": (whitespace_before_call(),),
    # onehop closes a cut call's arguments to valid JSON, streamed and not (issue #27).
    "truncated_mid_call": (
        whitespace_before_call(),
        *call_cut_short_full(CUT_RAW + "Pa", '{"city": "Pa"}'),
        Deviation(parity.CLOSES_CUT_CALL, "stream", "calls", ([("get_weather", '{"city": "Pa')],), [("get_weather", '{"city": "Pa"}')]),
    ),
    "stop_string_inside_call": (
        # The stop string's hold-back (len("Lyon") - 1 characters) lags the text behind the
        # ids; hermes then streams the held part of the marker, "<tool_ca", as content, for
        # the chunkings where the marker's id arrives before all of its text.
        whitespace_before_call(("\n\n", "\n\n<tool_ca")),
        # onehop (docs/derender.md): `stop`, not `tool_calls`, when a stop string cut the call short;
        # vLLM's stream rewrites any `stop` after streamed calls; its full path says `stop`.
        Deviation("onehop_stop_string_cut_call_finishes_stop", "stream", "finish_reason", ("tool_calls",), "stop"),
        *call_cut_short_full(CUT_RAW, '{"city": ""}'),
        Deviation(parity.CLOSES_CUT_CALL, "stream", "calls", ([("get_weather", '{"city": "')],), [("get_weather", '{"city": ""}')]),
    ),
    # vLLM keeps the line break before a call in both paths; onehop drops it (issue #27).
    "content_then_call": both(parity.DROPS_SPACE_BEFORE_CALL, "content", "\n\nLet me look that up.\n", "\n\nLet me look that up."),
    "thinking_disabled": both(parity.DROPS_SPACE_BEFORE_CALL, "content", "Sure.\n", "Sure."),
    "text_after_last_call": (
        # vLLM drops text after the last call (hermes keeps only the text before the first
        # <tool_call>), in both paths; onehop keeps it as content (docs/derender.md: nothing lost).
        Deviation("vllm_drops_text_after_last_call", "stream", "content", ("\n\n",), TRAILING_TEXT),
        Deviation("vllm_drops_text_after_last_call", "full", "content", (None,), TRAILING_TEXT),
    ),
}
# A call cut short has arguments that are not JSON on either side: compare them as text.
CUT_SHORT = frozenset({"truncated_mid_call", "stop_string_inside_call"})
# vLLM's streamed reasoning_tokens follows the stream's text, so a lagging text (the stop
# string's hold-back) moves it by chunking; onehop counts ids between the markers, vLLM's
# non-streamed count. (case, chunking index) -> (vLLM, onehop).
STREAM_REASONING_TOKENS: StreamTokens = {("stop_string_inside_call", 1): (3, 4)}


def prompt_ids(tokenizer: Any, *, enable_thinking: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        USER, tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=enable_thinking
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_case(tokenizer: Any, tokenizer_dir: Path, spec: Spec, seed: int) -> dict[str, Any]:
    text = spec.output
    if spec.cut_after is not None:
        text = text[: text.index(spec.cut_after) + len(spec.cut_after)]
    output = list(tokenizer.encode(text, add_special_tokens=False)) + ([IM_END_ID] if spec.eos else [])
    return parity.oracle_case(
        tokenizer_dir,
        prompt_ids(tokenizer, enable_thinking=spec.enable_thinking),
        output,
        seed,
        tool_parser="hermes",
        reasoning_parser="qwen3",
        tools=TOOLS,
        messages=USER,
        stop=spec.stop,
        chat_template_kwargs={"enable_thinking": spec.enable_thinking},
    )


def build(fixture: Fixture) -> Built:
    tokenizer, folder, vocab = (fixture(name) for name in ("qwen3_tokenizer", "qwen3_tokenizer_dir", "qwen3_vocab"))
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="qwen3_hermes",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    raw_arguments=CUT_SHORT,
    reasoning_tokens=Counted(STREAM_REASONING_TOKENS),
    stop_reason=True,
)
