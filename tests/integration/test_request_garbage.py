"""A request leaves no reference cycles behind: what it made is freed by reference counts when
it ends, not left for the cyclic collector.

A cycle anywhere in a request's objects (a route holding the exchange that holds it, a watch
holding its stream, an error whose traceback holds the frame that holds the error) keeps the
whole request (the aiohttp request, its body, the answer's buffers) until a collection finds
it, and every request's leftovers make the collector run more and walk more, with the loop
stopped (a full walk took 25–55 ms under a 128-stream burst, docs/performance.md).

The gateway and a sim engine run in this process (`onehop serve`'s `embedded`). After one
round of warm-up traffic, the collector saves what it finds (`gc.DEBUG_SAVEALL`) through a
second round of the same traffic: chat on every route, whole and streamed, completions with one
prompt and several, Responses and Messages whole and streamed, a 400, a 404 and a client that
leaves mid-stream on each route. No object of onehop's packages or of aiohttp's server may be among it.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine.config import EngineConfig
from gateway.serving.state import GATEWAY
from onehop.serve import Embedded, embedded

OURS = ("gateway.", "engine.", "wire.", "derender.", "plumbing.", "onehop.", "aiohttp.web")
ROUTES = ("derender", "text", "tokens")
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
SETTLE_S = 10.0


@pytest.fixture
async def running(qwen3_tokenizer_dir: Path) -> AsyncIterator[Embedded]:
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim")
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as served:
        yield served


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], route: str, status: int = 200) -> bytes:
    async with session.post(url, json=body, headers={"onehop-route": route}) as response:
        answer = await response.read()
        assert response.status == status, answer[:300]
        return answer


async def _traffic(session: aiohttp.ClientSession, base: str) -> None:
    """One of every kind of request the gateway serves, and the ways they fail."""
    for route in ROUTES:
        await _post(session, f"{base}/v1/chat/completions", CHAT, route)
        streamed = await _post(session, f"{base}/v1/chat/completions", {**CHAT, "stream": True}, route)
        assert streamed.endswith(b"data: [DONE]\n\n")
        await _post(session, f"{base}/v1/completions", {"model": "sim", "prompt": "hi", "max_tokens": 5}, route)
        await _post(session, f"{base}/v1/completions", {"model": "sim", "prompt": ["a", "b"], "max_tokens": 5}, route)
        await _post(session, f"{base}/v1/chat/completions", {**CHAT, "messages": []}, route, status=400)
    for stream in (False, True):
        responses = {"model": "sim", "input": "hi", "max_output_tokens": 16, "stream": stream}
        await _post(session, f"{base}/v1/responses", responses, "derender")
        await _post(session, f"{base}/v1/messages", {**CHAT, "stream": stream}, "derender")
    await _post(session, f"{base}/v1/chat/completions", {**CHAT, "model": "nowhere"}, "derender", status=404)
    cut = {**CHAT, "stream": True, "max_tokens": 2000}
    for route in ROUTES:
        async with session.post(f"{base}/v1/chat/completions", json=cut, headers={"onehop-route": route}) as response:
            assert response.status == 200
            await response.content.readline()  # one line of the stream, then the client leaves


async def _settled(running: Embedded) -> None:
    """Until the cut requests' handlers, their aborts and their outcomes are done."""
    state = running.gateway[GATEWAY]
    async with asyncio.timeout(SETTLE_S):
        while state.gate.in_use or state.background:
            await asyncio.sleep(0.05)


async def test_requests_of_every_kind_leave_no_reference_cycles(running: Embedded) -> None:
    async with aiohttp.ClientSession() as session:
        await _traffic(session, running.url)  # lazily built tables, kept connections
        await _settled(running)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await _traffic(session, running.url)
            await _settled(running)
            gc.collect()
        finally:
            gc.set_debug(0)
            garbage = [type(item) for item in gc.garbage]
            gc.garbage.clear()
    cyclic = Counter(f"{kind.__module__}.{kind.__qualname__}" for kind in garbage if kind.__module__.startswith(OURS))
    assert not cyclic, f"objects freed only by the cyclic collector: {cyclic.most_common(20)}"
