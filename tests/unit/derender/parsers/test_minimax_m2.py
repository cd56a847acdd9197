"""MiniMax M2 reasoning and tool parsing (`minimax_m2` / `minimax_m2`) through the chat derender.

Every vector is fed in each of `FAMILY_CHUNKINGS`; the folded stream must equal
the non-streamed `response()` for every chunking, and that answer must be the
expected one. The tokenizer is the offline Qwen3 BPE with MiniMax's added tokens
(`tests.support.minimax_m2` says what differs from MiniMax's own), so tests
look ids up by token and never hard-code one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.parsers import minimax_m2
from derender.parsers.base import ToolCallText
from derender.parsers.minimax_m2 import END, START
from derender.vocab import TokenVocab, vocab_for
from wire.openai_schema import ChatCompletionRequest
from tests.support.minimax_m2 import EOS, minimax_tokenizer_dir
from tests.support.parity import encode
from tests.support.streams import chunked_answer, comparable_response, fixed, stream

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
                    "note": {"type": "string"},
                    "opts": {"type": "object"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def invoke(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f'<parameter name="{key}">{value}</parameter>\n' for key, value in params)
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return f"{START}\n{''.join(invokes)}{END}"


UTC = invoke("get_time", ("tz", "UTC"))
PARIS = invoke("get_weather", ("city", "Paris"), ("days", "2"))
LAUNCH = invoke("launch", ("speed", "3"))
NOTE = '\nZeile 1\n\t"q" < 2\n'
OPEN_WEATHER = '\n<invoke name="get_weather">\n'


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minimax_tokenizer_dir(qwen3_tokenizer_dir))


@pytest.fixture(scope="module")
def vocab(tokenizer: Any) -> TokenVocab:
    return vocab_for(tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer: Any) -> Callable[..., list[int]]:
    def encoded(*segments: str) -> list[int]:
        return encode(tokenizer, segments)

    return encoded


@pytest.fixture(scope="module")
def eos(tokenizer: Any) -> int:
    return int(tokenizer.convert_tokens_to_ids(EOS))


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_options(
    *, tools: list[Any] | None = TOOLS, reasoning: str | None = "minimax_m2", **request: Any
) -> ChatOptions:
    body: dict[str, Any] = {"model": "m", "messages": USER, **request}
    if tools:
        body["tools"] = tools
    parsed = msgspec.convert(body, ChatCompletionRequest)
    return ChatOptions.from_request(parsed, reasoning_parser=reasoning, tool_parser="minimax_m2")


@dataclass(frozen=True)
class Vector:
    output: tuple[str, ...]
    reasoning: str | None = None
    content: str | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    """(name, arguments parsed as JSON)."""
    finish: str = "tool_calls"
    eos: bool = True
    request: dict[str, Any] = field(default_factory=dict)


VECTORS: dict[str, Vector] = {
    "reasoning_content_call": Vector(
        ("Plan it.\n</think>\n\nLet me check.\n", block(PARIS)),
        reasoning="Plan it.",
        content="\n\nLet me check.",  # the line break before the call is dropped (issue #27)
        calls=[("get_weather", {"city": "Paris", "days": 2})],
    ),
    "call_right_after_reasoning": Vector(
        ("Plan.</think>", block(UTC)), reasoning="Plan.", calls=[("get_time", {"tz": "UTC"})]
    ),
    "call_inside_reasoning_ends_it": Vector(
        ("Straight to it  \n", block(UTC)), reasoning="Straight to it", calls=[("get_time", {"tz": "UTC"})]
    ),
    "parallel_calls": Vector(
        ("Two.</think>\n\n", block(PARIS, UTC)),
        reasoning="Two.",
        calls=[("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})],
    ),
    "multiline_non_ascii_values_verbatim": Vector(
        ("R.</think>", block(invoke("get_weather", ("city", " Zürich 世界 🫠 "), ("note", NOTE)))),
        reasoning="R.",
        calls=[("get_weather", {"city": " Zürich 世界 🫠 ", "note": NOTE})],
    ),
    "schema_typed_values": Vector(
        (
            "R.</think>",
            block(invoke("get_weather", ("city", "75001"), ("days", "3"), ("metric", "True"), ("opts", '{"a": [1]}'))),
        ),
        reasoning="R.",
        calls=[("get_weather", {"city": "75001", "days": 3, "metric": True, "opts": {"a": [1]}})],
    ),
    "parameter_not_in_schema_and_bad_values": Vector(
        ("R.</think>", block(invoke("get_weather", ("days", "seven"), ("zoom", "2"), ("opts", '{"a": 1')))),
        reasoning="R.",
        calls=[("get_weather", {"days": "seven", "zoom": "2", "opts": '{"a": 1'})],
    ),
    "quote_styles": Vector(
        (
            "R.</think>",
            block(
                "<invoke name='get_time'><parameter name='tz'>UTC</parameter></invoke>",
                "<invoke name=get_weather><parameter  name = city >Oslo</parameter></invoke>",
            ),
        ),
        reasoning="R.",
        calls=[("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})],
    ),
    "max_tokens_mid_call": Vector(
        ("R.</think>", START, OPEN_WEATHER, '<parameter name="days">3</parameter>\n<parameter name="city">Par'),
        reasoning="R.",
        calls=[("get_weather", {"days": 3, "city": "Par"})],
        finish="length",
        eos=False,
    ),
    "max_tokens_mid_name": Vector(
        ("R.</think>Hm ", START, '\n<invoke name="get_wea'),
        reasoning="R.",
        content=f'Hm {START}\n<invoke name="get_wea',
        finish="length",
        eos=False,
    ),
    "text_after_last_call": Vector(
        ("R.</think>", block(UTC), "\nChecking now. "),
        reasoning="R.",
        content="\nChecking now.",
        calls=[("get_time", {"tz": "UTC"})],
    ),
    "unclosed_value_and_block": Vector(
        ("R.</think>", START, '\n<invoke name="get_weather">\n<parameter name="city">Paris\n</invoke>\n'),
        reasoning="R.",
        calls=[("get_weather", {"city": "Paris\n"})],
    ),
    "missing_invoke_end": Vector(
        ("R.</think>", START, '\n<invoke name="get_time">\n<parameter name="tz">UTC</parameter>\n', END, "\nAfter."),
        reasoning="R.",
        content="\nAfter.",
        calls=[("get_time", {"tz": "UTC"})],
    ),
    "unknown_function_is_content": Vector(
        ("R.</think>", block(UTC, LAUNCH)),
        reasoning="R.",
        content=LAUNCH.rstrip(),
        calls=[("get_time", {"tz": "UTC"})],
    ),
    "block_without_a_call_is_content": Vector(
        ("R.</think>", block(LAUNCH), " ok"), reasoning="R.", content=block(LAUNCH) + " ok", finish="stop"
    ),
    "markers_split_across_tokens": Vector(
        ("R.</think>", "<minimax:tool", "_call>\n", UTC, "</minimax:tool", "_call>"),
        reasoning="R.",
        content="<minimax:tool_call>\n</minimax:tool_call>",
        calls=[("get_time", {"tz": "UTC"})],
    ),
    "stray_markers_in_content": Vector(
        ("R.</think>A</think>B<think>C", END, "D"), reasoning="R.", content="AB<think>CD", finish="stop"
    ),
    "parallel_tool_calls_false": Vector(
        ("R.</think>", block(PARIS, UTC)),
        reasoning="R.",
        calls=[("get_weather", {"city": "Paris", "days": 2})],
        request={"parallel_tool_calls": False},
    ),
    "tool_choice_none": Vector(
        ("R.</think>Hi ", block(UTC)),
        reasoning="R.",
        content=f"Hi {block(UTC)}",
        finish="stop",
        request={"tool_choice": "none"},
    ),
}


def test_vectors_in_every_chunking(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    """All vectors in one test: the suite's per-test garbage collection costs more than a vector."""
    failures: dict[str, Any] = {}
    for name, vector in VECTORS.items():
        ids = enc(*vector.output) + ([eos] if vector.eos else [])
        finish = "stop" if vector.eos else "length"
        got = chunked_answer(vocab, chat_options(**vector.request), ids, prompt, finish_reason=finish)
        calls = [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]]
        seen = (got["reasoning"], got["content"], got["finish_reason"], calls)
        if seen != (vector.reasoning, vector.content, vector.finish, vector.calls):
            failures[name] = seen
    assert not failures


