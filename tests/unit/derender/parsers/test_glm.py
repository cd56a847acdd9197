"""glm45 / glm47 reasoning and tool calls through ChatDerender, fed in every chunking.

Each vector is model output text (or token pieces) after a prompt rendered by
the GLM test template; it is streamed one token per chunk, in widths 2..8 and
in random splits, and every folded answer must equal the non-streamed
`response()`. Expected answers follow vLLM 0.32's `glm45`/`glm47` parsers
except where vLLM loses text or writes invalid JSON (the module docstring of
`derender.parsers.glm`; tests/vllm/parity_cases/glm.py has those cases
against vLLM itself).

The tokenizer is Qwen3's BPE with GLM's added tokens (`tests.support.glm_tokenizer`
says what differs from GLM's real one): the markers are single tokens with
GLM's special flags, ordinary text splits differently than in GLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import REASONING_PARSERS, TOOL_PARSERS
from derender.parsers.base import ToolCallText
from derender.parsers.glm import format_calls_45, format_calls_47, forced_prefix_45, forced_prefix_47
from derender.text import TextParams
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest, DeltaFunctionCall
from tests.support.glm_tokenizer import glm_token_id, glm_tokenizer_dir
from tests.support.streams import FAMILY_CHUNKINGS, comparable_response, stream, whole

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "temp": {"type": "number"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "maybe": {"type": ["string", "null"]},
        "unit": {"enum": ["c", "f"]},
        "level": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "note": {"type": "string"},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
    {"type": "function", "function": {"name": "ping"}},
]
USER = [{"role": "user", "content": "hi"}]
CHUNKINGS = FAMILY_CHUNKINGS


def call(name: str, *pairs: tuple[str, str], newlines: bool = False) -> str:
    """A call as GLM-4.7 writes it, or GLM-4.5 with `newlines`."""
    nl = "\n" if newlines else ""
    body = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in pairs)
    return f"<tool_call>{name}{nl}{body}</tool_call>"


@dataclass(frozen=True)
class Answer:
    content: str | None
    reasoning: str | None
    calls: list[tuple[str, Any]]
    """(name, parsed arguments) per call."""
    finish_reason: str | None
    raw_arguments: list[str]
    reasoning_tokens: int


@dataclass(frozen=True)
class Glm:
    tokenizer: Any
    vocab: TokenVocab
    observation: int

    def enc(self, *parts: str) -> list[int]:
        """Each part encoded on its own (so a marker's text can be split into plain tokens)."""
        return [i for part in parts for i in self.tokenizer.encode(part, add_special_tokens=False)]

    def prompt(self, *, thinking: bool = True, model_opens_think: bool = False) -> list[int]:
        kwargs: dict[str, Any] = {"model_opens_think": model_opens_think}
        if not thinking:
            kwargs["enable_thinking"] = False
        template = self.tokenizer.apply_chat_template
        text = template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
        return self.enc(text)


@pytest.fixture(scope="module")
def glm() -> Glm:
    from transformers import AutoTokenizer

    folder: Path = glm_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Glm(tokenizer, vocab_for(tokenizer), glm_token_id(folder, "<|observation|>"))


def request(**extra: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "m", "messages": USER, "tools": TOOLS}
    body.update(extra)
    return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)


def options(
    req: ChatCompletionRequest | None = None,
    *,
    stop: Sequence[str] = (),
    parser: str = "glm47",
    reasoning: str = "glm45",
) -> ChatOptions:
    text = TextParams(stop=tuple(stop)) if stop else None
    return ChatOptions.from_request(req or request(), reasoning_parser=reasoning, tool_parser=parser, text=text)


