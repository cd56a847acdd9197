"""A tiny engine on a loopback port that writes a scripted answer, byte piece by byte piece.

For the gateway's readers of engine answers (relay, splice): each request to
`/stream` gets the pieces of the `Script` as separate writes (each flushed, so a
reader sees the splits an engine's socket would give it), and may hold on a
gate before a piece (an engine that stalls, released by the test).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer


@dataclass
class Script:
    """What the engine answers: `pieces` written one by one; before piece `hold_before`, it waits for `gate`."""

    pieces: Sequence[bytes] = ()
    content_type: str = "text/event-stream"
    hold_before: int | None = None
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    served: int = 0
    """Pieces written so far (the test can wait on it)."""


def split_at(body: bytes, cuts: Sequence[int]) -> list[bytes]:
    """`body` cut at the given offsets (empty pieces dropped)."""
    edges = [0, *sorted(cuts), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges) if b > a]


@asynccontextmanager
async def sse_engine(script: Script) -> AsyncIterator[str]:
    """An engine serving `script` on `POST /stream`; yields its base URL."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": script.content_type})
        await response.prepare(request)
        for index, piece in enumerate(script.pieces):
            if index == script.hold_before:
                await script.gate.wait()
            await response.write(piece)
            script.served += 1
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/stream", stream)
    server = TestServer(app)  # loopback, a free port
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        script.gate.set()  # a held handler ends, so the server closes promptly
        await server.close()
