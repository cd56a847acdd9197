"""An engine that dies mid-stream: a real aiohttp app on port 0 that passes every request to a
real engine and back, and, when armed, relays the next streamed generate answer for a given
number of events, then drops the connection as a crashed engine process would."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

_HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


class CuttingProxy:
    """Passes requests to `upstream`; `cut_next_stream(n)` breaks the next stream after `n` events."""

    def __init__(self, upstream: str, session: aiohttp.ClientSession) -> None:
        self.upstream, self._session = upstream, session
        self._cut_after: int | None = None
        self.cuts = 0
        """Streams this proxy broke."""

    def cut_next_stream(self, events: int) -> None:
        self._cut_after = events

    async def handle(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=await request.read(), headers=headers
        ) as upstream:
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                return web.Response(status=upstream.status, body=await upstream.read(), headers=kept)
            cut_after, self._cut_after = self._cut_after, None
            return await self._relay(request, upstream, kept, cut_after)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, headers: dict[str, str], cut_after: int | None
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        sent, pending = 0, b""
        async for piece in upstream.content.iter_any():
            pending += piece
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if cut_after is not None and sent >= cut_after:
                    self.cuts += 1
                    assert request.transport is not None
                    request.transport.abort()  # leaving the `async with` drops the engine's stream too
                    return response
                await response.write(event + b"\n\n")
                sent += 1
        await response.write_eof()
        return response


@asynccontextmanager
async def cutting_proxy(upstream: str) -> AsyncIterator[tuple[str, CuttingProxy]]:
    """Serve a `CuttingProxy` in front of `upstream` on 127.0.0.1:0; yield its URL and itself."""
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        proxy = CuttingProxy(upstream, session)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", proxy.handle)
        server = TestServer(app)
        await server.start_server()
        try:
            yield str(server.make_url("")).rstrip("/"), proxy
        finally:
            await server.close()
