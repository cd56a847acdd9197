"""Many streams in a row through one gateway to one engine, read slowly: every one answered whole.

The engine's kept-alive connection carries one answer after another. Each
answer here ends in the same burst as a piece the client is behind on (the
splice pauses the engine's socket for it), the shape that once put a paused
connection back in the pool, so that the next request on it was never read
and ended in a 504 although the engine had answered it whole (issue #27).

The engine is a real sim engine behind a proxy (a raw asyncio server on port
0) that sends each streamed `generate` answer as its head and first read, then
everything else, the chunked body's end included, in one write. The clients
are raw HTTP/1.1 sockets with small receive buffers that read a few KiB at a time.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from gateway.config import Timeouts
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

# A long scenario (kills, crashes, hundreds of streams): kept out of the default suite, run
# by CI's `-m slow` stage.
SLOW = pytest.mark.slow

ROUTES = ("derender", "text", "tokens")
STREAMS = 150
READ_BYTES = 2048
"""What a slow client takes from its socket at a time."""
FIRST_TOKEN_S = 10
"""Far above the sim's pace: a request on a connection that is never read ends in a 504 after it."""


class BurstEngine:
    """Proxies every request to `upstream`; a streamed answer goes out as its head and first
    piece, then the rest of its body and the chunked end in one write."""

    def __init__(self, upstream: str, session: aiohttp.ClientSession) -> None:
        self.upstream = upstream
        self.session = session
        self.bursts = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
                )
                body = await reader.readexactly(length)
                await self._answer(writer, method, path, body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes) -> None:
        headers = {"Content-Type": "application/json"}
        async with self.session.request(method, self.upstream + path, data=body or None, headers=headers) as upstream:
            kind = upstream.headers.get("Content-Type", "application/json")
            if not kind.startswith("text/event-stream"):
                data = await upstream.read()
                writer.write(_head(upstream.status, kind, f"Content-Length: {len(data)}") + data)
                await writer.drain()
                return
            first = await upstream.content.readany()
            writer.write(_head(upstream.status, kind, "Transfer-Encoding: chunked") + _chunk(first))
            await writer.drain()
            rest = await upstream.content.read()
        writer.write((_chunk(rest) if rest else b"") + b"0\r\n\r\n")
        await writer.drain()
        self.bursts += 1


def _head(status: int, kind: str, framing: str) -> bytes:
    return f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\n{framing}\r\n\r\n".encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@asynccontextmanager
async def burst_engine(upstream: str) -> AsyncIterator[tuple[str, BurstEngine]]:
    async with aiohttp.ClientSession() as session:
        engine = BurstEngine(upstream, session)
        server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}", engine
        finally:
            server.close()


class SlowClient:
    """One kept-alive HTTP/1.1 connection that reads its answers a little at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> SlowClient:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # the gateway's writes back up at once
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_BYTES)
        return cls(reader, writer)

    async def stream(self, path: str, body: bytes, route: str) -> tuple[int, bytes]:
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nonehop-route: {route}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            return status, await self._chunked()
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        return status, await self.reader.readexactly(length)  # an error before the first byte

    async def _chunked(self) -> bytes:
        body = bytearray()
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if not size:
                await self.reader.readuntil(b"\r\n")
                return bytes(body)
            left = size
            while left:  # a little at a time: the client is slower than the gateway
                piece = await self.reader.read(min(left, READ_BYTES))
                assert piece, "the gateway closed the connection mid-answer"
                body += piece
                left -= len(piece)
            await self.reader.readexactly(2)

    def close(self) -> None:
        self.writer.close()


def _host_port(base: str) -> tuple[str, int]:
    host, port = base.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return host, int(port)


def _request(n: int) -> bytes:
    # Wide logprobs: each token is a few KiB of chunk, so the burst that ends an answer is
    # more than the client's transport takes at once.
    return json.dumps(
        {
            "model": "sim", "messages": [{"role": "user", "content": f"Story {n}, please."}], "stream": True,
            "max_tokens": 40, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
        }
    ).encode()


@SLOW
async def test_many_sequential_slowly_read_streams_on_every_route_all_end_whole(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 1}) as (engine_url, _),
        burst_engine(engine_url) as (proxy_url, proxy),
        gateway_server(qwen3_tokenizer_dir, proxy_url, timeouts=Timeouts(first_token_s=FIRST_TOKEN_S)) as (base, _),
    ):
        host, port = _host_port(base)
        clients = {route: await SlowClient.open(host, port) for route in ROUTES}
        try:
            for n in range(STREAMS):
                route = ROUTES[n % len(ROUTES)]
                async with asyncio.timeout(3 * FIRST_TOKEN_S):
                    status, body = await clients[route].stream("/v1/chat/completions", _request(n), route)
                assert status == 200, (n, route, body[:300])
                events = [event for event in body.split(b"\n\n") if event]
                assert events[-1] == b"data: [DONE]", (n, route, events[-3:])
                finishes = [
                    choice["finish_reason"]
                    for event in events[:-1]
                    for choice in json.loads(event[len(b"data: ") :]).get("choices", [])
                    if choice.get("finish_reason")
                ]
                assert finishes == ["length"], (n, route, events[-3:])
        finally:
            for client in clients.values():
                client.close()
        assert proxy.bursts == STREAMS
