"""gpt-oss Harmony parsing (`openai_gptoss` reasoning, `openai` tools) through the chat derender.

Every vector is fed in chunks of 1..8 tokens and in six random splits; the
folded stream must equal the non-streamed `response()` for every chunking
(DERENDER_CASES' master test), and that answer must be the expected one. The
expected answers are vLLM 0.32's (`parser/harmony.py` over
`openai_harmony.StreamableParser`), checked against the real parser in
`tests/vllm/parity_cases/harmony.py`, except the named deviations listed
there. The tokenizer is the offline Qwen3 BPE with Harmony's seven markers
added as specials; how it differs from gpt-oss's is written in
`tests.support.harmony_tokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from derender.chat import ChatOptions
from derender.parsers import harmony
from derender.parsers.base import ToolCallText
from derender.parsers.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START, Header, HeaderError
from derender.text import TextParams
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from tests.support.harmony_tokenizer import harmony_tokenizer
from tests.support.parity import Split, encode
from tests.support.streams import FAMILY_CHUNKINGS, chunked_answer, comparable_response, counter_ids, stream
from tests.support.tools import WEATHER_TOOLS

TOOLS = WEATHER_TOOLS
USER = [{"role": "user", "content": "Weather in Paris?"}]
CHUNKINGS = FAMILY_CHUNKINGS
NEXT = f"{START}assistant"
PARIS = {"city": "Paris", "days": 2}
UTC = {"tz": "UTC"}


def analysis(text: str) -> str:
    return f"{CHANNEL}analysis{MESSAGE}{text}{END}"


def final(text: str, end: str = RETURN) -> str:
    return f"{CHANNEL}final{MESSAGE}{text}{end}"


def preamble(text: str) -> str:
    return f"{CHANNEL}commentary{MESSAGE}{text}{END}"


def call(name: str, arguments: Any, *, end: str = CALL, indent: int | None = None) -> str:
    body = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, indent=indent)
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{body}{end}"


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(harmony_tokenizer(qwen3_tokenizer_dir.parent))


@pytest.fixture(scope="module")
def vocab(tokenizer: Any) -> TokenVocab:
    return vocab_for(tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer: Any) -> Callable[..., list[int]]:
    return lambda *segments: encode(tokenizer, segments)


@pytest.fixture(scope="module")
def ids_of(tokenizer: Any) -> Callable[[str], int]:
    return lambda token: int(tokenizer.convert_tokens_to_ids(token))


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert text.endswith(NEXT)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_options(
    *,
    tools: list[Any] | None = TOOLS,
    reasoning: str | None = "openai_gptoss",
    tool: str | None = "openai",
    **request: Any,
) -> ChatOptions:
    stop = request.pop("stop", None)
    skip = request.pop("skip_special_tokens", True)
    body: dict[str, Any] = {"model": "m", "messages": USER, **request}
    if tools:
        body["tools"] = tools
    parsed = msgspec.convert(body, ChatCompletionRequest)
    options = ChatOptions.from_request(parsed, reasoning_parser=reasoning, tool_parser=tool)
    return replace(options, text=TextParams(stop=tuple(stop or ()), skip_special_tokens=skip))


def _json_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class Vector:
    output: tuple[str | Split, ...]
    reasoning: str | None = None
    content: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    """(name, arguments parsed as JSON, or the raw text where they are not JSON)."""
    finish: str = "tool_calls"
    end: str | None = CALL
    """The stop token that ended the output (dropped from text as EOS is), None: cut by max_tokens."""
    request: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = field(default_factory=lambda: TOOLS)
    reasoning_parser: str | None = "openai_gptoss"
    tool_parser: str | None = "openai"


WEATHER = call("get_weather", PARIS, end="")
CLOCK = call("get_time", UTC, end="")
NON_ASCII = {"city": "Zürich 世界 🫠", "note": 'Zeile 1\nZeile 2\t"q"'}

VECTORS: dict[str, Vector] = {
    "reasoning_then_final": Vector(
        (analysis("Think 世界 🫠."), NEXT, final("Hello 🫠.", "")),
        reasoning="Think 世界 🫠.",
        content="Hello 🫠.",
        finish="stop",
        end=RETURN,
    ),
    "call_right_after_reasoning": Vector(
        (analysis("Look it up."), NEXT, WEATHER), reasoning="Look it up.", calls=[("get_weather", PARIS)]
    ),
    "call_on_the_analysis_channel": Vector(
        (analysis("R."), NEXT, f"{CHANNEL}analysis to=functions.get_time {CONSTRAIN}json{MESSAGE}{json.dumps(UTC)}"),
        reasoning="R.",
        calls=[("get_time", UTC)],
    ),
    "recipient_before_channel": Vector(
        (analysis("R."), NEXT, f" to=functions.get_time{CHANNEL}commentary json{MESSAGE}{json.dumps(UTC)}"),
        reasoning="R.",
        calls=[("get_time", UTC)],
    ),
    "bare_recipient_is_a_function": Vector(
        (f"{CHANNEL}commentary to=get_time{MESSAGE}{json.dumps(UTC)}",), calls=[("get_time", UTC)]
    ),
    "preamble_then_call": Vector(
        (analysis("R."), NEXT, preamble("Let me check."), NEXT, WEATHER),
        reasoning="R.",
        content="Let me check.",
        calls=[("get_weather", PARIS)],
    ),
    "parallel_calls": Vector(
        (analysis("Two."), NEXT, call("get_weather", PARIS), NEXT, CLOCK),
        reasoning="Two.",
        calls=[("get_weather", PARIS), ("get_time", UTC)],
    ),
    "multiline_non_ascii_arguments": Vector(
        (analysis("R."), NEXT, call("get_weather", NON_ASCII, indent=2, end="")),
        reasoning="R.",
        calls=[("get_weather", NON_ASCII)],
    ),
    "values_keep_the_models_json_types": Vector(
        (call("get_weather", '{"city": 75001, "days": "3"}', end=""),),
        calls=[("get_weather", {"city": 75001, "days": "3"})],
    ),
    "parameter_not_in_schema": Vector(
        (call("get_weather", {"city": "Oslo", "zoom": 2}, end=""),),
        calls=[("get_weather", {"city": "Oslo", "zoom": 2})],
    ),
    "unknown_function": Vector((call("launch", {"speed": 3}, end=""),), calls=[("launch", {"speed": 3})]),
    "invalid_json": Vector((call("get_time", "{tz: UTC", end=""),), calls=[("get_time", "{tz: UTC")]),
    "closed_call_without_arguments": Vector((call("get_time", "", end=""),), calls=[("get_time", {})]),
    "max_tokens_mid_call": Vector(
        (analysis("R."), NEXT, call("get_weather", '{"city": "Par', end="")),
        reasoning="R.",
        calls=[("get_weather", {"city": "Par"})],  # closed to valid JSON (issue #27)
        finish="length",
        end=None,
    ),
    "max_tokens_mid_reasoning": Vector(
        (f"{CHANNEL}analysis{MESSAGE}Still thinking",), reasoning="Still thinking", finish="length", end=None
    ),
    "max_tokens_mid_header": Vector(
        (analysis("R."), NEXT, f"{CHANNEL}commentary to=functions.get_wea"), reasoning="R.", finish="length", end=None
    ),
    "final_after_call": Vector(
        (analysis("R."), NEXT, call("get_time", UTC), NEXT, final("I will report back.", "")),
        reasoning="R.",
        content="I will report back.",
        calls=[("get_time", UTC)],
        end=RETURN,
    ),
    "text_outside_messages_is_dropped": Vector(
        (call("get_time", UTC), "\nstray text ", NEXT, final("Done.", "")),
        content="Done.",
        calls=[("get_time", UTC)],
        end=RETURN,
    ),
    "messages_of_a_kind_join_with_newline": Vector(
        (analysis("A."), NEXT, analysis("B."), NEXT, preamble("One."), NEXT, final("Two.", "")),
        reasoning="A.\nB.",
        content="One.\nTwo.",
        finish="stop",
        end=RETURN,
    ),
    "empty_message_adds_no_newline": Vector(
        (preamble(""), NEXT, final("Only.", "")), content="Only.", finish="stop", end=RETURN
    ),
    "markers_inside_content_are_text": Vector(
        (final(f"a{START}b{CHANNEL}c{CONSTRAIN}d", ""),),
        content=f"a{START}b{CHANNEL}c{CONSTRAIN}d",
        finish="stop",
        end=RETURN,
    ),
    "marker_text_split_across_tokens": Vector(
        (f"{CHANNEL}final{MESSAGE}", Split(f"x{END}y{START}")), content=f"x{END}y{START}", finish="stop", end=RETURN
    ),
    "header_markers_split_across_tokens": Vector(
        (Split(f"{CHANNEL}final{MESSAGE}Hi"),), content=f"{CHANNEL}final{MESSAGE}Hi", finish="stop", end=RETURN
    ),
    "output_without_harmony": Vector(
        ("Just text, no header.",), content="Just text, no header.", finish="stop", end=RETURN
    ),
    "bad_header_drops_its_message": Vector(
        (f"{CHANNEL}final a b c{MESSAGE}lost{END}", NEXT, final("Kept.", "")),
        content="Kept.",
        finish="stop",
        end=RETURN,
    ),
    "builtin_tool_and_unknown_channel_are_dropped": Vector(
        (
            f"{CHANNEL}commentary to=python code{MESSAGE}print(1){END}",
            NEXT,
            f"{CHANNEL}weird{MESSAGE}hmm{END}",
            NEXT,
            final("Ok.", ""),
        ),
        content="Ok.",
        finish="stop",
        end=RETURN,
    ),
    "other_roles_are_dropped": Vector(
        (analysis("R."), f"{START}user{CHANNEL}final{MESSAGE}not me{END}", NEXT, final("Me.", "")),
        reasoning="R.",
        content="Me.",
        finish="stop",
        end=RETURN,
    ),
    "constrain_without_recipient_is_content": Vector(
        (f"{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}{{}}",), content="{}", finish="stop", end=RETURN
    ),
    "stop_string_inside_call": Vector(
        (analysis("R."), NEXT, call("get_weather", {"city": "Lyon", "days": 3}, end="")),
        reasoning="R.",
        calls=[("get_weather", {"city": ""})],
        finish="stop",
        request={"stop": ["Lyon"]},
    ),
    "stop_string_in_final": Vector(
        (analysis("R."), NEXT, final("It is sunny today.", "")),
        reasoning="R.",
        content="It is ",
        finish="stop",
        end=RETURN,
        request={"stop": ["sunny"]},
    ),
    "parallel_tool_calls_false": Vector(
        (call("get_weather", PARIS), NEXT, CLOCK),
        calls=[("get_weather", PARIS)],
        request={"parallel_tool_calls": False},
    ),
    "skip_special_tokens_false": Vector(
        (analysis("R."), NEXT, preamble("P."), NEXT, WEATHER),
        reasoning="R.",
        content="P.",
        calls=[("get_weather", PARIS)],
        request={"skip_special_tokens": False},
    ),
    "tools_not_offered_gives_clean_content": Vector(
        (analysis("R."), NEXT, preamble("Let me check."), NEXT, call("get_time", UTC), NEXT, final("Done.", "")),
        reasoning="R.",
        content="Let me check.\nDone.",
        finish="stop",
        end=RETURN,
        tools=None,
    ),
    "tool_choice_none_gives_clean_content": Vector(
        (analysis("R."), NEXT, WEATHER), reasoning="R.", finish="stop", request={"tool_choice": "none"}
    ),
    "reasoning_only_configuration": Vector(
        (analysis("R."), NEXT, preamble("P."), NEXT, WEATHER),
        reasoning="R.",
        content="P.",
        finish="stop",
        tool_parser=None,
    ),
    "reasoning_only_recovers_free_text": Vector(
        ("No Harmony here.",), content="No Harmony here.", finish="stop", end=RETURN, tool_parser=None
    ),
    "tool_only_configuration_drops_reasoning": Vector(
        (analysis("R."), NEXT, preamble("P."), NEXT, WEATHER),
        content="P.",
        calls=[("get_weather", PARIS)],
        reasoning_parser=None,
    ),
}


def _finish(vector: Vector, ids_of: Callable[[str], int]) -> dict[str, Any]:
    if vector.end is None:
        return {"finish_reason": "stop" if vector.finish != "length" else "length"}
    end_id = ids_of(vector.end)
    return {"finish_reason": "stop", "stop_reason": None if vector.end == RETURN else end_id}


@pytest.mark.parametrize("name", list(VECTORS))
def test_vector_in_every_chunking(name: str, vocab: TokenVocab, enc: Any, ids_of: Any, prompt: list[int]) -> None:
    vector = VECTORS[name]
    ids = enc(*vector.output) + ([ids_of(vector.end)] if vector.end else [])
    options = chat_options(
        tools=vector.tools, reasoning=vector.reasoning_parser, tool=vector.tool_parser, **dict(vector.request)
    )
    finish = _finish(vector, ids_of)
    if "stop" in vector.request:
        finish = {"finish_reason": "length"}  # the stop string ends it, not the engine
    got = chunked_answer(vocab, options, ids, prompt, **finish)
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (vector.reasoning, vector.content, vector.finish)
    assert [(c["name"], _json_or_raw(c["arguments"])) for c in got["tool_calls"]] == vector.calls
    assert all(c["id"].startswith("chatcmpl-tool-") for c in got["tool_calls"])


def test_reasoning_tokens_count_analysis_and_call_arguments(
    vocab: TokenVocab, enc: Any, ids_of: Any, prompt: list[int]
) -> None:
    """vLLM's count: non-special tokens of analysis content and of commentary to a recipient."""
    options = chat_options()
    output = [*enc(analysis("Think it over."), NEXT, preamble("P."), NEXT, WEATHER), ids_of(CALL)]
    expected = len(enc("Think it over.")) + len(enc(json.dumps(PARIS)))
    for sizes in CHUNKINGS[:3]:
        run = stream(vocab, options, output, sizes, prompt_ids=prompt, finish_reason="stop", stop_reason=ids_of(CALL))
        assert run.folded.usage.completion_tokens_details.reasoning_tokens == expected


