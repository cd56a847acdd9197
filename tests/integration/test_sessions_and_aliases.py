"""Agents' model names and conversation ids, end to end: glob aliases (`onehop serve --alias`),
exact names before patterns, and one session key per request on the gateway's and the engine's
spans (the engine reads it from vLLM's `X-Session-ID`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from engine.config import EngineConfig
from plumbing.telemetry import TracingConfig
from gateway.config import EngineEndpoint, GatewayConfig, ModelConfig
from onehop.serve import embedded
from tests.support.engine import engine_server
from tests.support.gateway import configured_gateway
from tests.support.otlp import ReceivedSpan, Receiver, otlp_receiver

ASK: list[Any] = [{"role": "user", "content": "Say hello."}]


def _sessions(receiver: Receiver, service: str, kind: str) -> list[Any]:
    spans: list[ReceivedSpan] = sorted(
        (s for s in receiver.spans if s.service == service and s.kind == kind), key=lambda s: s.start_ns
    )
    return [s.attributes.get("session.id") for s in spans]


async def test_agents_model_names_and_sessions_through_serve(qwen3_tokenizer_dir: Path) -> None:
    async with otlp_receiver() as receiver:
        engine = EngineConfig(
            backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim", tracing=TracingConfig(endpoint=receiver.url)
        )
        async with embedded(engine, host="127.0.0.1", port=0, route="derender", aliases=["claude-*", "gpt-5*"]) as running:
            claude = anthropic.AsyncAnthropic(base_url=running.url, api_key="none", max_retries=0)
            codex = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
            async with claude, codex:
                message = await claude.messages.create(
                    model="claude-opus-4-8", max_tokens=8, messages=ASK,
                    extra_headers={"X-Claude-Code-Session-Id": "conv-claude"},
                )
                assert message.model == "claude-opus-4-8"  # the client's name, as it sent it
                await claude.messages.create(
                    model="claude-haiku-4-5-20251001", max_tokens=8, messages=ASK,
                    metadata={"user_id": '{"device_id":"d","session_id":"conv-meta"}'},
                )
                response = await codex.responses.create(
                    model="gpt-5.5-codex", input="Say hello.", max_output_tokens=8, prompt_cache_key="thread-9",
                    extra_headers={"session-id": "thread-header"},
                )
                assert response.model == "gpt-5.5-codex"
                await codex.chat.completions.create(model="sim", messages=ASK, max_tokens=8, user="someone")
                await codex.chat.completions.create(model="sim", messages=ASK, max_tokens=8)
                assert [model.id async for model in codex.models.list()] == ["sim"]  # patterns are not names
                with pytest.raises(openai.NotFoundError):
                    await codex.chat.completions.create(model="claude", messages=ASK, max_tokens=8)  # no `-`
    # The header wins over the body (Codex sends both); a request with no id has no session.
    expected = ["conv-claude", "conv-meta", "thread-header", "someone", None]
    assert _sessions(receiver, "onehop-gateway", "SERVER")[:5] == expected
    assert _sessions(receiver, "onehop-engine", "SERVER") == expected


async def test_exact_names_win_over_patterns(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (sim_url, _),
        engine_server(qwen3_tokenizer_dir, served_model_name="small") as (small_url, _),
    ):
        tokenizer = str(qwen3_tokenizer_dir)
        config = GatewayConfig(
            models=[
                ModelConfig(name="sim", aliases=["claude-*"], tokenizer=tokenizer, engines=[EngineEndpoint(url=sim_url)]),
                ModelConfig(
                    name="small", aliases=["claude-haiku-4-5", "*-mini"], tokenizer=tokenizer,
                    engines=[EngineEndpoint(url=small_url)],
                ),
            ]
        )
        async with configured_gateway(config) as (base, _), aiohttp.ClientSession() as session:
            served = {}
            for name in ("claude-haiku-4-5", "claude-opus-4-8", "gpt-5-mini", "claude-x-mini"):
                async with session.get(f"{base}/models/{name}") as resp:
                    served[name] = (await resp.json())["id"]
            async with session.get(f"{base}/models/nothing") as resp:
                assert resp.status == 404
    # claude-x-mini: both patterns match; the first configured wins.
    assert served == {"claude-haiku-4-5": "small", "claude-opus-4-8": "sim", "gpt-5-mini": "small", "claude-x-mini": "sim"}


def test_a_pattern_given_twice_is_a_config_error(qwen3_tokenizer_dir: Path) -> None:
    engines = [EngineEndpoint(url="http://127.0.0.1:9")]
    with pytest.raises(ValueError, match="'claude-\\*' is given twice"):
        GatewayConfig(
            models=[
                ModelConfig(name="a", aliases=["claude-*"], tokenizer=str(qwen3_tokenizer_dir), engines=engines),
                ModelConfig(name="b", aliases=["claude-*"], tokenizer=str(qwen3_tokenizer_dir), engines=engines),
            ]
        )
