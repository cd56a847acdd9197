"""The HTTP edge of the gateway and the engine (issue 27): connection time bounds, refusals
from the headers alone, engine 429s, abort handles, bounded non-streamed answers, and render
memory and fairness. Real servers on loopback; the connection cases are raw sockets."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.config import Health, Limits, Timeouts
from tests.support.engine import AppServer, engine_server
from tests.support.gateway import gateway_server

MESSAGES = [{"role": "user", "content": "Tell me a story."}]
GUARD_S = 20.0
"""How long a test waits for what must happen at once (or after a sub-second bound): on the
code before the fix each waited aiohttp's 3,630 s, or the body's 30 s."""


def _address(base: str) -> tuple[str, int]:
    host, port = base.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return host, int(port)


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (within `GUARD_S`)."""
    async with asyncio.timeout(GUARD_S):
        return await reader.read()


async def _wait_for(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD_S):
        while not condition():
            await asyncio.sleep(0.01)


# ------------------------------------------------------------ 1. idle and slow-header connections


async def _idle_connection_is_closed(base: str) -> None:
    reader, writer = await asyncio.open_connection(*_address(base))
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        answer = await _until_closed(reader)  # the answer, then nothing: kept alive, then closed
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert b"connection: close" not in answer.lower()  # it was kept alive, not closed with the answer
    finally:
        writer.close()


async def _half_header_is_cut(base: str) -> None:
    reader, writer = await asyncio.open_connection(*_address(base))
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: half a hea")
        await writer.drain()
        assert await _until_closed(reader) == b""  # closed, with nothing served
    finally:
        writer.close()


async def test_gateway_closes_idle_and_slow_header_connections(qwen3_tokenizer_dir: Path) -> None:
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        idle = Timeouts(keepalive_s=0.3, client_header_s=60)
        async with gateway_server(qwen3_tokenizer_dir, engine_url, timeouts=idle) as (base, _):
            await _idle_connection_is_closed(base)
        slow = Timeouts(keepalive_s=60, client_header_s=0.3)
        async with gateway_server(qwen3_tokenizer_dir, engine_url, timeouts=slow) as (base, _):
            await _half_header_is_cut(base)
            # A request whose headers come whole is served as before.
            async with aiohttp.ClientSession() as session, session.get(base.removesuffix("/v1") + "/health") as response:
                assert response.status == 200


async def test_engine_closes_idle_and_slow_header_connections(qwen3_tokenizer_dir: Path) -> None:
    async with engine_server(qwen3_tokenizer_dir, keepalive_s=0.3, client_header_s=60) as (engine_url, _):
        await _idle_connection_is_closed(engine_url)
    async with engine_server(qwen3_tokenizer_dir, keepalive_s=60, client_header_s=0.3) as (engine_url, _):
        await _half_header_is_cut(engine_url)


async def _head(base: str, request: bytes) -> bytes:
    """The response head to `request`, sent alone on a fresh connection."""
    reader, writer = await asyncio.open_connection(*_address(base))
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(GUARD_S):
            return (await reader.readuntil(b"\r\n\r\n")).lower()
    finally:
        writer.close()


