"""Slow, silent and careless clients, and engines slower than a timeout: each bounded.

Real gateways and sim engines on loopback; slow clients are raw sockets. Waits
are bounded in time and count; outcomes are asserted, never durations.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Admission, Timeouts
from tests.support.engine import engine_server, sse_payloads
from tests.support.gateway import gateway_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]


def _host_port(base: str) -> tuple[str, int]:
    hostport = base.split("//", 1)[1].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


async def _read_response(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response with a Content-Length body: (head, body)."""
    async with asyncio.timeout(limit_s):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        return head, await reader.readexactly(length)


async def test_a_trickled_body_gets_a_408_and_holds_no_slot(qwen3_tokenizer_dir: Path) -> None:
    """The slot is taken once the body is in; a body that does not come in `client_body_s` is a 408."""
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(
            qwen3_tokenizer_dir, engine_url, admission=Admission(max_concurrency=1, max_queue=0),
            timeouts=Timeouts(client_body_s=1.0),
        ) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        host, port = _host_port(base)
        slow = []
        for _ in range(4):  # more trickling clients than slots
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{"
            )
            await writer.drain()
            slow.append((reader, writer))
        # While they trickle, others are served: the one slot is free.
        for _ in range(3):
            answer = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4)
            assert answer.choices[0].finish_reason == "length"
        for reader, writer in slow:
            head, body = await _read_response(reader, 10)
            writer.close()
            assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, head
            error = json.loads(body)["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "request_timeout"), error
            assert "client_body_s" in error["message"]


@pytest.mark.parametrize("route", ["derender", "text", "tokens"])
async def test_a_client_that_reads_nothing_is_cut_off_and_its_engine_request_aborted(
    qwen3_tokenizer_dir: Path, route: str
) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, engine),
        gateway_server(
            qwen3_tokenizer_dir, engine_url, admission=Admission(max_concurrency=1, max_queue=0),
            timeouts=Timeouts(client_write_s=0.5),
        ) as (base, state),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        host, port = _host_port(base)
        sock = socket.create_connection((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its buffers fill fast
        body = json.dumps(
            {"model": "sim", "messages": MESSAGES, "max_tokens": 30000, "ignore_eos": True, "stream": True, "logprobs": True,
             "top_logprobs": 20, "n": 4}
        ).encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"onehop-route: {route}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while not state.metrics.engine_aborts._value.get() and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert state.metrics.engine_aborts._value.get() == 1, "the stream of a client that reads nothing was not cut"
            while engine.backend.running() and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert not engine.backend.running()
            # Its slot is free again.
            answer = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4)
            assert answer.choices[0].finish_reason == "length"
        finally:
            sock.close()


WRITE_S = 0.5


async def _stream_unread(host: str, port: int, route: str) -> socket.socket:
    """A streamed request from a client that reads nothing of the answer; returns once the
    answer's head is in its socket (its admission slot is held)."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"model": "sim", "messages": MESSAGES, "max_tokens": 30000, "ignore_eos": True, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"onehop-route: {route}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    await asyncio.to_thread(sock.recv, 1, socket.MSG_PEEK)  # a peek takes nothing from the socket
    return sock


async def test_clients_that_stop_reading_are_cut_after_client_write_s_and_others_get_their_slots(
    qwen3_tokenizer_dir: Path,
) -> None:
    """Cut once `client_write_s` passed without the client taking a byte, however much the
    kernel's send buffer could still hold: this slow engine would take minutes to fill it, and
    the waiting client would get a 503 after `queue_timeout_s` (issue #27)."""
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 20}) as (engine_url, engine),
        gateway_server(
            qwen3_tokenizer_dir, engine_url,
            admission=Admission(max_concurrency=3, max_queue=8, queue_timeout_s=20 * WRITE_S),
            timeouts=Timeouts(client_write_s=WRITE_S),
        ) as (base, state),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        host, port = _host_port(base)
        unread = [await _stream_unread(host, port, route) for route in ("derender", "text", "tokens")]
        try:
            # Every slot is held by a client that reads nothing: this one waits for one of theirs.
            answer = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4)
            assert answer.choices[0].finish_reason == "length"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20 * WRITE_S
            while (state.metrics.engine_aborts._value.get() < 3 or engine.backend.running()) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert state.metrics.engine_aborts._value.get() == 3, "not every stream of a client that reads nothing was cut"
            assert not engine.backend.running()
            assert _requests_by_status(state.metrics.render().decode()) == {"499": 3, "200": 1}
        finally:
            for sock in unread:
                sock.close()


@pytest.mark.parametrize("route", ["derender", "tokens"])
async def test_a_first_token_slower_than_idle_s_is_waited_for(qwen3_tokenizer_dir: Path, route: str) -> None:
    """`first_token_s` bounds the first event and `idle_s` only the gaps after it."""
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"ttft_ms": 1200}) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, timeouts=Timeouts(first_token_s=10, idle_s=0.4)) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            model="sim", messages=MESSAGES, max_tokens=6, stream=True, extra_headers={"onehop-route": route}
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "length"


