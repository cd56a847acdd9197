"""Local render: the per-turn token cache gives exactly the ids of tokenizing the whole prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.openai_schema import ChatCompletionRequest
from gateway.render import LocalRenderer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CASES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "Be terse. 世界"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]},
    {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS},
    {
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        ],
        "tools": TOOLS,
    },
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "part two"}]}]},
]


@pytest.fixture(scope="module")
def renderer(qwen3_tokenizer_dir: Path) -> LocalRenderer:
    return LocalRenderer(qwen3_tokenizer_dir)


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_render_equals_the_chat_template(renderer: LocalRenderer, qwen3_tokenizer: Any, case: dict[str, Any]) -> None:
    request = msgspec.convert(case, ChatCompletionRequest)
    expected = qwen3_tokenizer.apply_chat_template(
        case["messages"], tools=case.get("tools"), add_generation_prompt=True, tokenize=True, **case.get("chat_template_kwargs", {})
    )["input_ids"]
    assert renderer.chat_sync(request) == list(expected)
    assert renderer.chat_sync(request) == list(expected)  # the second time from the segment cache


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<|im_start|>", "user\n", " héllo", "🫠", "\n\n", "<|im_end|>", "<think>", "a\u0301", "  "]), max_size=20))
def test_segmented_encode_equals_whole_encode(renderer: LocalRenderer, parts: list[str]) -> None:
    text = "".join(parts)
    assert renderer.encode(text) == list(renderer.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