async def test_an_answer_on_a_kept_connection_names_the_idle_bound(qwen3_tokenizer_dir: Path) -> None:
    """Node's fetch (undici) drops an idle connection after 4 s unless the server names a longer
    bound: an agent's next turn after a tool run would otherwise come on a new connection (and,
    under `--workers N`, to a worker that has not cached its conversation)."""
    idle = Timeouts(keepalive_s=75.9)
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _), gateway_server(
        qwen3_tokenizer_dir, engine_url, timeouts=idle
    ) as (base, _):
        kept = await _head(base, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"\r\nkeep-alive: timeout=75\r\n" in kept, kept  # whole seconds, never more than kept
        closing = await _head(base, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b"connection: close" in closing and b"keep-alive:" not in closing, closing
        old_client = await _head(base, b"GET /health HTTP/1.0\r\n\r\n")
        assert b"keep-alive:" not in old_client, old_client


# ------------------------------------------------------------ 2 and 3. refused from the headers


async def _declared_too_large(base: str, path: str, limit: int) -> dict[str, Any]:
    """POST headers declaring one byte over `limit`, and no body: the error, answered at once."""
    reader, writer = await asyncio.open_connection(*_address(base))
    try:
        request = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n"
        writer.write(request.encode())  # and no body at all
        await writer.drain()
        # The answer, not the close: aiohttp lingers up to 10 s reading a body it refused.
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")))
        answer = head + await reader.readexactly(length)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"413", answer[:300]
    error: dict[str, Any] = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert str(limit) in error["message"], error
    return error


async def test_a_body_declared_over_the_limit_is_refused_at_once(qwen3_tokenizer_dir: Path) -> None:
    limit = 64 * 1024
    async with (
        engine_server(qwen3_tokenizer_dir, max_body_bytes=limit) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, max_body_bytes=limit, timeouts=Timeouts(client_body_s=600)) as (base, _),
    ):
        error = await _declared_too_large(base, "/v1/chat/completions", limit)
        assert error["code"] == "request_too_large"
        await _declared_too_large(engine_url, "/inference/v1/generate", limit)


API_POSTS = {
    "/chat/completions": {"model": "sim", "messages": MESSAGES, "max_tokens": 2},
    "/completions": {"model": "sim", "prompt": "Once", "max_tokens": 2},
    "/responses": {"model": "sim", "input": "hi", "max_output_tokens": 2},
    "/messages": {"model": "sim", "messages": MESSAGES, "max_tokens": 2},
    "/messages/count_tokens": {"model": "sim", "messages": MESSAGES},
}


async def test_every_api_post_takes_json_only(qwen3_tokenizer_dir: Path) -> None:
    refused = [None, "text/plain", "application/x-www-form-urlencoded", "application/octet-stream", "application/json; charset=latin-1"]
    accepted = ["application/json", "application/json; charset=utf-8", "Application/JSON; charset=UTF-8"]
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        for path, request in API_POSTS.items():
            body = json.dumps(request).encode()
            for kind in refused:
                headers = {"Content-Type": kind} if kind is not None else {}
                skip = () if kind is not None else ("Content-Type",)
                async with session.post(base + path, data=body, headers=headers, skip_auto_headers=skip) as response:
                    assert response.status == 415, (path, kind, await response.text())
                    error = (await response.json())["error"]
                    assert "application/json" in error["message"], error
            for kind in accepted:
                async with session.post(base + path, data=body, headers={"Content-Type": kind}) as response:
                    assert response.status == 200, (path, kind, await response.text())


# ------------------------------------------------------------ 4. aborts need the gateway's handle


async def test_only_the_gateway_can_abort_its_engine_requests(qwen3_tokenizer_dir: Path) -> None:
    """Whoever reaches the engine and knows a request's id (the access log, `X-Request-Id`, the
    answer's `id`) cannot abort it: the engine request's id carries a handle only the gateway knows."""
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 5}) as (engine_url, engine),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        aiohttp.ClientSession() as session,
    ):

        async def stream_and_abort(engine_id: Callable[[str, str], str]) -> str | None:
            """Stream a chat; while it runs, abort its engine request by `engine_id(public, full)`;
            the stream's last finish_reason."""
            request = {"model": "sim", "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
            finish, sent = None, False
            async with session.post(base + "/chat/completions", json=request) as response:
                assert response.status == 200
                public = response.headers["X-Request-Id"]
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    assert chunk["id"] == public  # the client's id is the public one, without the handle
                    running = [rid for rid in engine.running if rid.split("#")[0] == public]  # the id, then its handle
                    if not sent and running:
                        sent = True
                        abort = {"request_ids": [engine_id(public, running[0])]}
                        async with session.post(engine_url + "/inference/v1/abort_requests", json=abort) as aborted:
                            assert aborted.status == 200
                    for choice in chunk["choices"]:
                        finish = choice.get("finish_reason") or finish
            assert sent, "the abort was never sent while the request ran"
            return finish

        # By the id the client and the logs see: the engine does not know it, the stream runs on.
        assert await stream_and_abort(lambda public, full: public) == "length"
        # By the whole id (what the gateway sends when its client leaves): aborted.
        assert await stream_and_abort(lambda public, full: full) == "abort"


# ------------------------------------------------------------ 5. an engine 429 is the client's 429


class BusyEngine:
    """A real engine behind a proxy that answers generate with 429 while `busy`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.busy = True
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.busy and request.path.endswith("/generate"):
            body = {"error": {"message": "too many requests in queue", "type": "RateLimitError", "code": 429}}
            return web.json_response(body, status=429, headers={"Retry-After": "7"})
        assert self.session is not None
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self.session.request(request.method, self.upstream + request.path_qs, data=await request.read(), headers=headers) as up:
            return web.Response(status=up.status, body=await up.read(), content_type=up.content_type)


async def test_an_engine_429_reaches_the_client_and_leaves_the_circuit_closed(qwen3_tokenizer_dir: Path) -> None:
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _), aiohttp.ClientSession() as session:
        busy = BusyEngine(engine_url)
        busy.session = session
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", busy.handle)
        proxy = AppServer(app)
        await proxy.start_server()
        try:
            proxied = str(proxy.make_url("")).rstrip("/")
            health = Health(failure_threshold=1, open_s=600, interval_s=600)
            async with gateway_server(qwen3_tokenizer_dir, proxied, health=health) as (base, _):
                for stream in (False, True):
                    request = {"model": "sim", "messages": MESSAGES, "max_tokens": 2, "stream": stream}
                    async with session.post(base + "/chat/completions", json=request) as response:
                        assert response.status == 429, await response.text()
                        assert response.headers["Retry-After"] == "7"
                        error = (await response.json())["error"]
                        assert error["code"] == "rate_limit_exceeded" and "too many requests in queue" in error["message"]
                # Busy is not broken: with a circuit that opens at the first failure, the next request is served.
                busy.busy = False
                async with session.post(base + "/chat/completions", json=API_POSTS["/chat/completions"]) as response:
                    assert response.status == 200, await response.text()
        finally:
            await proxy.close()


# ------------------------------------------------------------ 6. non-streamed answers are bounded


async def test_a_non_streamed_answer_is_bounded_before_and_while_it_is_made(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, limits=Limits(max_buffered_tokens=1000, max_answer_bytes=4096)) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        wide = {"model": "sim", "messages": MESSAGES, "n": 2, "max_tokens": 100, "logprobs": True, "top_logprobs": 5}
        async with session.post(base + "/chat/completions", json=wide) as response:
            assert response.status == 400
            error = (await response.json())["error"]
            assert "limits.max_buffered_tokens=1000" in error["message"] and "stream" in error["message"], error
            assert "1200" in error["message"]  # 2 × 100 × (1 + 5)
        # Without max_tokens the context (32768) counts.
        async with session.post(base + "/chat/completions", json={"model": "sim", "messages": MESSAGES}) as response:
            assert response.status == 400 and "not given" in (await response.json())["error"]["message"]
        # Streamed, the same request is served: nothing is held whole.
        async with session.post(base + "/chat/completions", json={**wide, "stream": True}) as response:
            assert response.status == 200
            assert b"[DONE]" in await response.read()
        # Within the product but over the answer's byte bound: reading stops there, a 502 names it.
        for route in ("derender", "text", "tokens"):
            small = {"model": "sim", "messages": MESSAGES, "max_tokens": 150, "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
            async with session.post(base + "/chat/completions", json=small, headers={"onehop-route": route}) as response:
                assert response.status == 502, (route, await response.text())
                assert "limits.max_answer_bytes=4096" in (await response.json())["error"]["message"]


# ------------------------------------------------------------ 7. render: every text counted, big ones aside


SHORT_CONTEXT = 1024
"""The sim engine's context here: 1024 tokens of at most 128 bytes is 131,072 characters."""
HUGE = "a tool that does many things. " * 6000  # 180,000 characters


def _huge_requests() -> dict[str, tuple[str, dict[str, Any]]]:
    tool = {"type": "function", "function": {"name": "f", "description": HUGE, "parameters": {"type": "object"}}}
    schema_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": HUGE}}}
    anthropic_tool = {"name": "f", "description": HUGE, "input_schema": {"type": "object"}}
    responses_tool = {"type": "function", "name": "f", "description": HUGE, "parameters": {"type": "object"}}
    chat = {"model": "sim", "messages": MESSAGES, "max_tokens": 2}
    messages = {"model": "sim", "messages": MESSAGES, "max_tokens": 2}
    return {
        "chat tool description": ("/chat/completions", {**chat, "tools": [tool]}),
        "chat tool schema": ("/chat/completions", {**chat, "tools": [schema_tool]}),
        "chat_template_kwargs": ("/chat/completions", {**chat, "chat_template_kwargs": {"note": HUGE}}),
        "responses tool": ("/responses", {"model": "sim", "input": "hi", "max_output_tokens": 2, "tools": [responses_tool]}),
        "responses instructions": ("/responses", {"model": "sim", "input": "hi", "max_output_tokens": 2, "instructions": HUGE}),
        "messages tool": ("/messages", {**messages, "tools": [anthropic_tool]}),
        "messages system": ("/messages", {**messages, "system": HUGE}),
        "count_tokens tool": ("/messages/count_tokens", {"model": "sim", "messages": MESSAGES, "tools": [anthropic_tool]}),
    }


async def test_every_text_field_that_reaches_the_template_is_counted(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"max_model_len": SHORT_CONTEXT}) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, state),
        aiohttp.ClientSession() as session,
    ):
        for case, (path, request) in _huge_requests().items():
            async with session.post(base + path, json=request) as response:
                assert response.status == 400, (case, await response.text())
                message = (await response.json())["error"]["message"]
                if path.startswith("/messages"):  # Anthropic's words: the fewest tokens the text could be
                    words = re.fullmatch(rf"prompt is too long: (\d+) tokens > {SHORT_CONTEXT} maximum", message)
                    assert words is not None and int(words.group(1)) > SHORT_CONTEXT, (case, message)
                    continue
                # vLLM's words for the check before render, not the token count after it
                assert f"maximum context length is {SHORT_CONTEXT} tokens" in message, (case, message)
                assert "characters (more than 131072 characters" in message, (case, message)
        assert state.models["sim"].renderer.cached_bytes == 0  # nothing was rendered