def test_forced_named_call_is_primed(vocab: TokenVocab, enc: Any, ids_of: Any, prompt: list[int]) -> None:
    options = chat_options(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert options.forced_prefix == f"{CHANNEL}commentary to=functions.get_time {CONSTRAIN}json{MESSAGE}"
    got = chunked_answer(
        vocab, options, [*enc(json.dumps(UTC)), ids_of(CALL)], prompt, finish_reason="stop", stop_reason=ids_of(CALL)
    )
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [("get_time", UTC)]
    assert got["content"] is None and got["reasoning"] is None


def test_forced_required_call_names_itself(vocab: TokenVocab, enc: Any, ids_of: Any, prompt: list[int]) -> None:
    options = chat_options(tool_choice="required")
    assert options.forced_prefix == f"{CHANNEL}commentary to=functions."
    output = [*enc(f"get_weather {CONSTRAIN}json{MESSAGE}{json.dumps(PARIS)}"), ids_of(CALL)]
    got = chunked_answer(vocab, options, output, prompt, finish_reason="stop", stop_reason=ids_of(CALL))
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [("get_weather", PARIS)]


def test_format_calls_reads_back(vocab: TokenVocab, enc: Any, ids_of: Any, prompt: list[int]) -> None:
    calls = [ToolCallText("get_weather", NON_ASCII), ToolCallText("get_time", {})]
    text = harmony.format_reasoning("Plan.") + harmony.format_calls(calls)
    assert text.count(CALL) == 2 and f"{CALL}{NEXT}{CHANNEL}" in text
    got = chunked_answer(
        vocab,
        chat_options(),
        [*enc(text[:-len(CALL)]), ids_of(CALL)],
        prompt,
        finish_reason="stop",
        stop_reason=ids_of(CALL),
    )
    assert got["reasoning"] == "Plan."
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        ("get_weather", NON_ASCII),
        ("get_time", {}),
    ]


