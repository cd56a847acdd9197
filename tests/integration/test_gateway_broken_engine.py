"""An engine that breaks the protocol, before the first byte and mid-stream: the client always
gets a well-formed answer (an OpenAI error event then `[DONE]`, or a 502/504 in OpenAI's
shape), and the gateway logs the failure once.

The broken engine is a real sim engine behind a proxy (`tests.support.broken_engine`) that
passes its answers through and, for the fault under test, breaks them at a given event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from gateway.config import Health, Timeouts
from tests.support.broken_engine import BrokenEngine, Fault, broken_engine
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
# Short engine timeouts so a stall ends fast; a circuit that never opens so every case reaches the engine.
TIMEOUTS = Timeouts(idle_s=0.5, first_token_s=0.5, request_s=1.0)
HEALTH = Health(failure_threshold=1000, retries=0, interval_s=60)


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