def answer(
    glm: Glm,
    ids: Sequence[int],
    *,
    opts: ChatOptions | None = None,
    prompt: Sequence[int] | None = None,
    eos: bool = True,
) -> Answer:
    """The answer for `ids` (ending on `<|observation|>` unless `eos=False`: cut by max_tokens),
    asserting it is the same in every chunking and non-streamed."""
    opts = opts or options()
    prompt_ids = glm.prompt() if prompt is None else prompt
    ids = [*ids, glm.observation] if eos else list(ids)
    finish = {"finish_reason": "stop", "stop_reason": glm.observation} if eos else {"finish_reason": "length"}
    reference = comparable_response(whole(glm.vocab, opts, ids, prompt_ids=prompt_ids, **finish))
    tokens = set()
    for sizes in CHUNKINGS:
        run = stream(glm.vocab, opts, ids, sizes, prompt_ids=prompt_ids, **finish)
        folded = run.folded
        assert folded.as_comparable() == reference
        headers = [d for delta in folded.deltas for d in delta.get("tool_calls", []) if "id" in d]
        assert [h["index"] for h in headers] == list(range(len(reference["tool_calls"])))
        tokens.add(folded.usage.completion_tokens_details.reasoning_tokens)
    assert len(tokens) == 1
    calls = reference["tool_calls"]
    return Answer(
        content=reference["content"],
        reasoning=reference["reasoning"],
        calls=[(c["name"], json.loads(c["arguments"])) for c in calls],
        finish_reason=reference["finish_reason"],
        raw_arguments=[c["arguments"] for c in calls],
        reasoning_tokens=tokens.pop(),
    )


# -- well-formed output -----------------------------------------------------------


def test_glm47_call_after_reasoning_with_typed_values(glm: Glm) -> None:
    text = "The user wants weather.\n</think>" + call(
        "get_weather",
        ("city", "Paris"),
        ("days", "3"),
        ("temp", "-2.5"),
        ("metric", "True"),
        ("opts", '{"wind": [1, 2], "x": null}'),
        ("tags", '["a", "b"]'),
        ("maybe", "null"),
        ("unit", "c"),
        ("level", "7"),
    )
    got = answer(glm, glm.enc(text))
    assert got.reasoning == "The user wants weather."  # trailing whitespace dropped, as vLLM strips it
    assert got.content is None
    assert got.finish_reason == "tool_calls"
    assert got.calls == [
        (
            "get_weather",
            {
                "city": "Paris",
                "days": 3,
                "temp": -2.5,
                "metric": True,
                "opts": {"wind": [1, 2], "x": None},
                "tags": ["a", "b"],
                "maybe": None,
                "unit": "c",
                "level": 7,
            },
        )
    ]
    assert got.raw_arguments[0].startswith('{"city": "Paris", "days": 3, "temp": -2.5, "metric": true, ')
    assert got.reasoning_tokens == len(glm.enc("The user wants weather.\n"))


def test_glm45_newline_format_with_model_opened_think(glm: Glm) -> None:
    text = "\n<think>Two cities.</think>\n" + call("get_weather", ("city", "Paris"), newlines=True) + "\n"
    text += call("get_weather", ("city", "Rome"), ("days", "2"), newlines=True)
    got = answer(glm, glm.enc(text), opts=options(parser="glm45"), prompt=glm.prompt(model_opens_think=True))
    assert got.reasoning == "\nTwo cities."  # the model's newline before <think> is reasoning, as in vLLM
    assert got.content is None
    assert got.calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]


def test_call_inside_reasoning_ends_it(glm: Glm) -> None:
    got = answer(glm, glm.enc("I will call " + call("get_time", ("tz", "UTC"))))
    assert got.reasoning == "I will call"
    assert got.content is None
    assert got.calls == [("get_time", {"tz": "UTC"})]


def test_parallel_calls_and_parameterless_ones(glm: Glm) -> None:
    text = "r</think>" + call("get_time", ("tz", "UTC")) + call("ping") + call("get_time", ("tz", "CET"))
    got = answer(glm, glm.enc(text))
    assert got.calls == [("get_time", {"tz": "UTC"}), ("ping", {}), ("get_time", {"tz": "CET"})]
    assert got.raw_arguments[1] == "{}"


def test_multiline_non_ascii_values_are_raw(glm: Glm) -> None:
    code = 'def f(a, b):\n    return a < b and "</p>" != \'\\\\\' <arg_key>\n\n'
    text = "r</think>" + call("get_weather", ("city", " Zürich 世界 🫠𓀀 "), ("note", code))
    got = answer(glm, glm.enc(text))
    # Values are written as they are (no trimming); only `</arg_value>` ends one.
    assert got.calls == [("get_weather", {"city": " Zürich 世界 🫠𓀀 ", "note": code})]
    assert "\\u" not in got.raw_arguments[0]


