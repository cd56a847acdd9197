"""Local render: the per-turn token cache gives exactly the ids of tokenizing the whole prompt."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.openai_schema import ChatCompletionRequest
from gateway.render.local import LocalRenderer
from gateway.render.turn_cache import digest
from gateway.render.token_ids import TokenIds
from tests.support.token_ids import id_list
from tests.support.waiting import wait_until

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
    assert id_list(renderer.chat_sync(request)) == list(expected)
    assert id_list(renderer.chat_sync(request)) == list(expected)  # the second time from the segment cache


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<|im_start|>", "user\n", " héllo", "🫠", "\n\n", "<|im_end|>", "<think>", "a\u0301", "  "]), max_size=20))
def test_segmented_encode_equals_whole_encode(renderer: LocalRenderer, parts: list[str]) -> None:
    text = "".join(parts)
    assert id_list(renderer.encode_sync(text)) == list(renderer.tokenizer.encode(text, add_special_tokens=False).ids)


class SignallingRenderer(LocalRenderer):
    """The real renderer, saying when its tokenization of a long text begins and ends (on a worker thread)."""

    def __init__(self, tokenizer_dir: Path, **options: Any) -> None:
        super().__init__(tokenizer_dir, **options)
        self.tokenizing_long = threading.Event()
        self.tokenized_long = threading.Event()

    def _encode_many(self, segments: list[str]) -> list[TokenIds]:
        if max(map(len, segments)) <= LONG_CHARS:
            return super()._encode_many(segments)
        self.tokenizing_long.set()
        try:
            return super()._encode_many(segments)
        finally:
            self.tokenized_long.set()


LONG_CHARS = 100_000
SMALL_RENDERS = 200
"""Small renders served one after another while the huge one is tokenized. Measured: over 2,000 fit
in its tokenizer call; with a tokenizer that held the GIL (which stops this loop for the whole
call), at most 36 fit in the moments after it, before it was over."""


async def test_a_huge_render_does_not_hold_up_small_ones(qwen3_tokenizer_dir: Path) -> None:
    """Renders run several at once, and long text is tokenized with the GIL released: small
    requests sent while a multi-megabyte one is in the tokenizer are all done before it is."""
    renderer = SignallingRenderer(qwen3_tokenizer_dir, workers=2)
    try:
        huge = msgspec.convert({"messages": [{"role": "user", "content": "many words here. " * 100_000}]}, ChatCompletionRequest)
        smalls = [msgspec.convert({"messages": [{"role": "user", "content": f"hi {i}"}]}, ChatCompletionRequest) for i in range(SMALL_RENDERS)]
        big = asyncio.ensure_future(renderer.chat(huge))
        await wait_until(renderer.tokenizing_long.is_set, what="the huge render is in the tokenizer")
        ids = [id_list(await renderer.chat(small)) for small in smalls]
        assert not renderer.tokenized_long.is_set(), "the small renders waited for the huge one's tokenizer"
        assert len(await big) > 200_000 and ids == [id_list(renderer.chat_sync(small)) for small in smalls]
    finally:
        renderer.close()


async def test_the_forced_tool_prefix_is_encoded_with_the_render(renderer: LocalRenderer) -> None:
    request = msgspec.convert(CASES[2], ChatCompletionRequest)
    suffix = "<tool_call>\n"
    ids = id_list(await renderer.chat(request, suffix=suffix))
    assert ids == id_list(renderer.chat_sync(request)) + id_list(renderer.encode_sync(suffix))


def test_the_turn_cache_is_bounded_in_bytes(qwen3_tokenizer_dir: Path) -> None:
    renderer = LocalRenderer(qwen3_tokenizer_dir, workers=1, cache_bytes=64 * 1024)
    try:
        for i in range(400):
            turn = f"<|im_start|>user\nmessage number {i} " + "words " * 40 + "<|im_end|>\n"
            assert id_list(renderer.encode_sync(turn)) == list(renderer.tokenizer.encode(turn).ids)
            assert renderer.cached_bytes <= 64 * 1024
        assert renderer.cached_bytes > 32 * 1024  # it does cache
        huge = "<|im_start|>user\n" + "word " * 20_000
        renderer.encode_sync(huge)
        assert digest(huge) not in renderer.turn_cache  # over an eighth of the cache: not kept
    finally:
        renderer.close()
