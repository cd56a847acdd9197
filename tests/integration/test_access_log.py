"""The access log: never a query string (clients put keys there); the request's trace id, and
its outcome's status (a stream that failed after its 200 headers is logged as the failure it was)."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from engine.config import EngineConfig
from gateway.config import EngineEndpoint, GatewayConfig
from gateway.edge.access_log import AccessLogger
from gateway.serving.app import create_app
from plumbing.http_server import Runner
from plumbing.telemetry import TracingConfig
from onehop.serve import embedded
from tests.support.broken_engine import Fault, broken_engine
from tests.support.engine import engine_server
from tests.support.otlp import otlp_receiver

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "aiohttp.access"]


async def test_a_key_in_the_query_string_stays_out_of_the_access_log(
    qwen3_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim")
    async with (
        embedded(engine, host="127.0.0.1", port=0, route="derender") as running,
        aiohttp.ClientSession() as session,
        session.get(running.url + "/v1/models?api_key=sk-secret-walrus-42") as response,
    ):
        assert response.status == 200
    lines = _lines(caplog)
    assert any('"GET /v1/models" 200' in line for line in lines), lines
    assert "sk-secret-walrus-42" not in caplog.text


async def test_each_line_names_the_requests_trace(qwen3_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The line's last field is the trace id the answer's `traceresponse` names (`-` where no trace is)."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    async with otlp_receiver() as receiver:
        engine = EngineConfig(
            backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim",
            tracing=TracingConfig(endpoint=receiver.url),
        )
        async with embedded(engine, host="127.0.0.1", port=0, route="text") as running, aiohttp.ClientSession() as session:
            async with session.post(running.url + "/v1/chat/completions", json=CHAT) as response:
                await response.read()
                trace, request_id = response.headers["traceresponse"].split("-")[1], response.headers["X-Request-Id"]
            async with session.post(running.url + "/v1/chat/completions", json={**CHAT, "model": "nope"}) as refused:
                await refused.read()
                refused_trace = refused.headers["traceresponse"].split("-")[1]
            async with session.get(running.url + "/health") as health:
                assert health.status == 200
    chat, missing, probe = _lines(caplog)
    assert chat.startswith("127.0.0.1 ") and chat.endswith(f" {request_id} {trace}"), chat
    assert '"POST /v1/chat/completions" 404' in missing and missing.endswith(f" {refused_trace}"), missing
    assert probe.endswith(" - -"), probe  # no request id, no trace


async def test_a_stream_broken_after_its_headers_is_logged_with_its_errors_status(
    qwen3_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client got 200 headers, then an error event: the line says 502, as the metrics do."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        broken_engine(engine_url) as (proxy_url, proxy),
    ):
        config = GatewayConfig(model="sim", tokenizer=str(qwen3_tokenizer_dir), engines=[EngineEndpoint(url=proxy_url)])
        gateway = Runner(create_app(config), handler_cancellation=True, access_log_class=AccessLogger)
        await gateway.setup()
        try:
            await web.TCPSite(gateway, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{gateway.addresses[0][1]}/v1/chat/completions"
            proxy.fault = Fault("reset", at=2)
            async with aiohttp.ClientSession() as session, session.post(url, json={**CHAT, "stream": True}) as response:
                assert response.status == 200
                assert b'data: {"error"' in await response.read()
        finally:
            await gateway.cleanup()
    (line,) = [line for line in _lines(caplog) if "/v1/chat/completions" in line]
    assert '"POST /v1/chat/completions" 502 ' in line, line