def test_untyped_values_stay_strings(glm: Glm) -> None:
    # A key the schema does not list, and a tool without parameters: strings, as vLLM keeps them.
    text = "r</think>" + call("get_weather", ("zzz", "1"), ("days", "abc")) + call("ping", ("extra", "5"))
    got = answer(glm, glm.enc(text))
    assert got.calls == [("get_weather", {"zzz": "1", "days": "abc"}), ("ping", {"extra": "5"})]


def test_content_whitespace_as_vllm_full_answer_where_streaming_allows(glm: Glm) -> None:
    before = answer(glm, glm.enc("r</think>Sure.\n\n" + call("ping") + "\n"))
    assert before.content == "Sure."  # vLLM strips content once calls were made
    text = "r</think>\n" + call("ping") + "\n\nDone.\n"
    after = answer(glm, glm.enc(text))
    assert after.content == "Done."  # text after the last call is kept (vLLM's full answer drops it)
    around = answer(glm, glm.enc("r</think>\nA.\n" + call("ping") + "\nB.\n"))
    # Leading whitespace of content that began before any call has gone out already.
    assert around.content == "\nA.\n\nB."
    no_call = answer(glm, glm.enc("r</think>\nHello.\n\n"))
    assert no_call.content == "\nHello.\n\n"
    only_space = answer(glm, glm.enc("r</think>\n\n" + call("ping") + "\n"))
    assert only_space.content is None


def test_reasoning_whitespace_and_think_again_after_content(glm: Glm) -> None:
    got = answer(glm, glm.enc("  first \n</think>a</think>b<think> second\n</think>c"))
    # A duplicate </think> is dropped; a <think> outside a call opens reasoning again (vLLM).
    assert got.reasoning == "  first \n second"  # whitespace between blocks kept, as vLLM's full answer
    assert got.content == "abc"
    assert got.reasoning_tokens == len(glm.enc("  first \n")) + len(glm.enc(" second\n"))
    in_call = answer(glm, glm.enc("r</think>" + call("get_time", ("tz", "<think>x</think>"))))
    assert in_call.calls == [("get_time", {"tz": "<think>x</think>"})]


def test_thinking_disabled_keeps_think_markers_as_text(glm: Glm) -> None:
    opts = options(request(chat_template_kwargs={"enable_thinking": False}))
    got = answer(glm, glm.enc("Hello.<think>x</think>y\n" + call("ping")), opts=opts, prompt=glm.prompt(thinking=False))
    assert got.reasoning is None
    assert got.content == "Hello.<think>x</think>y"
    assert got.calls == [("ping", {})]
    assert got.reasoning_tokens == 0


# -- cut short ----------------------------------------------------------------------


def test_max_tokens_mid_value_closes_it(glm: Glm) -> None:
    text = "r</think>Let me see." + call("get_weather", ("city", "Paris"), ("note", "a long note"))
    head = text[: text.index("long")]
    cut = glm.enc(head, text[len(head) :])[: len(glm.enc(head))]
    got = answer(glm, cut, eos=False)
    assert got.finish_reason == "length"
    assert got.content == "Let me see."
    assert got.calls == [("get_weather", {"city": "Paris", "note": "a "})]
    typed_text = "r</think>" + call("get_weather", ("days", "12"))[: -len("</arg_value></tool_call>")]
    typed = answer(glm, glm.enc(typed_text), eos=False)
    assert typed.calls == [("get_weather", {"days": 12})]
    in_name = answer(glm, glm.enc("r</think><tool_call>get_ti"), eos=False)
    assert in_name.calls == [] and in_name.content == "<tool_call>get_ti"  # not an offered tool: content
    in_key = answer(glm, glm.enc("r</think><tool_call>get_time<arg_key>t"), eos=False)
    assert in_key.calls == [("get_time", {})]


def test_partial_tag_at_the_cut_is_value_text(glm: Glm) -> None:
    got = answer(glm, glm.enc("r</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_va"), eos=False)
    assert got.calls == [("get_time", {"tz": "UTC</arg_va"})]


