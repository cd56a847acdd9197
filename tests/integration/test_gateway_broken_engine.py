"""An engine that breaks the protocol, before the first byte and mid-stream: the client always
gets a well-formed answer (an OpenAI error event then `[DONE]`, or a 502/504 in OpenAI's
shape), and the gateway logs the failure once.

The broken engine is a real sim engine behind a proxy (a real aiohttp app on port 0) that
passes its answers through and, for the fault under test, breaks them at a given event:
an out-of-range token id, tokens after the finish, invalid JSON, an HTML page, a body cut
short, a connection reset, a stall.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.config import Health, Timeouts
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
OUT_OF_VOCABULARY = 10_000_000
STALL_S = 3.0
# Short engine timeouts so a stall ends fast; a circuit that never opens so every case reaches the engine.
TIMEOUTS = Timeouts(idle_s=0.5, first_token_s=0.5, request_s=1.0)
HEALTH = Health(failure_threshold=1000, retries=0, interval_s=60)


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


@pytest.fixture
async def setup(qwen3_tokenizer_dir: Path) -> AsyncIterator[tuple[str, BrokenEngine]]:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        broken_engine(engine_url) as (proxy_url, proxy),
        gateway_server(qwen3_tokenizer_dir, proxy_url, timeouts=TIMEOUTS, health=HEALTH) as (base, _),
    ):
        yield base, proxy


def _body(stream: bool) -> dict[str, Any]:
    return {"model": "sim", "messages": MESSAGES, "max_tokens": 12, "stream": stream}


STREAM_FAULTS = ["oov_token", "invalid_json", "html", "truncate", "reset", "stall"]


_CODES = {502: "engine_failed", 503: "engine_unavailable", 504: "engine_timeout"}


def _status_before_output(kind: str) -> int:
    return 504 if kind == "stall" else 502


def _applies(kind: str, route: str) -> bool:
    # The derender route relays OpenAI chunks: there are no token ids to break.
    return not (route == "derender" and kind in ("oov_token", "after_finish"))


@pytest.mark.parametrize("route", ["derender", "tokens", "text"])
async def test_a_stream_broken_mid_way_ends_with_an_error_event(
    setup: tuple[str, BrokenEngine], route: str, caplog: pytest.LogCaptureFixture
) -> None:
    base, proxy = setup
    async with aiohttp.ClientSession() as session:
        for kind in [k for k in [*STREAM_FAULTS, "after_finish"] if _applies(k, route)]:
            proxy.fault = Fault(kind, at=2)
            caplog.clear()
            headers = {"onehop-route": route}
            async with session.post(base + "/chat/completions", json=_body(True), headers=headers) as resp:
                status, raw = resp.status, await resp.read()
            events = [e for e in raw.split(b"\n\n") if e]
            assert status == 200 and events[-1] == b"data: [DONE]", (kind, raw[-300:])
            errors = [json.loads(e[6:]) for e in events[:-1] if e.startswith(b'data: {"error"')]
            assert len(errors) == 1 and errors[0]["error"]["code"] in ("engine_failed", "engine_timeout"), (kind, raw[-300:])
            assert b"onehop-engine" not in raw, kind  # the engine's comments stay in the gateway
            assert len(_gateway_errors(caplog)) == 1, (kind, _gateway_errors(caplog))


@pytest.mark.parametrize("route", ["derender", "tokens", "text"])
async def test_an_answer_broken_before_the_first_byte_is_a_502_or_504(
    setup: tuple[str, BrokenEngine], route: str, caplog: pytest.LogCaptureFixture
) -> None:
    base, proxy = setup
    async with aiohttp.ClientSession() as session:
        for stream in (True, False):
            for kind in [k for k in STREAM_FAULTS if _applies(k, route)]:
                proxy.fault = Fault(kind, at=0)
                caplog.clear()
                body = _body(stream)
                async with session.post(base + "/chat/completions", json=body, headers={"onehop-route": route}) as resp:
                    status, raw = resp.status, await resp.read()
                # A reset after the request was sent is the engine failing while serving it: a 502,
                # streamed or not, never replayed elsewhere (issue #27).
                expected = _status_before_output(kind)
                assert status == expected, (kind, stream, status, raw[:300])
                error = json.loads(raw)["error"]
                assert error["code"] == _CODES[expected] and error["message"], (kind, stream, error)
                assert len(_gateway_errors(caplog)) == 1, (kind, stream, _gateway_errors(caplog))


async def test_the_openai_sdk_sees_each_failure_as_an_api_error(setup: tuple[str, BrokenEngine]) -> None:
    base, proxy = setup
    async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client:
        for route in ("derender", "tokens"):
            for at in (0, 2):
                for kind in [k for k in STREAM_FAULTS if _applies(k, route)]:
                    proxy.fault = Fault(kind, at=at)
                    route_header = {"onehop-route": route}
                    with pytest.raises(openai.APIError) as raised:
                        stream = await client.chat.completions.create(
                            model="sim", messages=MESSAGES, max_tokens=12, stream=True, extra_headers=route_header
                        )
                        async for _ in stream:
                            pass
                    assert raised.value.message, (route, at, kind)
                proxy.fault = None
                whole = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=3)
                assert whole.choices[0].finish_reason == "length"  # the gateway is still fine


def _gateway_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("gateway") and r.levelno >= logging.ERROR]


async def test_a_request_whose_engine_died_serving_it_is_not_replayed_on_another(qwen3_tokenizer_dir: Path) -> None:
    """Issue #27: a request that killed its engine (a grammar that crashed the engine's library)
    was retried on the next engine of the pool, which died too, and so on. An engine that
    closes the connection after the request reached it, before any answer, now ends that
    request with a 502 naming it; the other engine never sees it. Requests that land on the
    healthy engine are answered as usual."""
    health = Health(failure_threshold=1000, retries=2, interval_s=60)
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        broken_engine(engine_url) as (dying_url, dying),
        broken_engine(engine_url) as (healthy_url, healthy),
        gateway_server(qwen3_tokenizer_dir, [dying_url, healthy_url], health=health) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        dying.fault = Fault("die", at=0)
        answered = 0
        for stream in (False, True):
            dying.generates = 0
            for _ in range(40):  # until the pool's random pick has sent one to the dying engine
                async with session.post(base + "/chat/completions", json=_body(stream)) as resp:
                    status, raw = resp.status, await resp.read()
                if dying.generates:
                    break
                assert status == 200, raw[:300]
                answered += 1
            assert dying.generates == 1, stream
            error = json.loads(raw)["error"]
            assert status == 502 and error["code"] == "engine_failed", (stream, status, error)
            assert "failed while serving this request" in error["message"], error
            assert healthy.generates == answered, (stream, healthy.generates, answered)  # not replayed there
