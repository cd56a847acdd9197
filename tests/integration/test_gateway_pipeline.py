"""Chat and completions share one pipeline: each of its steps tested once across both endpoints.

Remote render, `continuous_usage_stats`, aborts for a client that leaves,
retries before the first byte, and prefill/decode disaggregation, each with
the `openai` SDK (or a raw HTTP client where it must cut a stream) against a
real gateway in front of real sim engines on loopback.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.config import EngineEndpoint
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server
from tests.support.render_service import render_service

ENDPOINTS = ["chat", "completions"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather like?"}]
PROMPTS = ["Once upon a time", "The weather today"]
"""Completions ask with two prompts: two engine requests merged into one answer."""


async def _ask(client: openai.AsyncOpenAI, endpoint: str, route: str, **kwargs: Any) -> Any:
    headers = {"onehop-route": route}
    if endpoint == "chat":
        return await client.chat.completions.create(model="sim", messages=MESSAGES, extra_headers=headers, **kwargs)  # type: ignore[arg-type]
    return await client.completions.create(model="sim", prompt=PROMPTS, extra_headers=headers, **kwargs)


def _texts(answer: Any) -> list[str]:
    """What each choice says (chat: its reasoning, then its content)."""
    out = []
    for choice in answer.choices:
        message = getattr(choice, "message", None)
        if message is None:
            out.append(choice.text)
        else:
            out.append((getattr(message, "reasoning", None) or "") + "|" + (message.content or ""))
    return out


async def _streamed_texts(stream: Any) -> list[str]:
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            piece = choice.text if delta is None else (getattr(delta, "reasoning", None) or "") + (delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
    return [texts[i] for i in sorted(texts)]


def _joined(texts: list[str]) -> list[str]:
    return [text.replace("|", "") for text in texts]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_remote_render_gives_the_local_answer(qwen3_tokenizer_dir: Path, endpoint: str) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (engine_url, _),
        render_service(qwen3_tokenizer_dir) as (render_url, calls),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (local_base, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, render="remote", remote_url=render_url) as (remote_base, _),
        openai.AsyncOpenAI(base_url=local_base, api_key="none", max_retries=0) as local,
        openai.AsyncOpenAI(base_url=remote_base, api_key="none", max_retries=0) as remote,
    ):
        for route in ("derender", "tokens"):
            reference = await _ask(local, endpoint, route, max_tokens=12, seed=5)
            answer = await _ask(remote, endpoint, route, max_tokens=12, seed=5)
            assert _texts(answer) == _texts(reference)
            assert answer.usage == reference.usage
            streamed = await _streamed_texts(await _ask(remote, endpoint, route, max_tokens=12, seed=5, stream=True))
            assert streamed == _joined(_texts(reference))
        assert (calls.chat, calls.completions) == ((4, 0) if endpoint == "chat" else (0, 4))


@pytest.mark.parametrize("route", ["derender", "text", "tokens"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_continuous_usage_stats(qwen3_tokenizer_dir: Path, endpoint: str, route: str) -> None:
    """Every chunk carries the usage so far (per engine request, as vLLM counts it), and the
    last chunk the whole request's; without `continuous_usage_stats`, only the last does."""
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        whole = await _ask(client, endpoint, route, max_tokens=10, seed=3)
        for continuous in (True, False):
            options = {"include_usage": True, "continuous_usage_stats": continuous}
            stream = await _ask(client, endpoint, route, max_tokens=10, seed=3, stream=True, stream_options=options)
            chunks = [chunk async for chunk in stream]
            *body, last = chunks
            assert last.choices == [] and last.usage == whole.usage
            with_choices = [chunk for chunk in body if chunk.choices]
            assert with_choices
            if continuous:
                assert all(chunk.usage is not None and chunk.usage.prompt_tokens > 0 for chunk in with_choices)
                per_choice: dict[int, list[int]] = {}
                for chunk in with_choices:
                    per_choice.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
                assert all(counts == sorted(counts) for counts in per_choice.values())
            else:
                assert all(chunk.usage is None for chunk in body)


@pytest.mark.parametrize("route", ["derender", "tokens"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_a_client_that_leaves_aborts_every_engine_request(qwen3_tokenizer_dir: Path, endpoint: str, route: str) -> None:
    slow = {"itl_ms": 20}
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", backend_options=slow) as (engine_url, engine),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, state),
        aiohttp.ClientSession() as session,
    ):
        body: dict[str, Any] = {"model": "sim", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        if endpoint == "chat":
            body["messages"], path = MESSAGES, "/chat/completions"
        else:
            body["prompt"], path = PROMPTS, "/completions"
        response = await session.post(base + path, json=body, headers={"onehop-route": route})
        assert response.status == 200
        await response.content.readany()
        assert engine.backend.running()
        legs = len(engine.backend.running())
        assert legs == (1 if endpoint == "chat" else len(PROMPTS))
        response.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2
        while engine.backend.running() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert not engine.backend.running(), "an engine request kept running for a client that left"
        assert state.metrics.engine_aborts._value.get() == legs


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_an_engine_that_refuses_is_retried_before_the_first_byte(qwen3_tokenizer_dir: Path, endpoint: str) -> None:
    dead = _closed_port()
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, [dead, engine_url]) as (base, state),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        retries = state.metrics.engine_retries.labels(dead)
        for attempt in range(40):  # the pool picks between the two engines: until one goes to the dead one
            stream = attempt % 2 == 1
            answer = await _ask(client, endpoint, "tokens", max_tokens=4, stream=stream)
            texts = await _streamed_texts(answer) if stream else _texts(answer)
            assert len(texts) == (1 if endpoint == "chat" else len(PROMPTS)) and all(texts)
            if retries._value.get() >= 2:
                break
        assert retries._value.get() >= 2, "no request was sent to the engine that refuses"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_disaggregated_prefill_then_decode(qwen3_tokenizer_dir: Path, endpoint: str) -> None:
    """Each prompt is prefilled, then decoded with the KV hand-off: the answers are the
    ones a plain gateway gives, on every route."""
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim", tokens_only=True) as (prefill_url, prefill),
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (decode_url, decode),
        gateway_server(qwen3_tokenizer_dir, decode_url, prefill_engines=[EngineEndpoint(url=prefill_url)]) as (pd_base, _),
        gateway_server(qwen3_tokenizer_dir, decode_url) as (plain_base, _),
        openai.AsyncOpenAI(base_url=pd_base, api_key="none", max_retries=0) as pd,
        openai.AsyncOpenAI(base_url=plain_base, api_key="none", max_retries=0) as plain,
    ):
        legs = 1 if endpoint == "chat" else len(PROMPTS)
        served = 0
        for route in ("derender", "text", "tokens"):
            reference = await _ask(plain, endpoint, route, max_tokens=12, seed=7)
            answer = await _ask(pd, endpoint, route, max_tokens=12, seed=7)
            assert _texts(answer) == _texts(reference)
            assert answer.usage == reference.usage
            streamed = await _streamed_texts(await _ask(pd, endpoint, route, max_tokens=12, seed=7, stream=True))
            assert streamed == _joined(_texts(reference))
            served += 2 * legs
        backend_p, backend_d = prefill.backend, decode.backend
        assert backend_p.prefills == served  # type: ignore[attr-defined]
        assert backend_d.remote_decodes == served  # type: ignore[attr-defined]
        assert backend_p.remote_decodes == 0 and backend_d.prefills == 0  # type: ignore[attr-defined]