def test_stop_string_inside_a_call(glm: Glm) -> None:
    text = "r</think>" + call("get_weather", ("city", "Lyon"), ("days", "3"))
    got = answer(glm, glm.enc(text), opts=options(stop=("Lyon",)))
    # onehop: `stop`, not `tool_calls`, when a stop string cut the call short (docs/derender.md).
    assert got.finish_reason == "stop"
    assert got.calls == [("get_weather", {"city": ""})]


# -- bad output ----------------------------------------------------------------------


def test_unknown_function_and_nameless_call_are_content(glm: Glm) -> None:
    raw = call("unknown_fn", ("x", "1"))
    got = answer(glm, glm.enc("r</think>" + raw + "done"))
    assert got.calls == [] and got.finish_reason == "stop"
    assert got.content == raw + "done"
    nameless = answer(glm, glm.enc("r</think><tool_call></tool_call>x"))
    assert nameless.content == "<tool_call></tool_call>x"


def test_unclosed_tags(glm: Glm) -> None:
    no_value_end = answer(
        glm, glm.enc("r</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</tool_call>after")
    )
    assert no_value_end.calls == [("get_time", {"tz": "UTC"})]
    assert no_value_end.content == "after"
    no_call_end = answer(glm, glm.enc("r</think>" + call("get_time", ("tz", "UTC"))[: -len("</tool_call>")]))
    assert no_call_end.calls == [("get_time", {"tz": "UTC"})]
    no_value = answer(glm, glm.enc("r</think><tool_call>get_time<arg_key>tz</arg_key></tool_call>"))
    assert no_value.calls == [("get_time", {})]
    # A new <tool_call> inside an open call closes it (vLLM merges both into the first call).
    nested = answer(glm, glm.enc("r</think><tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC" + call("ping")))
    assert nested.calls == [("get_time", {"tz": "UTC"}), ("ping", {})]


def test_invalid_json_for_typed_values_stays_text(glm: Glm) -> None:
    text = "r</think>" + call("get_weather", ("opts", "not json"), ("tags", "[1,"), ("days", "1.0"), ("temp", "nan"))
    got = answer(glm, glm.enc(text))
    assert got.calls == [("get_weather", {"opts": "not json", "tags": "[1,", "days": 1.0, "temp": "nan"})]


def test_junk_between_pairs_is_dropped_and_a_key_runs_to_its_value(glm: Glm) -> None:
    text = "r</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a</arg_value>\njunk\n"
    text += "<arg_key>x</arg_key>y<arg_key>note</arg_key> <arg_value>b</arg_value></tool_call>"
    got = answer(glm, glm.enc(text))
    # vLLM's lazy pair regex: a key whose </arg_key> is not followed by <arg_value> runs on.
    assert got.calls == [("get_weather", {"city": "a", "x</arg_key>y<arg_key>note": "b"})]


def test_key_given_twice_parses_to_the_last_value(glm: Glm) -> None:
    got = answer(glm, glm.enc("r</think>" + call("get_time", ("tz", "a"), ("tz", "b"))))
    assert got.calls == [("get_time", {"tz": "b"})]


def test_marker_text_split_across_tokens(glm: Glm) -> None:
    split_start = answer(glm, glm.enc("r</think>Say <", "tool", "_call>get_time</tool_call>"))
    # Not the <tool_call> token: text, as in vLLM's stream.
    assert split_start.calls == [] and split_start.content == "Say <tool_call>get_time</tool_call>"
    parts: tuple[str, ...] = ("r</think><tool_call>get_time<", "arg", "_key>tz</", "arg_key><arg", "_value>UTC</arg_val")
    parts += ("ue></tool_call>",)
    split_tags = answer(glm, glm.enc(*parts))
    assert split_tags.calls == [("get_time", {"tz": "UTC"})]  # arg tags are read from text
    split_end = answer(glm, glm.enc("r</think>" + call("get_time", ("tz", "UTC"))[: -len("tool_call>")], "tool_call>"))
    assert split_end.calls == [("get_time", {"tz": "UTC"})]
    split_think = answer(glm, glm.enc("r</", "think>x"))
    assert split_think.reasoning == "r</think>x" and split_think.content is None


def test_parallel_tool_calls_false_keeps_the_first(glm: Glm) -> None:
    text = "r</think>" + call("get_time", ("tz", "UTC")) + "\n" + call("ping")
    got = answer(glm, glm.enc(text), opts=options(request(parallel_tool_calls=False)))
    assert got.calls == [("get_time", {"tz": "UTC"})]
    assert got.content is None


