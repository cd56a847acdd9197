"""The remote render/derender client against a real aiohttp server on loopback: broken connections."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from gateway.upstream.remote import RemoteUnavailable, _post


async def serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions/derender", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1/chat/completions/derender"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_connection_dropped_before_the_answer_is_retried_once(session: aiohttp.ClientSession) -> None:
    calls: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(await request.read())
        if len(calls) == 1:
            assert request.transport is not None
            request.transport.close()  # the server drops the connection without an answer
            return web.Response()
        return web.json_response({"ok": len(calls)})

    runner, url = await serve(handler)
    try:
        assert await _post(session, url, b'{"n": 1}') == b'{"ok": 2}'
        assert calls == [b'{"n": 1}', b'{"n": 1}']
    finally:
        await runner.cleanup()


async def test_a_connection_dropped_twice_is_unavailable(session: aiohttp.ClientSession) -> None:
    calls = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    runner, url = await serve(handler)
    try:
        with pytest.raises(RemoteUnavailable, match="cannot reach"):
            await _post(session, url, b"{}")
        assert calls == 2
    finally:
        await runner.cleanup()
