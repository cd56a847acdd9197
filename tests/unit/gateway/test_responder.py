"""The SSE answer's headers leave with its first frame, in one write."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from gateway.relay.responder import SSE_HEADERS, SseResponse
from plumbing.http_server import new_event_loop

FRAME = b"data: {}\n\n"


async def _exchange() -> tuple[bytes, bytes]:
    """What a raw client has received once the handler prepared its answer, and in the first
    read after the handler wrote its first frame (loopback: a write is in the peer's buffer
    when it returns)."""
    prepared, wrote, go = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = SseResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        prepared.set()
        await go.wait()
        await response.write(FRAME)
        wrote.set()
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    loop = asyncio.get_running_loop()
    client = socket.create_connection(("127.0.0.1", port))
    client.setblocking(False)
    try:
        await loop.sock_sendall(client, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await prepared.wait()
        try:
            before = client.recv(65536)
        except BlockingIOError:
            before = b""
        go.set()
        await wrote.wait()
        first = await loop.sock_recv(client, 65536)
        return before, first
    finally:
        client.close()
        await runner.cleanup()


def test_headers_go_out_with_the_first_frame() -> None:
    loop = new_event_loop()
    try:
        before, first = loop.run_until_complete(_exchange())
    finally:
        loop.close()
    assert before == b""  # prepared, nothing sent yet
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"text/event-stream" in first and FRAME in first