def test_tools_not_offered_or_none_means_no_tool_parsing(glm: Glm) -> None:
    raw = call("get_time", ("tz", "UTC"))
    for req in (request(tools=None), request(tool_choice="none")):
        got = answer(glm, glm.enc("r</think>ok" + raw), opts=options(req))
        assert got.calls == [] and got.content == "ok" + raw and got.finish_reason == "stop"


# -- writers -------------------------------------------------------------------------


def test_format_calls_round_trip(glm: Glm) -> None:
    calls = [ToolCallText("get_weather", {"city": "Zürich", "days": 3, "opts": {"a": [1]}}), ToolCallText("ping", {})]
    assert format_calls_47(calls) == (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value>"
        '<arg_key>opts</arg_key><arg_value>{"a": [1]}</arg_value></tool_call><tool_call>ping</tool_call>'
    )
    assert format_calls_45(calls[1:]) == "<tool_call>ping\n</tool_call>"
    for parser, writer in (("glm47", format_calls_47), ("glm45", format_calls_45)):
        got = answer(glm, glm.enc("r</think>" + writer(calls)), opts=options(parser=parser))
        assert got.calls == [(c.name, dict(c.arguments)) for c in calls]
    assert TOOL_PARSERS["glm45"].format_calls is format_calls_45
    reasoning = REASONING_PARSERS["glm47"].format_reasoning
    assert reasoning is not None and reasoning("x") == "x</think>"


@pytest.mark.parametrize("parser", ["glm45", "glm47"])
def test_forced_tool_choice(glm: Glm, parser: str) -> None:
    assert forced_prefix_47("get_time") == "<tool_call>get_time" and forced_prefix_45(None) == "<tool_call>"
    named = options(request(tool_choice={"type": "function", "function": {"name": "get_time"}}), parser=parser)
    got = answer(glm, glm.enc("<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"), opts=named)
    assert got.reasoning is None and got.calls == [("get_time", {"tz": "UTC"})]
    required = options(request(tool_choice="required"), parser=parser)
    got = answer(glm, glm.enc("ping</tool_call>"), opts=required)
    assert got.calls == [("ping", {})]


def test_include_reasoning_false_still_parses_calls(glm: Glm) -> None:
    opts = replace(options(), include_reasoning=False)
    got = answer(glm, glm.enc("hidden</think>" + call("ping")), opts=opts)
    assert got.reasoning is None and got.calls == [("ping", {})]


# -- routes and streaming ---------------------------------------------------------------


def test_text_route_gives_the_token_route_answer(glm: Glm) -> None:
    """An engine in `text` mode sends text without ids: the markers are found by their
    strings (the arg tags as well), and the answer is the token route's."""
    text = "Plan.\n</think>Sure.\n" + call("get_weather", ("city", "Zürich 世界"), ("days", "3")) + call("ping")
    expected = answer(glm, glm.enc(text))
    prompt = glm.prompt()
    for width in (1, 3, 7, 40):
        derender = ChatDerender(glm.vocab, options(), model="m", prompt_token_ids=prompt)
        pieces = [text[i : i + width] for i in range(0, len(text), width)]
        for i, piece in enumerate(pieces):
            derender.step_text(0, piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        got = comparable_response(derender.response())
        assert (got["content"], got["reasoning"], got["finish_reason"]) == (
            expected.content,
            expected.reasoning,
            "tool_calls",
        )
        assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == expected.calls


def test_string_values_stream_before_they_close(glm: Glm) -> None:
    words = " ".join(f"w{k}" for k in range(40))
    ids = glm.enc("r</think>" + call("get_time", ("tz", words)))
    derender = ChatDerender(glm.vocab, options(), model="m", prompt_token_ids=glm.prompt())
    fragments = []
    for token_id in ids:
        chunk = derender.step(0, [token_id])
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk is not None else []:
            if isinstance(tc.function, DeltaFunctionCall) and tc.function.arguments:
                fragments.append(tc.function.arguments)
    # One fragment per few tokens of the value, not one at its end.
    assert len(fragments) > 20
    assert "".join(fragments) == json.dumps({"tz": words})