def test_registered_under_vllm_names() -> None:
    from derender.parsers import REASONING_PARSERS, TOOL_PARSERS

    assert REASONING_PARSERS["openai_gptoss"] is harmony.REASONING
    assert TOOL_PARSERS["openai"] is harmony.TOOLS


# -- the header grammar -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "role", "expected"),
    [
        (f"{CHANNEL}analysis", "assistant", Header("assistant", "analysis", None, None)),
        (
            f"{CHANNEL}commentary to=functions.f {CONSTRAIN}json",
            "assistant",
            Header("assistant", "commentary", "functions.f", f"{CONSTRAIN}json"),
        ),
        (
            f" to=functions.f{CHANNEL}commentary json",
            "assistant",
            Header("assistant", "commentary", "functions.f", "json"),
        ),
        # With the role not opened, a first word that is no role but addresses someone makes a tool author.
        (f" to=functions.f{CHANNEL}commentary json", None, Header("tool", "commentary", "json", None)),
        (
            f"assistant to=functions.f{CHANNEL}commentary json",
            None,
            Header("assistant", "commentary", "functions.f", "json"),
        ),
        (
            f"assistant{CHANNEL}commentary to=f{CONSTRAIN}json",
            None,
            Header("assistant", "commentary", "f", f"{CONSTRAIN}json"),
        ),
        (f"{CHANNEL}commentary {CONSTRAIN}json", "assistant", Header("assistant", "commentary", None, None)),
        ("functions.get to=assistant" + f"{CHANNEL}commentary", None, Header("tool", "commentary", "assistant", None)),
        (f"{CHANNEL}final", None, None),
        (f"{CHANNEL}final a b c", "assistant", None),
        (f"{CHANNEL} final", "assistant", None),
    ],
)
def test_parse_header(text: str, role: str | None, expected: Header | None) -> None:
    if expected is None:
        with pytest.raises(HeaderError):
            harmony.parse_header(text, role=role)
    else:
        assert harmony.parse_header(text, role=role) == expected


