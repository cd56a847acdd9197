"""`/v1/messages` (Anthropic's Messages API) end to end: the `anthropic` SDK through a real
gateway in front of a sim engine, on every route, streamed and not; thinking blocks; a tool
round trip; `count_tokens`; errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from gateway.config import Agents
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

ROUTES = ["derender", "text", "tokens"]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
async def client(qwen3_tokenizer_dir: Path) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
    ):
        sdk = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="none", max_retries=0)
        try:
            yield sdk
        finally:
            await sdk.close()


def _route(route: str) -> dict[str, Any]:
    return {"extra_headers": {"onehop-route": route}}


@pytest.mark.parametrize("route", ROUTES)
async def test_streamed_and_whole_answers_agree(client: anthropic.AsyncAnthropic, route: str) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    whole = await client.messages.create(
        model="sim", max_tokens=400, system="Be brief.", messages=[{"role": "user", "content": "Hi"}], thinking=thinking, **_route(route)
    )
    assert whole.id.startswith("msg_") and whole.stop_reason == "end_turn"
    assert [block.type for block in whole.content] == ["thinking", "text"]
    async with client.messages.stream(
        model="sim", max_tokens=400, system="Be brief.", messages=[{"role": "user", "content": "Hi"}], thinking=thinking, **_route(route)
    ) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    blocks = [{"type": b.type, "text": getattr(b, "text", None), "thinking": getattr(b, "thinking", None)} for b in streamed.content]
    assert blocks == [{"type": b.type, "text": getattr(b, "text", None), "thinking": getattr(b, "thinking", None)} for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens > 0
    assert streamed.usage.input_tokens == whole.usage.input_tokens > 0


@pytest.mark.parametrize("route", ROUTES)
async def test_tool_round_trip(client: anthropic.AsyncAnthropic, route: str) -> None:
    first = await client.messages.create(model="sim", max_tokens=400, messages=ASK, tools=[WEATHER], **_route(route))  # type: ignore[list-item]
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    async with client.messages.stream(model="sim", max_tokens=400, messages=history, tools=[WEATHER], **_route(route)) as stream:  # type: ignore[list-item]
        second = await stream.get_final_message()
    assert second.stop_reason in ("tool_use", "end_turn") and second.content


async def test_thinking_disabled_gives_no_thinking_block(client: anthropic.AsyncAnthropic) -> None:
    answer = await client.messages.create(model="sim", max_tokens=400, messages=ASK, thinking={"type": "disabled"})
    assert [block.type for block in answer.content] == ["text"]


async def test_max_tokens_and_stop_sequences(client: anthropic.AsyncAnthropic) -> None:
    short = await client.messages.create(model="sim", max_tokens=5, messages=ASK)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 5


async def test_count_tokens_matches_the_prompt_the_model_sees(client: anthropic.AsyncAnthropic) -> None:
    counted = await client.messages.count_tokens(model="sim", messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
    answer = await client.messages.create(model="sim", max_tokens=400, messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
    assert counted.input_tokens == answer.usage.input_tokens > 0


async def test_errors_come_in_anthropic_shape(client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(model="sim", max_tokens=10, messages=ASK, extra_body={"top_k": "many"})
    body: Any = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "top_k" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=10, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


async def test_unknown_fields_are_ignored_counted_or_refused(qwen3_tokenizer_dir: Path) -> None:
    """A field newer than this gateway (Claude Code adds some every few releases) is ignored and
    counted by default; `agents.unknown_fields: refuse` makes it a 400 naming it."""
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        async with gateway_server(qwen3_tokenizer_dir, engine_url) as (base, state):
            sdk = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="none", max_retries=0)
            for _ in range(2):
                answer = await sdk.messages.create(model="sim", max_tokens=10, messages=ASK, extra_body={"frobnicate": 1})
                assert answer.content
            await sdk.close()
            assert state.metrics.ignored_fields.labels("messages", "frobnicate")._value.get() == 2
        async with gateway_server(qwen3_tokenizer_dir, engine_url, agents=Agents(unknown_fields="refuse")) as (base, _):
            sdk = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="none", max_retries=0)
            with pytest.raises(anthropic.BadRequestError) as refused:
                await sdk.messages.create(model="sim", max_tokens=10, messages=ASK, extra_body={"frobnicate": 1})
            await sdk.close()
            assert refused.value.body["error"]["message"] == "frobnicate: Extra inputs are not permitted"  # type: ignore[index]
