"""`/v1/messages` (Anthropic's Messages API) end to end: the `anthropic` SDK through a real
gateway in front of a sim engine, on every route, streamed and not; thinking blocks; a tool
round trip; `count_tokens`; errors in Anthropic's shape; Claude Code's first request, its key
as `x-api-key`, context edits, Anthropic's typed tools, sampling extras, context overflow."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from gateway.config import Agents, Auth
from gateway.serving.state import GatewayState
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


# ------------------------------------------------------------ Claude Code, with its default settings

CLAUDE_CODE_HEADERS = {
    "Accept": "application/json",
    "Content-Type": "application/json",
    "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
    "X-Claude-Code-Session-Id": "03c2ffd2-4945-4775-9adb-a43b5facfe0f",
    "X-Stainless-Arch": "x64",
    "X-Stainless-Lang": "js",
    "X-Stainless-OS": "Linux",
    "X-Stainless-Package-Version": "0.94.0",
    "X-Stainless-Retry-Count": "0",
    "X-Stainless-Runtime": "node",
    "X-Stainless-Runtime-Version": "v26.3.0",
    "X-Stainless-Timeout": "600",
    "anthropic-beta": "claude-code-20250219,context-1m-2025-08-07,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,mid-conversation-system-2026-04-07,effort-2025-11-24",
    "anthropic-dangerous-direct-browser-access": "true",
    "anthropic-version": "2023-06-01",
    "x-app": "cli",
}
"""The headers of Claude Code 2.1.197's first request (its key, `x-api-key`, added per test)."""
CLAUDE_CODE_BODY: dict[str, Any] = {
    "model": "sim",  # Claude Code sent `claude-opus-4-8`: an alias away
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-06.\n</system-reminder>\n\n"},
            {"type": "text", "text": "Run the shell command: echo hello", "cache_control": {"type": "ephemeral"}},
        ]},
        {"role": "system", "content": "Available agent types for the Agent tool:\n- Explore: Read-only search agent."},
    ],
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.fbe; cc_entrypoint=sdk-cli;"},
        {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "\nYou are an interactive agent that helps users with software engineering tasks."},
    ],
    "tools": [
        {"name": "Bash", "description": "Executes a given bash command.", "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {"command": {"description": "The command to execute", "type": "string"}},
            "required": ["command"], "additionalProperties": False}},
    ],
    "metadata": {"user_id": '{"device_id":"410ca0db","account_uuid":"","session_id":"03c2ffd2-4945-4775-9adb-a43b5facfe0f"}'},
    "max_tokens": 64000,
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "stream": True,
}
"""Its body, shortened (its 24 tools to one, its system prompt to three lines), every field kept."""
KEY = "sk-test-123"


@pytest.fixture
async def keyed(qwen3_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[str, GatewayState]]:
    """A gateway with API keys on: its root URL (Anthropic's base URL) and state."""
    monkeypatch.setenv("ONEHOP_TEST_MESSAGES_KEYS", KEY)
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, auth=Auth(api_keys_env="ONEHOP_TEST_MESSAGES_KEYS")) as (base, state),
    ):
        yield base.removesuffix("/v1"), state


async def test_claude_codes_first_request_is_served(keyed: tuple[str, GatewayState]) -> None:
    root, state = keyed
    async with aiohttp.ClientSession() as session:
        async with session.head(root + "/") as probe:  # what Claude Code sends first, without its key
            assert probe.status == 200 and await probe.read() == b""
        async with session.get(root + "/") as index:
            assert index.status == 200 and (await index.json())["anthropic_base_url"] == root
        headers = {**CLAUDE_CODE_HEADERS, "x-api-key": KEY}
        async with session.post(root + "/v1/messages?beta=true", data=json.dumps(CLAUDE_CODE_BODY), headers=headers) as answer:
            assert answer.status == 200, await answer.text()
            events = [line.split(": ", 1)[1] for line in (await answer.text()).splitlines() if line.startswith("event: ")]
        assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events
    assert sum(sample.value for sample in next(iter(state.metrics.ignored_fields.collect())).samples) == 0  # every field known