async def test_small_requests_render_while_big_ones_wait_their_lane(qwen3_tokenizer_dir: Path) -> None:
    """Six big renders (each more text than the context holds, refused after render) and one
    4-token chat: the small one is answered before every big one still queued for the large
    lane. The ones rendering when it arrived (`large_render_workers` of them) may finish first:
    a big render's turns are tokenized in one batch on every core, so it can end in the time
    the small one takes on a machine they share."""
    bigs = 6
    limits = Limits(large_render_chars=10_000)
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, limits=limits) as (base, state),
        aiohttp.ClientSession() as session,
    ):
        order: list[str] = []

        async def chat(name: str, text: str, max_tokens: int) -> None:
            request = {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
            async with session.post(base + "/chat/completions", json=request) as response:
                await response.read()
                order.append(f"{name} {response.status}")

        in_flight = state.metrics.in_flight.labels("chat")
        words = [f"w{k}x{j} " for j in range(64) for k in range(bigs)]
        tasks = [asyncio.ensure_future(chat(f"big{k}", "".join(words[k::bigs]) * 1000, 2)) for k in range(bigs)]
        try:
            await _wait_for(lambda: in_flight._value.get() >= bigs)
            await chat("small", "Hi", 4)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        assert "small 200" in order[: limits.large_render_workers + 1], order
        assert sorted(name for name in order if name != "small 200") == sorted(f"big{k} 400" for k in range(bigs)), order
