"""An engine that breaks the protocol on purpose: a proxy (a real aiohttp app on port 0) in front
of a real engine that passes its answers through and, for the fault set, breaks them at a given
event: an out-of-range token id, tokens after the finish, invalid JSON, an HTML page, a body cut
short, a connection reset (an engine that died mid-answer), a stall."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

OUT_OF_VOCABULARY = 10_000_000
STALL_S = 3.0


@dataclass
class Fault:
    kind: str
    at: int
    """Events of the real answer passed on before the fault (0: before the client's first byte)."""


class BrokenEngine:
    """Proxies every path to a real engine; `fault` breaks the generate answers."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.fault: Fault | None = None
        self.session: aiohttp.ClientSession | None = None
        self.generates = 0
        """Generate requests that reached this engine."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        if request.path.endswith("/generate"):
            self.generates += 1
            if self.fault is not None and self.fault.kind == "die":  # as a process that crashed on it
                assert request.transport is not None
                request.transport.abort()
                return web.Response()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        url = self.upstream + request.path_qs
        async with self.session.request(request.method, url, data=body, headers=headers) as upstream:
            if self.fault is None or not request.path.endswith("/generate"):
                return web.Response(status=upstream.status, body=await upstream.read(), headers=_kept(upstream))
            if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                return await self._stream(request, upstream, self.fault)
            return await self._whole(request, await upstream.read(), self.fault)

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse, fault: Fault) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = [event + b"\n\n" for event in (await upstream.read()).split(b"\n\n") if event]
        data = [k for k, event in enumerate(events) if event.startswith(b"data: {")]
        if fault.kind == "after_finish":  # a token chunk again after the chunk that finished
            last = data[-1]
            events.insert(last + 1, events[data[0]])
        else:
            cut = data[fault.at] if fault.at < len(data) else len(events)
            head, events = events[:cut], events[cut:]
            for event in head:
                await response.write(event)
            if fault.kind == "oov_token":
                events[0] = _with_token(events[0])
            elif fault.kind == "invalid_json":
                events.insert(0, b'data: {"choices": [{"index": 0, "tok\n\n')
            elif fault.kind == "html":
                await response.write(b"<html><body><h1>502 Bad Gateway</h1></body></html>\n")
                return response  # returned without `[DONE]`: aiohttp ends the chunked body cleanly
            elif fault.kind == "truncate":
                return response
            elif fault.kind == "reset":
                assert request.transport is not None
                request.transport.abort()
                return response
            elif fault.kind == "stall":
                await asyncio.sleep(STALL_S)
                return response
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    async def _whole(self, request: web.Request, body: bytes, fault: Fault) -> web.StreamResponse:
        if fault.kind == "oov_token":
            return web.Response(body=_with_token(b"data: " + body)[6:], content_type="application/json")
        if fault.kind == "invalid_json":
            return web.Response(body=body[: len(body) // 2], content_type="application/json")
        if fault.kind == "html":
            return web.Response(text="<html><body>oops</body></html>", content_type="text/html")
        if fault.kind == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if fault.kind == "truncate":  # half the body it announced, then the connection ends
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(body)
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
            assert request.transport is not None
            request.transport.close()
            return response
        if fault.kind == "stall":
            await asyncio.sleep(STALL_S)
        return web.Response(body=body, content_type="application/json")


def _kept(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "onehop-engine-summary")}


def _with_token(event: bytes) -> bytes:
    """An engine event (`data: {...}`) whose first choice carries a token id no tokenizer has."""
    payload = json.loads(event[len(b"data: ") :])
    payload["choices"][0]["token_ids"] = [OUT_OF_VOCABULARY]
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@asynccontextmanager
async def broken_engine(upstream: str) -> AsyncIterator[tuple[str, BrokenEngine]]:
    engine = BrokenEngine(upstream)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine.handle)
    server = TestServer(app)
    await server.start_server()
    async with aiohttp.ClientSession() as session:
        engine.session = session
        try:
            yield str(server.make_url("")).rstrip("/"), engine
        finally:
            await server.close()