async def test_keys_as_x_api_key_or_bearer(keyed: tuple[str, GatewayState]) -> None:
    root, _ = keyed
    claude = anthropic.AsyncAnthropic(base_url=root, api_key=KEY, max_retries=0)  # sends x-api-key
    answer = await claude.messages.create(model="sim", max_tokens=10, messages=ASK)
    assert answer.content
    models = await claude.models.list()  # every /v1 route takes it
    assert [model.id for model in models.data] == ["sim"]
    await claude.close()
    openai_sdk = openai.AsyncOpenAI(base_url=root + "/v1", api_key=KEY, max_retries=0)  # sends Authorization: Bearer
    chat = await openai_sdk.chat.completions.create(model="sim", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message is not None
    await openai_sdk.close()
    wrong = anthropic.AsyncAnthropic(base_url=root, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await wrong.messages.create(model="sim", max_tokens=10, messages=ASK)
    await wrong.close()
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    async with aiohttp.ClientSession() as session, session.post(root + "/v1/messages", json={}) as missing:
        body = await missing.json()
    assert missing.status == 401 and "x-api-key" in body["error"]["message"] and "Bearer" in body["error"]["message"]


async def test_context_management_is_applied_and_reported(client: anthropic.AsyncAnthropic) -> None:
    history: list[Any] = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "old thought", "signature": ""}, {"type": "text", "text": "a"}]},
        {"role": "user", "content": "two"},
    ]
    edits: Any = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}, {"type": "compact_20260112"}]}
    answer = await client.beta.messages.create(model="sim", max_tokens=50, messages=history, context_management=edits)
    assert answer.context_management is not None
    [applied] = answer.context_management.applied_edits
    assert applied.type == "clear_thinking_20251015" and applied.cleared_thinking_turns == 1
    async with client.beta.messages.stream(model="sim", max_tokens=50, messages=history, context_management=edits) as stream:
        streamed = await stream.get_final_message()
    assert streamed.context_management == answer.context_management
    wrong_keep: Any = {"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}  # keep must be an object
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.beta.messages.create(model="sim", max_tokens=50, messages=history, context_management=wrong_keep)
    assert refused.value.body["error"]["message"].startswith("context_management.edits[0].keep: ")  # type: ignore[index]


async def test_ignored_edits_and_dropped_server_tools_are_counted(qwen3_tokenizer_dir: Path) -> None:
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _), gateway_server(qwen3_tokenizer_dir, engine_url) as (base, state):
        sdk = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="none", max_retries=0)
        tools: Any = [{"type": "web_search_20250305", "name": "web_search"}, {"type": "bash_20250124", "name": "bash"}]
        answer = await sdk.beta.messages.create(
            model="sim", max_tokens=200, messages=ASK, tools=tools, context_management={"edits": [{"type": "compact_20260112"}]},
        )
        await sdk.close()
        assert [(block.type, getattr(block, "name", None)) for block in answer.content if block.type == "tool_use"] == [("tool_use", "bash")]
        assert state.metrics.dropped_tools.labels("messages", "web_search")._value.get() == 1
        assert state.metrics.context_edits_ignored.labels("compact_20260112")._value.get() == 1


async def test_ignore_eos_gives_exactly_max_tokens(client: anthropic.AsyncAnthropic) -> None:
    plain = await client.messages.create(model="sim", max_tokens=300, messages=ASK)
    assert plain.usage.output_tokens < 300 and plain.stop_reason == "end_turn"
    answer = await client.messages.create(model="sim", max_tokens=300, messages=ASK, extra_body={"ignore_eos": True})
    assert answer.usage.output_tokens == 300 and answer.stop_reason == "max_tokens"


async def test_context_overflow_in_anthropics_words(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"max_model_len": 64}) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
    ):
        sdk = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="none", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as refused:
            await sdk.messages.create(model="sim", max_tokens=10, messages=[{"role": "user", "content": "word " * 100}])
        await sdk.close()
    message = refused.value.body["error"]["message"]  # type: ignore[index]
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 64 maximum", message), message