@pytest.mark.parametrize(
    ("recipient", "name"),
    [
        ("functions.get_weather", "get_weather"),
        ("get_weather", "get_weather"),
        ("functions.", None),
        ("python", None),
        ("browser.search", None),
        ("assistant", None),
        ("<|x|>", None),
        (None, None),
    ],
)
def test_function_name(recipient: str | None, name: str | None) -> None:
    assert harmony.function_name(recipient) == name


def test_text_route_finds_markers_in_text(vocab: TokenVocab, enc: Any, ids_of: Any, prompt: list[int]) -> None:
    """An engine in `text` mode with `skip_special_tokens=false` sends marker text: the same answer."""
    from derender.chat import ChatDerender

    options = chat_options(skip_special_tokens=False)
    output = enc(analysis("R."), NEXT, preamble("P."), NEXT, WEATHER)
    finish = {"finish_reason": "stop", "stop_reason": ids_of(CALL)}
    expected = chunked_answer(vocab, options, [*output, ids_of(CALL)], prompt, **finish)
    text = vocab.backend.decode(output, skip_special_tokens=False)
    derender = ChatDerender(vocab, options, model="m", prompt_token_ids=prompt, new_tool_call_id=counter_ids())
    for at in range(0, len(text), 7):
        last = at + 7 >= len(text)
        derender.step_text(
            0, text[at : at + 7], finish_reason="stop" if last else None, stop_reason=ids_of(CALL) if last else None
        )
    got = comparable_response(derender.response())
    assert {**got, "logprobs": []} == {**expected, "logprobs": []}
    assert got["reasoning"] == "R." and got["content"] == "P." and got["finish_reason"] == "tool_calls"
