"""The gateway in front of an engine that presents as stock vLLM 0.33.

A small proxy on a loopback port stands in front of a real onehop engine and
answers as stock vLLM does: 404 on the capabilities document, its version on
`/version`, and (when told) vLLM's 403 on every scale-out route; it passes the
rest through and records the generate bodies. The onehop engine behind it
speaks vLLM 0.33's derender form, so the whole exchange is real.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.routing.datastore import Circuit
from tests.integration.test_engine_server import MESSAGES, TOOLS
from tests.support import vllm033
from tests.support.engine import AppServer, engine_server
from tests.support.gateway import gateway_server
from tests.support.typed import function_calls

SCALE_OUT_OFF = {  # vLLM 0.33's answer with --enable-scale-out off
    "error": {
        "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
        "type": "PermissionDeniedError",
        "param": None,
        "code": 403,
    }
}


@dataclass
class StockVllm:
    """What the proxy saw and answers as."""

    version: str = "0.33.0"
    scale_out: bool = True
    generated: list[dict[str, Any]] = field(default_factory=list)
    refused: int = 0
    """Generate requests answered 403."""
    answers: list[bytes] = field(default_factory=list)


@asynccontextmanager
async def stock_vllm(engine_url: str, stock: StockVllm) -> AsyncIterator[str]:
    session = aiohttp.ClientSession()

    async def capabilities(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": stock.version})

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path.startswith("/inference/") and not stock.scale_out:
            stock.refused += request.path == "/inference/v1/generate"
            return web.json_response(SCALE_OUT_OFF, status=403)
        if request.path == "/inference/v1/generate":
            stock.generated.append(json.loads(body))
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.request(request.method, engine_url + request.path_qs, data=body, headers=headers) as upstream:
            out = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.headers["Content-Type"]})
            await out.prepare(request)
            whole = b""
            async for piece in upstream.content.iter_any():
                whole += piece
                await out.write(piece)
            await out.write_eof()
            if request.path == "/inference/v1/generate":
                stock.answers.append(whole)
            return out

    app = web.Application()
    app.router.add_get("/inference/v1/capabilities", capabilities)
    app.router.add_get("/version", version)
    app.router.add_route("*", "/{tail:.*}", forward)
    server = AppServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()
        await session.close()


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)


async def _chat(client: openai.AsyncOpenAI, **extra: Any) -> Any:
    return await client.chat.completions.create(model="sim", messages=MESSAGES, tools=TOOLS, seed=7, max_tokens=200, **extra)


async def test_non_streaming_chat_uses_vllms_derender(qwen3_tokenizer_dir: Path) -> None:
    stock = StockVllm()
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        async with (
            stock_vllm(engine_url, stock) as vllm_url,
            gateway_server(qwen3_tokenizer_dir, vllm_url) as (base, _),
            _client(base) as client,
        ):
            via_vllm = await client.chat.completions.with_raw_response.create(
                model="sim", messages=MESSAGES, tools=TOOLS, seed=7, max_tokens=200, logprobs=True, top_logprobs=1
            )
        async with gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _), _client(base) as client:
            via_onehop = await _chat(client, logprobs=True, top_logprobs=1)
    assert via_vllm.headers["onehop-route"] == "derender"
    completion = via_vllm.parse()
    (sent,) = stock.generated
    assert sent["output_mode"] == "derender" and sent["stream"] is False and "chat_request" not in sent
    context = vllm033.PARSE_CONTEXT.decode(json.dumps(sent["parse_context"]))
    assert context.tool_choice == "auto" and context.tools is not None and context.tools[0].function.name == "get_weather"
    assert context.chat_template_kwargs["add_generation_prompt"] is True
    vllm033.RESPONSE.decode(stock.answers[0])  # the engine answered in vLLM's shape
    # The client's ChatCompletion: the gateway's id, model and time, the engine's parse.
    assert completion.id.startswith("chatcmpl-") and completion.model == "sim" and completion.object == "chat.completion"
    choice, theirs = completion.choices[0], via_onehop.choices[0]
    assert choice.finish_reason == "tool_calls" == theirs.finish_reason
    assert choice.message.model_extra is not None
    assert choice.message.model_extra["reasoning"] == theirs.message.model_extra["reasoning"]
    assert choice.message.content == theirs.message.content
    calls = function_calls(choice.message.tool_calls)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in theirs.message.tool_calls or []
    ]
    assert calls and calls[0].function.name == "get_weather"
    assert choice.logprobs is not None and theirs.logprobs is not None
    assert [t.token for t in choice.logprobs.content or []] == [t.token for t in theirs.logprobs.content or []]
    assert completion.usage is not None and via_onehop.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        via_onehop.usage.prompt_tokens,
        via_onehop.usage.completion_tokens,
    )


async def test_streams_keep_the_text_route(qwen3_tokenizer_dir: Path) -> None:
    stock = StockVllm()
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        stock_vllm(engine_url, stock) as vllm_url,
        gateway_server(qwen3_tokenizer_dir, vllm_url) as (base, _),
        _client(base) as client,
    ):
        stream = await _chat(client, stream=True)
        calls = [
            call.function.name
            async for chunk in stream
            if chunk.choices
            for call in chunk.choices[0].delta.tool_calls or []
            if call.function and call.function.name
        ]
    assert calls == ["get_weather"]
    (sent,) = stock.generated
    assert sent["output_mode"] == "text" and sent["stream"] is True and "parse_context" not in sent


async def test_a_stock_032_is_never_sent_derender(qwen3_tokenizer_dir: Path) -> None:
    stock = StockVllm(version="0.32.0")
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        stock_vllm(engine_url, stock) as vllm_url,
        gateway_server(qwen3_tokenizer_dir, vllm_url) as (base, state),
    ):
        async with _client(base) as client:
            completion = await _chat(client)
        engines = state.model("sim").engines
        assert await engines.routes(vllm_url) == {"tokens", "text"} and engines.derender_form(vllm_url) == "onehop"
    assert completion.choices[0].message.tool_calls
    assert [body["output_mode"] for body in stock.generated] == ["text"]


async def test_forced_tool_choice_keeps_the_text_route(qwen3_tokenizer_dir: Path) -> None:
    stock = StockVllm()
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        stock_vllm(engine_url, stock) as vllm_url,
        gateway_server(qwen3_tokenizer_dir, vllm_url) as (base, _),
        _client(base) as client,
    ):
        completion = await _chat(client, tool_choice="required")
    assert completion.choices[0].message.tool_calls
    assert [body["output_mode"] for body in stock.generated] == ["text"]


async def test_scale_out_off_leaves_the_engine_out_with_its_circuit_closed(qwen3_tokenizer_dir: Path) -> None:
    off, on = StockVllm(scale_out=False), StockVllm()
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        stock_vllm(engine_url, off) as off_url,
        stock_vllm(engine_url, on) as on_url,
        gateway_server(qwen3_tokenizer_dir, [off_url, on_url]) as (base, state),
        _client(base) as client,
    ):
        sent = 0
        while not off.refused and sent < 40:  # the pool picks either one first, at random
            completion = await _chat(client)
            assert completion.choices[0].message.tool_calls  # retried on the other: the client never knew
            sent += 1
        for _ in range(4):
            await _chat(client)
        engines = state.model("sim").engines
        assert await engines.routes(off_url) == frozenset()
        assert engines.store.endpoints[off_url].breaker.state is Circuit.CLOSED
        assert engines.store.endpoints[off_url].breaker.failures == 0
    assert off.refused == 1 and len(on.generated) == sent + 4


async def test_the_only_engine_with_scale_out_off_is_a_503(qwen3_tokenizer_dir: Path) -> None:
    off = StockVllm(scale_out=False)
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        stock_vllm(engine_url, off) as off_url,
        gateway_server(qwen3_tokenizer_dir, off_url) as (base, state),
    ):
        for _ in range(2):  # the 403 itself, then the engine left out
            with pytest.raises(openai.InternalServerError) as caught:
                async with _client(base) as client:
                    await _chat(client)
            assert caught.value.status_code == 503 and "generate API" in caught.value.message
        assert state.model("sim").engines.store.endpoints[off_url].breaker.state is Circuit.CLOSED


async def test_responses_api_takes_vllms_derender_too(qwen3_tokenizer_dir: Path) -> None:
    """Another API presented from the chat answer: the form's answer feeds the presenter."""
    stock = StockVllm()
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        stock_vllm(engine_url, stock) as vllm_url,
        gateway_server(qwen3_tokenizer_dir, vllm_url) as (base, _),
        _client(base) as client,
    ):
        response = await client.responses.create(model="sim", input="Say something.", max_output_tokens=40)
    assert response.status in ("completed", "incomplete") and response.output
    (sent,) = stock.generated
    assert sent["output_mode"] == "derender" and "parse_context" in sent
