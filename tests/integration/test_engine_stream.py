"""The gateway's client for streamed engine answers, against scripted HTTP servers on loopback:
every framing, cut at every byte; keep-alive and its limits; what breaks."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from gateway.upstream.engine_stream import EngineResponse, StreamPool
from gateway.edge.errors import EngineFailed, EngineUnavailable

BODY = b'data: {"choices": []}\n\n' * 3 + b"data: [DONE]\n\n"


def chunked(body: bytes, sizes: list[int], spell: bytes = b"%x") -> bytes:
    out, pos = b"", 0
    for size in sizes:
        out += spell % size + b"\r\n" + body[pos : pos + size] + b"\r\n"
        pos += size
    assert pos == len(body)
    return out + b"0\r\n\r\n"


def head(extra: str) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{extra}\r\n".encode()


ANSWERS = {
    "chunked": head("Transfer-Encoding: chunked\r\n") + chunked(BODY, [22, 22, 22, len(BODY) - 66]),
    "chunked, extensions and trailers": head("Transfer-Encoding: chunked\r\n")
    + chunked(BODY, [len(BODY)])[:-5] + b"0;last=1\r\nX-Trailer: 1\r\n\r\n",
    "chunked, sizes in upper case and zero-padded": head("Transfer-Encoding: chunked\r\n")
    + chunked(BODY, [26, 30, len(BODY) - 56], spell=b"%X")[:-5] + chunked(b"", [], spell=b"%04x"),
    "chunked, zero-padded sizes": head("Transfer-Encoding: chunked\r\n") + chunked(BODY, [26, 30, len(BODY) - 56], spell=b"%04x"),
    "content-length": head(f"Content-Length: {len(BODY)}\r\n") + BODY,
}


class Scripted:
    """An HTTP server that answers each request with `answer(n)` (n: the request's number), written in
    `cuts` pieces; it counts connections."""

    def __init__(
        self, answer: Callable[[int], bytes], cuts: list[int] | None = None, close: bool = False, go: asyncio.Event | None = None
    ) -> None:
        self.answer = answer
        self.cuts = cuts or []
        self.close = close
        self.go = go
        """When given, each piece after an answer's first waits for it to be set (and clears it)."""
        self.connections = 0
        self.requests = 0
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.requests += 1
                data = self.answer(self.requests)
                bounds = [0, *[c for c in self.cuts if 0 < c < len(data)], len(data)]
                for start, end in itertools.pairwise(bounds):
                    if start and self.go is not None:
                        await self.go.wait()
                        self.go.clear()
                    writer.write(data[start:end])
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()


@asynccontextmanager
async def serving(script: Scripted) -> AsyncIterator[str]:
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/inference/v1/generate"
    finally:
        server.close()


async def read_all(response: EngineResponse) -> bytes:
    parts = []
    while piece := await response.readany():
        parts.append(piece)
    return b"".join(parts)


@pytest.mark.parametrize("framing", list(ANSWERS))
async def test_every_framing_cut_at_every_byte_reads_the_same_body(framing: str) -> None:
    answer = ANSWERS[framing]
    for cut in range(1, len(answer)):
        script = Scripted(lambda n: answer, cuts=[cut])
        pool = StreamPool(connect_s=2, keepalive_s=5)
        async with serving(script) as url:
            response = await pool.post(url, b"{}", {"Content-Type": "application/json"})
            assert (response.status, response.headers["content-type"]) == (200, "text/event-stream")
            assert await read_all(response) == BODY, (framing, cut)
            assert response.complete
            response.release()
        pool.close()


async def test_a_body_until_close_is_read_whole_and_its_connection_not_kept() -> None:
    script = Scripted(lambda n: head("") + BODY, close=True)
    pool = StreamPool(connect_s=2, keepalive_s=5)
    async with serving(script) as url:
        for _ in range(2):
            response = await pool.post(url, b"{}", {})
            assert await read_all(response) == BODY
            response.release()
    assert script.connections == 2
    pool.close()


async def test_whole_answers_reuse_one_connection_and_an_idle_one_past_keepalive_is_not() -> None:
    script = Scripted(lambda n: ANSWERS["chunked"])
    pool = StreamPool(connect_s=2, keepalive_s=0.2)
    async with serving(script) as url:
        for _ in range(3):
            response = await pool.post(url, b"{}", {})
            await read_all(response)
            response.release()
        assert (script.connections, script.requests) == (1, 3)
        await asyncio.sleep(0.3)
        response = await pool.post(url, b"{}", {})
        await read_all(response)
        response.release()
        assert script.connections == 2
    pool.close()


async def test_an_answer_left_before_its_end_closes_its_connection() -> None:
    script = Scripted(lambda n: head("Transfer-Encoding: chunked\r\n") + b"5\r\nhello\r\n")  # and then nothing
    pool = StreamPool(connect_s=2, keepalive_s=5)
    async with serving(script) as url:
        response = await pool.post(url, b"{}", {})
        assert await response.readany() == b"hello"
        response.close()
        await asyncio.wait_for(script.closed.wait(), 5)  # the engine sees its client leave


async def test_a_kept_connection_the_server_closes_unanswered_is_retried_on_a_new_one() -> None:
    script = Scripted(lambda n: ANSWERS["chunked"])
    pool = StreamPool(connect_s=2, keepalive_s=5)
    async with serving(script) as url:
        response = await pool.post(url, b"{}", {})
        await read_all(response)
        response.release()
        # The second request finds the kept connection closing (its keep-alive ran out meanwhile).
        script.answer = lambda n: b"" if n == 2 else ANSWERS["chunked"]
        script.close = True
        response = await pool.post(url, b"{}", {})
        assert await read_all(response) == BODY
    assert (script.connections, script.requests) == (2, 3)
    pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        head("Transfer-Encoding: chunked\r\n") + b"zz\r\nhello\r\n0\r\n\r\n",  # not a size
        head("Transfer-Encoding: chunked\r\n") + b"5\r\nhelloXX0\r\n\r\n",  # no CRLF after the data
        head("Transfer-Encoding: chunked\r\n") + b"5\r\nhel",  # cut, then the connection closes
        head(f"Content-Length: {len(BODY) + 10}\r\n") + BODY,  # shorter than it said
        b"<html>oops</html>\r\n\r\n",  # not HTTP
    ],
)
async def test_a_broken_answer_is_an_engine_failure(answer: bytes) -> None:
    script = Scripted(lambda n: answer, close=True)
    pool = StreamPool(connect_s=2, keepalive_s=5)
    async with serving(script) as url:
        with pytest.raises(EngineFailed):
            response = await pool.post(url, b"{}", {})
            await read_all(response)
    pool.close()


