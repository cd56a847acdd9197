"""onehop's glm45 / glm47 parsing against vLLM 0.32's, through the parity oracle (opt-in).

Each case is GLM model output encoded with the GLM test tokenizer
(`tests.support.glm_tokenizer`: Qwen3's BPE plus GLM's marker tokens) after a
prompt rendered by its template, run through vLLM's coupled chat serving
in-process (`scripts/vllm_parse_oracle.py`, one oracle process for the test session) and
through onehop's derender: one token per chunk, random multi-token chunkings,
and the non-streaming path. Turns end on `<|observation|>` (GLM's generation
config stops on it; here it is a request stop token id, which stops the same way).

Where the answers differ on purpose, or vLLM disagrees with itself, the
difference is a named `Deviation` with both sides' exact values: the test
fails if either side changes, so nothing is papered over. The table in docs/derender.md
of such cases lists them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from derender.vocab import vocab_for
from tests.support import parity
from tests.support.glm_tokenizer import STOP_TOKENS, glm_token_id, glm_tokenizer_dir
from tests.support.parity import Deviation, both
from tests.vllm.parity_cases.family import Built, Counted, Family, Fixture, StreamTokens, build_all

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "n": {"type": ["string", "integer"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
    {"type": "function", "function": {"name": "ping"}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SPLITS = 2  # random multi-token chunkings per case, besides one token per chunk


def call(name: str, *pairs: tuple[str, str], newlines: bool = False) -> str:
    nl = "\n" if newlines else ""
    body = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in pairs)
    return f"<tool_call>{name}{nl}{body}</tool_call>"


PARIS = call(
    "get_weather", ("city", "Zürich 世界 🫠\nzweite Zeile"), ("days", "3"), ("metric", "true"), ("n", "42")
)
TWO_CITIES = call("get_weather", ("city", "Paris"), newlines=True) + "\n" + call("ping", newlines=True)
UTC = call("get_time", ("tz", "UTC"))


@dataclass(frozen=True)
class Spec:
    """A case before encoding: the model's output (parts encoded one by one) and the request."""

    output: tuple[str, ...]
    eos: bool = True
    stop: tuple[str, ...] = ()
    parser: str = "glm47"
    prompt: Literal["glm47", "glm45", "off"] = "glm47"
    tools: bool = True
    parallel_tool_calls: bool | None = None


SPECS: dict[str, Spec] = {
    "reasoning_then_typed_call": Spec((f"Plan the call.\n</think>{PARIS}",)),
    "glm45_newlines_model_opens_think": Spec(
        ("\n<think>Two calls.</think>\n" + TWO_CITIES,),
        parser="glm45",
        prompt="glm45",
    ),
    "call_inside_reasoning": Spec((f"I will call {UTC}",)),
    "content_then_call": Spec((f"r</think>Sure.\n{UTC}",)),
    "content_around_call": Spec((f"r</think>\nA.\n{UTC}\nB.\n",)),
    "text_after_last_call": Spec((f"r \n</think>\n\n{UTC}\nDone.\n",)),
    "key_given_twice": Spec((f"r</think>{call('get_time', ('tz', 'a'), ('tz', 'b'))}",)),
    "parallel_calls_false": Spec((f"r</think>{UTC}{call('ping')}",), parallel_tool_calls=False),
    "truncated_mid_value": Spec(("r</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa",), eos=False),
    "truncated_typed_value": Spec(("r</think><tool_call>get_weather<arg_key>days</arg_key><arg_value>12",), eos=False),
    "stop_string_inside_call": Spec(
        (f"r</think>{call('get_weather', ('city', 'Lyon'), ('days', '3'))}",), stop=("Lyon",)
    ),
    "unknown_function": Spec((f"r</think>{call('unknown_fn', ('x', '1'))}done",)),
    "split_tool_call_marker": Spec(("r</think>Say <", "tool", "_call>get_time</tool_call>")),
    "split_arg_tags": Spec(
        ("r</think><tool_call>get_time<", "arg", "_key>tz</", "arg_key><arg", "_value>UTC</arg_val", "ue></tool_call>")
    ),
    "missing_value_end": Spec(("r</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</tool_call>after",)),
    "nested_call_start": Spec((f"r</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC{call('ping')}",)),
    "think_again_after_content": Spec(("  first \n</think>a</think>b<think> second\n</think>c",)),
    "thinking_disabled": Spec((f"Hello.<think>x</think>y\n{call('ping')}",), prompt="off"),
    "tools_not_offered": Spec((f"r</think>ok{UTC}",), tools=False),
    "junk_between_pairs": Spec(
        ("r</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a</arg_value>\njunk\n"
         "<arg_key>x</arg_key>y<arg_key>opts</arg_key> <arg_value>{\"k\": [1]}</arg_value></tool_call>",)
    ),
}