async def test_completions_with_max_tokens_zero_is_a_400(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, policy=None) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        for create in (
            lambda: client.completions.create(model="sim", prompt="hi", max_tokens=0),
            lambda: client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=0),
        ):
            with pytest.raises(openai.BadRequestError, match="max_tokens"):
                await create()


def _requests_by_status(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "onehop_gateway_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    status = sample.labels["status"]
                    out[status] = out.get(status, 0.0) + sample.value
    return out


async def test_streams_the_client_cut_are_counted_as_499(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 10}) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, state),
        aiohttp.ClientSession() as session,
    ):
        for _ in range(5):
            body: dict[str, Any] = {"model": "sim", "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            response = await session.post(base + "/chat/completions", json=body)
            await response.content.readany()
            response.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while _requests_by_status(state.metrics.render().decode()).get("499", 0) < 5 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert _requests_by_status(state.metrics.render().decode()) == {"499": 5}


async def test_a_lone_engine_that_fails_is_named_as_the_cause(qwen3_tokenizer_dir: Path, unused_tcp_port: int) -> None:
    async with (
        gateway_server(qwen3_tokenizer_dir, f"http://127.0.0.1:{unused_tcp_port}") as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4)
        message = failed.value.body["message"]  # type: ignore[index]
        assert "cannot reach the engine" in message and "Connect call failed" in message, message
        assert "circuit" not in message


def _nested(depth: int) -> str:
    """JSON text of an object nested `depth` levels deep (written out: encoders recurse)."""
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [65, 985, 5000])
async def test_deeply_nested_json_is_a_400_naming_the_field(qwen3_tokenizer_dir: Path, depth: int) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        deep = _nested(depth)
        for path, body in (
            ("/chat/completions", f'{{"model": "sim", "messages": {json.dumps(MESSAGES)}, "chat_template_kwargs": {{"x": {deep}}}}}'),
            ("/chat/completions", f'{{"model": "sim", "messages": {json.dumps(MESSAGES)}, "tools": [{{"type": "function", "function": {{"name": "f", '
             f'"parameters": {deep}}}}}]}}'),
            ("/completions", f'{{"model": "sim", "prompt": "hi", "response_format": {{"type": "text", "x": {deep}}}}}'),
        ):
            async with session.post(base + path, data=body.encode(), headers={"Content-Type": "application/json"}) as response:
                assert response.status == 400, await response.text()
                error = (await response.json())["error"]
                assert "nest" in error["message"]
        # Nesting a real schema has (a few levels) is fine.
        tool = {"type": "function", "function": {"name": "f", "parameters": json.loads(_nested(8))}}
        fine = {"model": "sim", "messages": MESSAGES, "tools": [tool], "max_tokens": 2}
        async with session.post(base + "/chat/completions", json=fine) as response:
            assert response.status == 200, await response.text()


