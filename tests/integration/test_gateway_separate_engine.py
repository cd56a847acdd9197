"""The gateway alone (`create_app` from a config) in front of a separate engine server: limits, timeouts, failures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest
from aiohttp.test_utils import TestServer

from gateway.serving.app import create_app
from gateway.config import EngineEndpoint, GatewayConfig, Timeouts
from tests.support.engine import engine_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


@asynccontextmanager
async def gateway_for(engine_url: str, tokenizer_dir: Path, **config: Any) -> AsyncIterator[str]:
    config = {"route_header": True, "policy_header": True, **config}
    settings = GatewayConfig(model="sim", tokenizer=str(tokenizer_dir), engines=[EngineEndpoint(url=engine_url)], **config)
    server = TestServer(create_app(settings), handler_cancellation=True)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_openai_sdk_against_a_separate_engine(qwen3_tokenizer_dir: Path) -> None:
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, engine_state):
        async with gateway_for(engine_url, qwen3_tokenizer_dir) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            completion = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=10)
            stream = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=10, stream=True)
            chunks = [chunk async for chunk in stream]
            await client.close()
        assert not engine_state.backend.running()
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert chunks[0].choices[0].delta.role == "assistant"


async def test_body_over_the_limit_is_413(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_for(engine_url, qwen3_tokenizer_dir, max_body_bytes=4096) as url,
    ):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as raised:
            await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x" * 10_000}])
        await client.close()
    assert raised.value.status_code == 413
    assert raised.value.code == "request_too_large"


async def test_unreachable_engine_is_503(qwen3_tokenizer_dir: Path) -> None:
    async with gateway_for("http://127.0.0.1:9", qwen3_tokenizer_dir) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(model="sim", messages=MESSAGES)
        await client.close()
    assert raised.value.status_code == 503


@pytest.mark.parametrize("route", ["derender", "tokens"])
async def test_idle_engine_stream_ends_with_an_error_event(qwen3_tokenizer_dir: Path, route: str) -> None:
    """An engine that goes silent mid-stream: the client gets an error event and [DONE], not a hang."""
    async with engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 1500}) as (engine_url, engine_state):
        timeouts = Timeouts(idle_s=0.3, first_token_s=0.3)
        async with (
            gateway_for(engine_url, qwen3_tokenizer_dir, timeouts=timeouts) as url,
            aiohttp.ClientSession() as session,
        ):
            body = {"model": "sim", "messages": MESSAGES, "stream": True, "max_tokens": 50}
            async with session.post(url + "/v1/chat/completions", json=body, headers={"onehop-route": route}) as resp:
                raw = await resp.read()
        assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n")
        assert not engine_state.running and not engine_state.backend.running()


async def test_routes_follow_the_engines_capabilities(qwen3_tokenizer_dir: Path) -> None:
    """A --tokens-only engine: a text route is refused up front, the default falls back to tokens and says so."""
    async with (
        engine_server(qwen3_tokenizer_dir, tokens_only=True) as (engine_url, _),
        gateway_for(engine_url, qwen3_tokenizer_dir) as url,
    ):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="not available on this engine"):
            await client.chat.completions.create(model="sim", messages=MESSAGES, extra_headers={"onehop-route": "text"})
        raw = await client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=3)
        await client.close()
    assert raw.headers["onehop-route"] == "tokens"
    assert "fallback" in raw.headers["onehop-policy"]
    assert raw.parse().choices[0].finish_reason == "length"


async def test_policy_file_picks_the_route(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "rules:\n  - name: wide-logprobs\n    match: {top_logprobs: {ge: 5}}\n    route: tokens\ndefault: derender\n"
    )
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_for(engine_url, qwen3_tokenizer_dir, policy=str(policy)) as url,
    ):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        wide = await client.chat.completions.with_raw_response.create(
            model="sim", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=8
        )
        plain = await client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=3)
        await client.close()
    assert (wide.headers["onehop-route"], plain.headers["onehop-route"]) == ("tokens", "derender")
    assert "wide-logprobs" in wide.headers["onehop-policy"]
    logprobs = wide.parse().choices[0].logprobs
    assert logprobs is not None and logprobs.content
    assert len(logprobs.content[0].top_logprobs) == 8
