"""An engine that goes silent mid-stream: `timeouts.idle_s` ends the stream on every API and route.

`first_token_s` bounds only the wait for the first event; the silence after it is
`idle_s`'s, whether the stream is spliced (one chat answer) or read by the request's
task (Responses, Messages, several prompts), where a stall once went unseen until
`first_token_s` had passed (issue #27). The engine is a real sim engine behind a
proxy (a real aiohttp app on port 0) that passes a few events of each streamed
answer and then sends nothing, its connection left open.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.config import Timeouts
from tests.support.engine import AppServer, engine_server
from tests.support.gateway import gateway_server

IDLE_S = 0.5
FIRST_TOKEN_S = 120.0
GUARD_S = 30.0
"""Many times `idle_s`, a fraction of `first_token_s`: a stall seen only after `first_token_s` fails."""
PASSED = 3
"""Events of each streamed answer the proxy passes before it goes silent."""


class SilentEngine:
    """Proxies every path to a real engine; a streamed `generate` answer stops after `PASSED` events."""

    def __init__(self, upstream: str, session: aiohttp.ClientSession) -> None:
        self.upstream = upstream
        self.session = session
        self.quiet = asyncio.Event()
        """Set at the end: a silent answer waits for it (or for its client to leave)."""
        self.silent = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self.session.request(request.method, self.upstream + request.path_qs, data=body or None, headers=headers) as upstream:
            kind = upstream.headers.get("Content-Type", "application/json")
            if not kind.startswith("text/event-stream"):
                return web.Response(status=upstream.status, body=await upstream.read(), headers={"Content-Type": kind})
            response = web.StreamResponse(headers={"Content-Type": kind})
            await response.prepare(request)
            passed = 0
            async for line in upstream.content:
                await response.write(line)
                if line == b"\n":
                    passed += 1
                    if passed == PASSED:
                        break
        self.silent += 1
        await self.quiet.wait()
        return response


@asynccontextmanager
async def silent_engine(upstream: str) -> AsyncIterator[tuple[str, SilentEngine]]:
    async with aiohttp.ClientSession() as session:
        engine = SilentEngine(upstream, session)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", engine.handle)
        server = AppServer(app, handler_cancellation=True)
        await server.start_server()
        try:
            yield str(server.make_url("")).rstrip("/"), engine
        finally:
            engine.quiet.set()
            await server.close()


PROMPT = "Tell me a long story."
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200, "ignore_eos": True}),
    "responses": ("/v1/responses", {"input": PROMPT, "max_output_tokens": 200}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200}),
    "completions, several prompts": ("/v1/completions", {"prompt": [PROMPT, "Another one."], "max_tokens": 200, "ignore_eos": True}),
}


@pytest.mark.parametrize("route", ["derender", "text", "tokens"])
@pytest.mark.parametrize("api", list(REQUESTS))
async def test_an_engine_silent_mid_stream_ends_it_after_idle_s(qwen3_tokenizer_dir: Path, api: str, route: str) -> None:
    path, body = REQUESTS[api]
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        silent_engine(engine_url) as (proxy_url, proxy),
        gateway_server(
            qwen3_tokenizer_dir, proxy_url, timeouts=Timeouts(first_token_s=FIRST_TOKEN_S, idle_s=IDLE_S)
        ) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        url = base.removesuffix("/v1") + path
        request = {"model": "sim", "stream": True, **body}
        async with asyncio.timeout(GUARD_S):
            async with session.post(url, json=request, headers={"onehop-route": route}) as response:
                assert response.status == 200, await response.text()
                answer = await response.read()
        assert proxy.silent >= 1
        assert f"nothing for idle_s={IDLE_S} s".encode() in answer, answer[-400:]
