"""A real onehop engine on a loopback port, and small clients for its wire format."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp.test_utils import TestServer

from engine.app import create_app
from engine.config import EngineConfig
from plumbing.http_server import Runner
from engine.state import ENGINE, EngineState


class AppServer(TestServer):
    """aiohttp's test server on the runner `onehop` serves with (aiohttp's own errors as JSON)."""

    async def _make_runner(self, **kwargs: Any) -> Runner:
        return Runner(self.app, **kwargs)


@asynccontextmanager
async def engine_server(tokenizer_dir: Path, **config: Any) -> AsyncIterator[tuple[str, EngineState]]:
    """Start the engine on a free port with the sim backend (unless told otherwise), serving
    the model `sim` (the name `gateway_server` configures)."""
    config.setdefault("backend", "sim")
    config.setdefault("served_model_name", "sim")
    server = AppServer(create_app(EngineConfig(model=str(tokenizer_dir), **config)), handler_cancellation=True)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), server.app[ENGINE]
    finally:
        await server.close()


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any, dict[str, str]]:
    async with session.post(url, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        return resp.status, (msgspec.json.decode(raw) if raw else None), dict(resp.headers)


async def sse_payloads(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """`data:` payloads of an SSE response, ending at `[DONE]` (comments skipped)."""
    buffer = b""
    async for piece in resp.content.iter_any():
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:]


async def stream_events(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[list[Any], list[bytes]]:
    """(decoded JSON events, raw SSE bytes) of a whole stream."""
    async with session.post(url, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    events = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: ") and event != b"data: [DONE]":
            events.append(msgspec.json.decode(event[6:]))
    return events, raw.split(b"\n\n")


async def wait_healthy(session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Until the server process at `url` answers `/health` with 200; fails if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{url} exited with {process.returncode}"
        try:
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not come up within {timeout_s} s")