def trailing_space_streamed(vllm: tuple[Any, ...], onehop: Any) -> Deviation:
    # vLLM's full answer strips content once calls were made; its stream sends the whitespace
    # before a call and at the end. onehop holds trailing whitespace and drops it when calls
    # were made, as the full answer has it.
    return Deviation("vllm_streams_trailing_whitespace_with_calls", "stream", "content", vllm, onehop)


def cut_value(raw_stream: str, name: str, onehop: str) -> tuple[Deviation, ...]:
    # A value still open when the call ends: vLLM streams the cut value (arguments that are not
    # JSON) and its full answer drops the pair; onehop closes it as far as it arrived.
    return (
        Deviation(
            "vllm_streams_cut_value_as_invalid_json", "stream", "calls", ([(name, raw_stream)],), [(name, onehop)]
        ),
        Deviation("vllm_full_drops_cut_value", "full", "calls", ([(name, "{}")],), [(name, onehop)]),
    )


def cut_finish_full() -> Deviation:
    # vLLM's full answer says tool_calls for any output with a call, even one cut by max_tokens;
    # its stream and onehop say length.
    return Deviation("vllm_full_tool_calls_after_length", "full", "finish_reason", ("tool_calls",), "length")


AFTER = "after"
SPLIT_TEXT = "Say <tool_call>get_time</tool_call>"
UNKNOWN = call("unknown_fn", ("x", "1"))
DEVIATIONS: dict[str, tuple[Deviation, ...]] = {
    "content_then_call": (trailing_space_streamed(("Sure.\n",), "Sure."),),
    "content_around_call": (
        trailing_space_streamed(("\nA.\n\nB.\n",), "\nA.\n\nB."),
        # vLLM's full answer loses text after a call, and strips the leading newline; onehop keeps
        # the text, and the leading newline has gone out before the call was known.
        Deviation("vllm_full_drops_text_after_call", "full", "content", ("A.",), "\nA.\n\nB."),
    ),
    "text_after_last_call": (
        trailing_space_streamed(("Done.\n", "\nDone.\n"), "Done."),
        Deviation("vllm_full_drops_text_after_call", "full", "content", (None,), "Done."),
    ),
    "key_given_twice": (
        # vLLM's stream stops at the repeated key (its JSON is no longer a prefix); onehop writes
        # the key twice, which parses to vLLM's full answer (the last value).
        Deviation(
            "vllm_streams_invalid_json_on_repeated_key", "stream", "calls", ([("get_time", '{"tz": "a')],),
            [("get_time", '{"tz": "a", "tz": "b"}')],
        ),
    ),
    "truncated_mid_value": (*cut_value('{"city": "Pa', "get_weather", '{"city": "Pa"}'), cut_finish_full()),
    "truncated_typed_value": (*cut_value('{"days": ', "get_weather", '{"days": 12}'), cut_finish_full()),
    "stop_string_inside_call": (
        # The stop string's hold-back lags the text behind the ids: for one token per chunk vLLM's
        # stream sends the held part of the marker, "<tool_ca", as content and no call.
        Deviation("vllm_stream_loses_call_to_stop_holdback", "stream", "content", ("<tool_ca", None), None),
        Deviation(
            "vllm_streams_cut_value_as_invalid_json", "stream", "calls", ([], [("get_weather", '{"city": "')]),
            [("get_weather", '{"city": ""}')],
        ),
        # onehop (docs/derender.md): `stop`, not `tool_calls`, when a stop string cut the call short.
        Deviation(
            "onehop_stop_string_cut_call_finishes_stop", "stream", "finish_reason", ("stop", "tool_calls"), "stop"
        ),
        Deviation(
            "vllm_full_drops_cut_value", "full", "calls", ([("get_weather", "{}")],), [("get_weather", '{"city": ""}')]
        ),
        Deviation("onehop_stop_string_cut_call_finishes_stop", "full", "finish_reason", ("tool_calls",), "stop"),
    ),
    # vLLM drops a call to a function that was not offered, text and all; onehop gives it back as content.
    "unknown_function": both("vllm_drops_call_to_unknown_function", "content", "done", UNKNOWN + "done"),
    "split_tool_call_marker": (
        # vLLM's full answer matches markers in text; its stream (and onehop) by token id, so
        # `<tool_call>` written as plain tokens is text.
        Deviation(
            "vllm_full_reads_split_marker_text_as_call", "full", "content", ("Say",), SPLIT_TEXT
        ),
        Deviation("vllm_full_reads_split_marker_text_as_call", "full", "calls", ([("get_time", "{}")],), []),
        Deviation("vllm_full_reads_split_marker_text_as_call", "full", "finish_reason", ("tool_calls",), "stop"),
    ),
    "missing_value_end": (
        *cut_value('{"tz": "UTC', "get_time", '{"tz": "UTC"}'),
        Deviation("vllm_full_drops_text_after_call", "full", "content", (None,), AFTER),
    ),
    "nested_call_start": (
        # A <tool_call> inside an open call: vLLM reads it as argument text of the first call;
        # onehop closes the open call and starts the next.
        Deviation(
            "vllm_merges_nested_call_into_first", "stream", "calls", ([("get_time", '{"tz": "UTC<tool_call>ping')],),
            [("get_time", '{"tz": "UTC"}'), ("ping", "{}")],
        ),
        Deviation(
            "vllm_merges_nested_call_into_first", "full", "calls", ([("get_time", "{}")],),
            [("get_time", '{"tz": "UTC"}'), ("ping", "{}")],
        ),
    ),
    "think_again_after_content": (
        # vLLM's stream drops the first block's trailing whitespace before the second block;
        # its full answer (and onehop) strips only the end of all reasoning.
        Deviation(
            "vllm_stream_drops_whitespace_between_think_blocks", "stream", "reasoning", ("  first second",),
            "  first \n second",
        ),
    ),
    "thinking_disabled": (trailing_space_streamed(("Hello.<think>x</think>y\n",), "Hello.<think>x</think>y"),),
    # Without tools vLLM's glm47 parser still consumes calls and drops them; onehop parses no
    # calls and the text is content (DERENDER_CASES 11).
    "tools_not_offered": both("vllm_drops_calls_when_tools_are_off", "content", "ok", "ok" + UTC),
}
# vLLM's streamed reasoning_tokens counts what its reasoning engine saw as text (a stop
# string's hold-back, a second think block seen by the tool engine are missed); onehop
# counts the ids routed to reasoning, vLLM's non-streamed count.
# (case, chunking index) -> (vLLM stream, onehop); every chunking when the index is None.
STREAM_REASONING_TOKENS: StreamTokens = {
    ("stop_string_inside_call", 0): (0, 1),
    ("think_again_after_content", None): (3, 5),
}