async def test_an_error_status_is_read_whole(unused_tcp_port: int) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no"}}, status=400)

    app = web.Application()
    app.router.add_post("/inference/v1/generate", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    pool = StreamPool(connect_s=2, keepalive_s=5)
    try:
        response = await pool.post(f"http://127.0.0.1:{unused_tcp_port}/inference/v1/generate", b"{}", {})
        assert response.status == 400
        assert b'"no"' in await response.read()
        response.release()
    finally:
        pool.close()
        await runner.cleanup()


async def test_no_engine_there_is_unavailable(unused_tcp_port: int) -> None:
    pool = StreamPool(connect_s=2, keepalive_s=5)
    with pytest.raises(EngineUnavailable):
        await pool.post(f"http://127.0.0.1:{unused_tcp_port}/inference/v1/generate", b"{}", {})


# ------------------------------------------------------------ the pool keeps only connections that are read
# A connection given back paused is never read again: the next answer on it never arrives (issue #27).

ANSWER_WAIT_S = 10
"""A guard: an answer on loopback comes at once, one on a connection nobody reads never does."""


def _splice_pausing(response: EngineResponse) -> asyncio.Future[bytes]:
    """Splice the body to a sink that pauses the socket at every piece and never resumes it, as
    a splice for a client that fell behind does; the future is the body, once it ended."""
    got: list[bytes] = []
    body: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def sink(piece: bytes) -> None:
        got.append(piece)
        response.pause_reading()

    def end(failure: BaseException | None) -> None:
        if failure is not None:
            body.set_exception(failure)
        else:
            body.set_result(b"".join(got))

    response.splice(sink, end)
    return body


async def test_an_answer_paused_in_the_read_that_ends_it_leaves_its_connection_read() -> None:
    """The head first; the whole body, its end included, in one write once the splice is on."""
    go = asyncio.Event()
    script = Scripted(lambda n: ANSWERS["chunked"], cuts=[ANSWERS["chunked"].index(b"\r\n\r\n") + 4], go=go)
    pool = StreamPool(connect_s=2, keepalive_s=5)
    async with serving(script) as url:
        for _ in range(3):
            response = await asyncio.wait_for(pool.post(url, b"{}", {}), ANSWER_WAIT_S)
            body = _splice_pausing(response)
            go.set()
            assert await asyncio.wait_for(body, ANSWER_WAIT_S) == BODY
            response.release()
    assert (script.connections, script.requests) == (1, 3)  # kept, and read again
    pool.close()


async def test_a_whole_answer_its_reader_paused_is_read_again_once_released() -> None:
    script = Scripted(lambda n: ANSWERS["content-length"])
    pool = StreamPool(connect_s=2, keepalive_s=5)
    async with serving(script) as url:
        for _ in range(3):
            response = await asyncio.wait_for(pool.post(url, b"{}", {}), ANSWER_WAIT_S)
            assert await read_all(response) == BODY
            response.pause_reading()  # whatever the caller did after the end
            response.release()
    assert (script.connections, script.requests) == (1, 3)
    pool.close()


async def test_an_answer_released_half_read_and_paused_is_not_reused() -> None:
    script = Scripted(lambda n: ANSWERS["chunked"] if n > 1 else ANSWERS["chunked"][:-20], cuts=[])
    pool = StreamPool(connect_s=2, keepalive_s=5)
    async with serving(script) as url:
        response = await pool.post(url, b"{}", {})
        assert await response.readany()
        response.pause_reading()
        assert not response.complete
        response.release()
        response = await asyncio.wait_for(pool.post(url, b"{}", {}), ANSWER_WAIT_S)
        assert await read_all(response) == BODY
        response.release()
    assert (script.connections, script.requests) == (2, 2)
    pool.close()
