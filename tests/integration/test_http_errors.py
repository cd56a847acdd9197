"""Every error the gateway and the engine send is JSON in the API's shape, and each failure is one
log line named by its request id (issue 14 items 15 and 16).

aiohttp's HTTP parser answers what it cannot parse itself, before any middleware:
plain text and a logged traceback holding the offending bytes, until the runner
answered those as JSON too. Real servers on loopback; the bad requests are raw bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest

from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

SECRET = b"walrus-" * 2000
"""A header value over aiohttp's 8190-byte field limit; none of it may reach a log."""
BAD_REQUESTS = {
    "garbled request line": b"GET /v1/models HTTP/1.1 extra\r\nHost: x\r\n\r\n",
    "oversized header": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Secret: " + SECRET + b"\r\n\r\n",
    "bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "second request line garbled": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET \x00 HTTP/1.1\r\n\r\n",
}


async def _exchange(base: str, raw: bytes) -> bytes:
    """Send `raw` on a fresh connection; everything the server answers before it closes."""
    host, port = base.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()  # the server closes after an error
    finally:
        writer.close()


def _last_response(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the last HTTP response in `answer`."""
    start = answer.rindex(b"HTTP/1.")
    head, body = answer[start:].split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=BAD_REQUESTS.keys())
async def test_what_the_http_parser_refuses_is_json_and_one_log_line(
    qwen3_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    caplog.set_level(logging.INFO)
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _), gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _):
        for server in (base, engine_url):
            caplog.clear()
            status, headers, body = _last_response(await _exchange(server, BAD_REQUESTS[case]))
            assert status == 400 or status == 431, body
            assert headers["content-type"].startswith("application/json")
            error = json.loads(body)["error"]
            # Each in its API's shape: OpenAI's at the gateway, vLLM's at the engine.
            shape = ("invalid_request_error", None) if server == base else ("BadRequestError", status)
            assert (error["type"], error["code"]) == shape, error
            assert error["message"].startswith("malformed HTTP request"), error
            refusals = [r for r in caplog.records if r.name == "plumbing.http_server"]
            assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING, caplog.text
            assert all(r.exc_info is None for r in caplog.records), caplog.text
            assert b"walrus" not in caplog.text.encode() and b"walrus" not in body


async def test_a_server_side_failure_is_one_line_with_the_request_id(
    qwen3_tokenizer_dir: Path, unused_tcp_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A 503 for a dead engine: one ERROR line, without a traceback, naming the request id the client got in `X-Request-Id`."""
    caplog.set_level(logging.INFO)
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        gateway_server(qwen3_tokenizer_dir, f"http://127.0.0.1:{unused_tcp_port}") as (base, _),
        aiohttp.ClientSession() as session,
    ):
        caplog.clear()
        async with session.post(base + "/chat/completions", json=body) as response:
            assert response.status == 503
            rid = response.headers["X-Request-Id"]
            assert (await response.json())["error"]["code"] == "engine_unavailable"
    assert rid.startswith("chatcmpl-")
    failures = [r for r in caplog.records if r.name == "gateway.edge.errors"]
    assert len(failures) == 1, caplog.text
    assert failures[0].levelno == logging.ERROR and failures[0].exc_info is None
    assert rid in failures[0].getMessage() and "503" in failures[0].getMessage()
    assert "Traceback" not in caplog.text


async def test_an_answer_carries_its_id_in_x_request_id(qwen3_tokenizer_dir: Path) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        async with session.post(base + "/chat/completions", json=body) as response:
            assert response.status == 200
            assert response.headers["X-Request-Id"] == (await response.json())["id"]
        async with session.post(base + "/chat/completions", json={**body, "n": 99}) as response:
            assert response.status == 400
            assert response.headers["X-Request-Id"].startswith("chatcmpl-")