def test_stop_string_inside_a_call(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    ids = [*enc("R.</think>", block(invoke("get_weather", ("days", "2"), ("city", "Lyon")))), eos]
    got = chunked_answer(vocab, chat_options(stop=["Lyon"]), ids, prompt, finish_reason="stop")
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"days": 2}')]
    # onehop: `stop`, not `tool_calls`, when a stop string cut the call short (chat.py).
    assert (got["content"], got["finish_reason"], got["stop_reason"]) == (None, "stop", "Lyon")


def test_prompt_that_closes_think_starts_in_content(tokenizer: Any, vocab: TokenVocab, enc: Any, eos: int) -> None:
    text = tokenizer.apply_chat_template(
        USER, tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    closed = list(tokenizer.encode(text, add_special_tokens=False))
    got = chunked_answer(vocab, chat_options(), [*enc("Sure. ", block(UTC)), eos], closed, finish_reason="stop")
    assert (got["reasoning"], got["content"], len(got["tool_calls"])) == (None, "Sure.", 1)


def test_append_think_keeps_the_output_whole(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    options = chat_options(reasoning="minimax_m2_append_think")
    got = chunked_answer(vocab, options, [*enc("R.</think>\n\nHi ", block(UTC)), eos], prompt, finish_reason="stop")
    assert (got["reasoning"], got["content"]) == (None, "<think>R.</think>\n\nHi")
    assert [c["arguments"] for c in got["tool_calls"]] == ['{"tz": "UTC"}']


def test_reasoning_tokens_are_the_ids_inside_reasoning(
    vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]
) -> None:
    inner = enc("Two short thoughts.")
    run = stream(vocab, chat_options(), inner + enc("</think>ok") + [eos], fixed(3), prompt_ids=prompt)
    assert run.folded.usage.completion_tokens_details.reasoning_tokens == len(inner)
    unended = stream(vocab, chat_options(), [*inner, eos], prompt_ids=prompt, finish_reason="stop").folded
    assert unended.usage.completion_tokens_details.reasoning_tokens == len(inner)  # the EOS is not reasoning


def test_forced_tool_choice_primes_the_call(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    forced = [
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '<parameter name="city">Oslo</parameter>\n</invoke>\n',
            ("get_weather", {"city": "Oslo"}),
        ),
        ("required", 'get_time">\n<parameter name="tz">UTC</parameter>\n</invoke>\n', ("get_time", {"tz": "UTC"})),
    ]
    for tool_choice, output, expected in forced:
        options = chat_options(tool_choice=tool_choice)
        assert options.forced_prefix is not None and options.forced_prefix.startswith(START)
        ids = [*enc(output, END), eos]
        got = chunked_answer(vocab, options, ids, prompt + enc(options.forced_prefix), finish_reason="stop")
        assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [expected]
        assert (got["reasoning"], got["content"], got["finish_reason"]) == (None, None, "tool_calls")


def test_written_calls_parse_back(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    calls = [
        ToolCallText("get_weather", {"city": "Zürich\nNord", "days": 3, "opts": {"x": [1, None]}}),
        ToolCallText("get_time", {}),
    ]
    text = minimax_m2.format_reasoning("Check both.") + "On it." + minimax_m2.format_calls(calls)
    got = chunked_answer(vocab, chat_options(), [*enc(text), eos], prompt, finish_reason="stop")
    assert (got["reasoning"], got["content"]) == ("Check both.", "\n\nOn it.")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        ("get_weather", {"city": "Zürich\nNord", "days": 3, "opts": {"x": [1, None]}}),
        ("get_time", {}),
    ]


def test_string_values_stream_as_they_arrive(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    """A long string value is visible token by token; nothing is re-joined or held back."""
    words = enc(" word" * 200)
    opening = enc("R.</think>", START, '\n<invoke name="get_weather">\n<parameter name="note">')
    ids = opening + words + enc("</parameter>\n</invoke>\n", END) + [eos]
    derender = ChatDerender(vocab, chat_options(), model="m", prompt_token_ids=prompt)
    for i, token_id in enumerate(ids[:-1]):
        chunk = derender.step(0, [token_id])
        if len(opening) < i < len(opening) + len(words):
            assert chunk is not None


def test_text_route_gives_the_token_route_answer(vocab: TokenVocab, enc: Any, eos: int, prompt: list[int]) -> None:
    """An engine in `text` mode sends text without ids: the markers are found by their strings."""
    text = "Two.</think>\n\n" + block(PARIS, UTC)
    expected = chunked_answer(vocab, chat_options(), [*enc(text), eos], prompt, finish_reason="stop")
    for width in (1, 7, 40):
        derender = ChatDerender(vocab, chat_options(), model="m", prompt_token_ids=prompt)
        pieces = [text[i : i + width] for i in range(0, len(text), width)]
        for i, piece in enumerate(pieces):
            derender.step_text(0, piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        got = comparable_response(derender.response())
        assert (got["reasoning"], got["content"]) == (expected["reasoning"], expected["content"])
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [
            (c["name"], c["arguments"]) for c in expected["tool_calls"]
        ]