async def test_careless_requests_get_a_clear_error_in_openai_shape(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        chat = base + "/chat/completions"
        body = json.dumps({"model": "sim", "messages": MESSAGES, "max_tokens": 2})
        invalid = "invalid_request_error"
        # (method, url, headers, body, status, (type, code)): OpenAI's types and string codes
        cases: list[tuple[str, str, dict[str, Any], str | bytes | None, int, tuple[str, str | None]]] = [
            ("GET", chat, {}, None, 405, (invalid, "method_not_allowed")),
            ("POST", chat, {"Content-Type": "text/plain"}, body, 415, (invalid, "unsupported_media_type")),
            ("POST", chat, {"Content-Type": "application/x-www-form-urlencoded"}, body, 415, (invalid, "unsupported_media_type")),
            ("POST", base + "/embeddings", {}, json.dumps({"model": "sim", "input": "hi"}), 404, (invalid, "unknown_url")),
            ("POST", chat, {}, json.dumps({"model": "gpt-4o", "messages": MESSAGES}), 404, (invalid, "model_not_found")),
        ]
        for name, value in (
            ("logit_bias", {"999999999": 5}),
            ("allowed_token_ids", [-1]),
            ("stop_token_ids", [10**9]),
            ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
            ("function_call", "auto"),
            ("modalities", ["text", "audio"]),
        ):
            request = json.dumps({"model": "sim", "messages": MESSAGES, name: value})
            cases.append(("POST", chat, {}, request, 400, (invalid, None)))
        cases.append(("POST", chat, {}, json.dumps({"model": "sim", "messages": MESSAGES, "max_tokens": 10**30}), 400, (invalid, None)))
        too_long = json.dumps({"model": "sim", "prompt": [1] * 33000, "max_tokens": 2})
        cases.append(("POST", base + "/completions", {}, too_long, 400, (invalid, "context_length_exceeded")))
        for url, fields in ((chat, {"messages": MESSAGES}), (base + "/completions", {"prompt": "hi"})):
            unknown = json.dumps({"model": "sim", **fields, "foo_bar": 1})
            cases.append(("POST", url, {}, unknown, 400, (invalid, "unknown_parameter")))
        for method, url, headers, data, status, kind in cases:
            headers = {"Content-Type": "application/json", **headers} if data is not None else headers
            async with session.request(method, url, data=data, headers=headers) as response:
                assert response.status == status, (data, await response.text())
                error = (await response.json())["error"]
                assert (error["type"], error["code"]) == kind, (data, error)
                if kind[1] == "unknown_parameter":
                    assert error["param"] == "foo_bar" and "foo_bar" in error["message"], error
        # vLLM's extensions and OpenAI's inert fields are known, not refused.
        known = {"model": "sim", "messages": MESSAGES, "max_tokens": 2, "top_k": 5, "metadata": {"a": "b"}, "store": False}
        async with session.post(chat, json=known) as response:
            assert response.status == 200, await response.text()
        async with session.post(base + "/completions", data=too_long, headers={"Content-Type": "application/json"}) as response:
            message = (await response.json())["error"]["message"]
            assert "maximum context length is 32768 tokens" in message and "33000 input tokens" in message
        # A max_tokens over what the prompt leaves is capped, as vLLM caps it.
        over = {"model": "sim", "prompt": [1] * 32760, "max_tokens": 50, "ignore_eos": True}
        async with session.post(base + "/completions", json=over) as response:
            answer = await response.json()
            assert response.status == 200, answer
            assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"
        # A body without a Content-Type is refused too: a browser's fetch() of a bare body sends
        # none, cross-site, without asking first (curl sends one: -H 'Content-Type: application/json').
        async with session.post(chat, data=body.encode(), skip_auto_headers={"Content-Type"}) as response:
            assert response.status == 415


async def test_by_default_clients_can_neither_pick_the_route_nor_see_the_engines_load(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, route_header=False, policy_header=False) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        raw = await client.chat.completions.with_raw_response.create(
            model="sim", messages=MESSAGES, max_tokens=2, extra_headers={"onehop-route": "tokens"}
        )
        assert raw.headers["onehop-route"] == "derender"  # the config's route, not the client's
        assert "onehop-policy" not in raw.headers


async def test_text_that_cannot_fit_the_context_is_refused_before_render(qwen3_tokenizer_dir: Path) -> None:
    """32768 tokens of at most 128 bytes each (Qwen3's longest token): more text than that
    is refused without rendering or tokenizing it."""
    huge = "word " * 900_000  # 4.5 M characters
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, state),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        for create in (
            lambda: client.completions.create(model="sim", prompt=huge, max_tokens=2),
            lambda: client.chat.completions.create(model="sim", messages=[{"role": "user", "content": huge}], max_tokens=2),
        ):
            with pytest.raises(openai.BadRequestError, match="4500000 characters"):
                await create()
        renders = state.metrics.stage_seconds.labels("render")._sum.get()
        assert renders == 0, "a render ran for text that cannot fit"


@pytest.mark.parametrize("route", ["derender", "text", "tokens"])
async def test_a_stream_past_its_deadline_ends_in_band_and_its_engine_request_is_aborted(
    qwen3_tokenizer_dir: Path, route: str
) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 20}) as (engine_url, engine),
        gateway_server(qwen3_tokenizer_dir, engine_url, timeouts=Timeouts(stream_deadline_s=0.6)) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": "sim", "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with session.post(base + "/chat/completions", json=body, headers={"onehop-route": route}) as response:
            assert response.status == 200
            payloads = [payload async for payload in sse_payloads(response)]
        assert payloads[-1] == b"[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["code"] == "stream_deadline_exceeded" and "stream_deadline_s=0.6" in error["message"], error
        assert len(payloads) < 200, "the stream was not cut at its deadline"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while engine.backend.running() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert not engine.backend.running(), "the engine request outlived the stream's deadline"


async def test_a_deadline_before_the_first_byte_is_a_504_and_not_retried(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"ttft_ms": 3000}) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, timeouts=Timeouts(stream_deadline_s=0.3)) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": "sim", "messages": MESSAGES, "max_tokens": 5, "stream": True}
        for _ in range(3):  # the circuit's failure_threshold
            async with session.post(base + "/chat/completions", json=body) as response:
                assert response.status == 504
                error = (await response.json())["error"]
            assert error["code"] == "stream_deadline_exceeded" and "stream_deadline_s=0.3" in error["message"], error
        # A limit of the gateway's: the engine's circuit is untouched, the next request is served.
        async with session.post(base + "/chat/completions", json=body | {"stream": False}) as response:
            assert response.status == 200