def prompt_ids(tokenizer: Any, style: str) -> list[int]:
    kwargs = {"glm47": {}, "glm45": {"model_opens_think": True}, "off": {"enable_thinking": False}}[style]
    text = tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def split_sizes(total: int, rng: random.Random) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(2, 8), total - sum(sizes)))
    return sizes


def build_case(tokenizer: Any, folder: Path, spec: Spec, seed: int) -> dict[str, Any]:
    output = [i for part in spec.output for i in tokenizer.encode(part, add_special_tokens=False)]
    stops = [glm_token_id(folder, text) for text in STOP_TOKENS]
    if spec.eos:
        output.append(stops[1])  # <|observation|>
    rng = random.Random(seed)
    return parity.oracle_case(
        folder,
        prompt_ids(tokenizer, spec.prompt),
        output,
        seed,
        tool_parser=spec.parser,
        reasoning_parser="glm45",
        tools=TOOLS if spec.tools else None,
        messages=USER,
        stop=spec.stop,
        parallel_tool_calls=spec.parallel_tool_calls,
        chat_template_kwargs={"enable_thinking": spec.prompt != "off"},
        chunkings=[[1]] + [split_sizes(len(output), rng) for _ in range(SPLITS)],
        request={"stop_token_ids": stops},
    )


def build(fixture: Fixture) -> Built:
    from transformers import AutoTokenizer

    folder = glm_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = vocab_for(tokenizer)
    return build_all(SPECS, lambda spec, seed: build_case(tokenizer, folder, spec, seed), lambda _: vocab, tokenizer)


FAMILY = Family(
    name="glm",
    build=build,
    cases=tuple(SPECS),
    deviations=DEVIATIONS,
    reasoning_tokens=Counted(STREAM_REASONING_TOKENS),
)
