"""Small renders on the event loop: the same ids as a render on the renderer's threads."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from wire.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.flow.inline_render import chat_prompt, completion_prompts
from gateway.render.local import LocalRenderer

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "Be terse. 世界"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]},
    {"messages": [{"role": "user", "content": "x " * 3000}]},
]
COMPLETIONS: list[dict[str, Any]] = [{"prompt": "once upon a time"}, {"prompt": ["one", "two"]}, {"prompt": [1, 2, 3]}]


@pytest.fixture
def renderer(qwen3_tokenizer_dir: Path) -> LocalRenderer:
    return LocalRenderer(qwen3_tokenizer_dir)


@pytest.mark.parametrize("case", CHATS, ids=[str(i) for i in range(len(CHATS))])
def test_inline_chat_render_gives_the_threaded_ids(renderer: LocalRenderer, case: dict[str, Any]) -> None:
    request = msgspec.convert({"model": "m", **case}, ChatCompletionRequest)

    async def both() -> tuple[list[int], list[int]]:
        inline = await chat_prompt(renderer, request, "<tool_call>", inline_chars=1 << 30)
        threaded = await chat_prompt(renderer, request, "<tool_call>", inline_chars=0)
        return inline, threaded

    try:
        inline, threaded = asyncio.run(both())
    finally:
        renderer.close()
    assert inline == threaded == renderer.chat_sync(request, "<tool_call>")


@pytest.mark.parametrize("case", COMPLETIONS, ids=[str(i) for i in range(len(COMPLETIONS))])
def test_inline_completion_render_gives_the_threaded_ids(renderer: LocalRenderer, case: dict[str, Any]) -> None:
    request = msgspec.convert({"model": "m", **case}, CompletionRequest)

    async def both() -> tuple[list[list[int]], list[list[int]]]:
        return (
            await completion_prompts(renderer, request, inline_chars=1 << 30),
            await completion_prompts(renderer, request, inline_chars=0),
        )

    try:
        inline, threaded = asyncio.run(both())
    finally:
        renderer.close()
    assert inline == threaded


def test_only_prompts_over_the_limit_leave_the_loop(renderer: LocalRenderer) -> None:
    """With the render threads shut down, a prompt within the limit still renders (on the loop)
    and one past it cannot: the limit alone decides where a render runs."""
    short = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest)
    long = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "y" * 200}]}, ChatCompletionRequest)
    renderer.close()

    async def render(request: ChatCompletionRequest) -> list[int]:
        return await chat_prompt(renderer, request, None, inline_chars=100)

    assert asyncio.run(render(short)) == renderer.chat_sync(short)
    with pytest.raises(RuntimeError):  # the executor refuses new work after shutdown
        asyncio.run(render(long))
