"""Streamed engine answers, read in the engine socket's own callbacks.

aiohttp's client hands every chunk of a body to the reading task through a
stream reader: a parser callback, a future, a task step and a generator step
per chunk, and more Python around each read than the relay itself spends. A
streamed `generate` to a plain-`http://` engine is instead one HTTP/1.1
exchange on a connection of this module's pool: the response head parsed
once, the chunked body decoded in `data_received`, and what it carries either
kept for `readany()` (the reads before the client's first byte, made by the
request's task) or given at once to a sink (`splice`: the rest of the stream,
written to the client from the same callback).

Connections are kept alive between answers that end whole, for at most
`KEEPALIVE_S` idle (a server closes idle connections too); an answer left
before its end closes its connection, and the engine sees its client leave.
The pool holds only connections whose last answer was read whole and whose
socket is being read: a connection given back with its reading paused (a
splice paused it for a client that fell behind, and the answer ended in the
same read) is read again first, else closed, since the next answer on a socket
nobody reads never arrives (issue #27: streams that ended in a 504 although
the engine had answered them whole).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
from yarl import URL

from gateway.edge.errors import EngineDied, EngineFailed, EngineUnavailable

MAX_HEAD_BYTES = 64 * 1024
"""A response head (status line and headers) longer than this is not an engine's."""
MAX_LINE_BYTES = 4096
"""A chunk-size line longer than this is not HTTP."""
HIGH_WATER = 256 * 1024
"""Body bytes kept for `readany()` past which the socket is not read until they are taken."""
_JOINED_BODY_BYTES = 64 * 1024
"""A request body up to this is sent in one write with its head (one syscall); a larger one
apart from it (a copy of the body costs more than the second write)."""
_CHUNKED, _LENGTH, _UNTIL_CLOSE = 0, 1, 2
_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(6)

Sink = Callable[[bytes], None]
End = Callable[[BaseException | None], None]


class EngineResponse:
    """One streamed answer: `status` and `headers` (names lower-cased) once the head is in,
    then the body through `readany()`, or through a sink once `splice`d."""

    __slots__ = (
        "_buffer", "_connection", "_end", "_error", "_framing", "_head", "_parts", "_paused",
        "_released", "_remaining", "_sink", "_size", "_state", "_waiter", "answered", "headers", "keep_alive", "status",
    )

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self._state = _HEAD
        self._buffer = b""
        """Bytes not yet parsed: the head, a chunk-size line or the CRLF after a chunk, when cut."""
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._framing = _CHUNKED
        self._remaining = 0
        self._parts: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self._released = False
        self._sink: Sink | None = None
        self._end: End | None = None
        self.answered = False
        """Whether any byte of an answer came (a reused connection that closes before is retried)."""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False

    @property
    def content(self) -> EngineResponse:
        """Read like aiohttp's `response.content` (`readany`)."""
        return self

    @property
    def complete(self) -> bool:
        return self._state == _DONE

    async def head(self) -> None:
        await self._head

    # ------------------------------------------------------------ reading on a task

    async def readany(self) -> bytes:
        """What came since the last read; b"" at the end of the body."""
        while not self._parts and self._state != _DONE and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._parts:
            piece = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
            self._parts, self._size = [], 0
            if self._paused:
                self.resume_reading()
            return piece
        if self._error is not None:
            raise self._error
        return b""

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while piece := await self.readany():
            parts.append(piece)
        return b"".join(parts)

    # ------------------------------------------------------------ reading in callbacks

    def splice(self, sink: Sink, end: End) -> None:
        """From now on each decoded piece goes to `sink` as it arrives, and `end` is called
        once, with the failure or None, when the body ends; what `readany` had not taken yet
        goes first."""
        self._sink, self._end = sink, end
        if self._parts:
            piece = b"".join(self._parts)
            self._parts, self._size = [], 0
            sink(piece)
        if self._paused and self._sink is not None:
            self.resume_reading()
        if self._error is not None or self._state == _DONE:
            self._finish_sink()

    def unsplice(self) -> None:
        self._sink = self._end = None

    def pause_reading(self) -> None:
        if not self._paused:
            self._paused = True
            self._connection.pause_reading()

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            self._connection.resume_reading()

    # ------------------------------------------------------------ the owner's side

    def release(self) -> None:
        """Done with this answer: a whole one gives its connection back to the pool."""
        if self._released:
            return
        self._released = True
        self.unsplice()
        self._connection.finished(self, reusable=self._state == _DONE and self.keep_alive and self._error is None)

    def close(self) -> None:
        self.release()

    # ------------------------------------------------------------ the connection's side

    def feed(self, data: bytes) -> None:
        if self._state == _SIZE and not self._buffer:
            # The usual arrival on a stream: one whole chunk, `size CRLF data CRLF`, its size in
            # the lowercase hex servers write (any other spelling takes the general parser).
            line = data.find(b"\r\n", 0, 18)
            size = len(data) - line - 4
            if line > 0 and size > 0 and data.endswith(b"\r\n") and data[:line] == b"%x" % size:
                piece = data[line + 2 : -2]
                sink = self._sink
                if sink is not None:
                    sink(piece)
                else:
                    self._deliver(piece)
                return
        self.answered = True
        if self._state == _DONE:
            self.keep_alive = False  # bytes after the answer: this connection is not reused
            return
        try:
            if self._state == _HEAD:
                data = self._feed_head(data)
            pieces = self._decode(data) if data and self._state != _DONE else []
            if self._state == _DONE and self._buffer:
                self.keep_alive = False
        except EngineFailed as exc:
            self.fail(exc)
            return
        if pieces:
            self._deliver(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if self._state == _DONE:
            self._finished()

    def _deliver(self, piece: bytes) -> None:
        if self._sink is not None:
            self._sink(piece)
            return
        self._parts.append(piece)
        self._size += len(piece)
        if self._size > HIGH_WATER:
            self.pause_reading()
        self._wake()

    def eof(self, exc: BaseException | None) -> None:
        """The connection closed (`exc`: how, when it broke)."""
        if self._state == _DONE:
            return
        if self._state != _HEAD and self._framing == _UNTIL_CLOSE and exc is None:
            self._state = _DONE
            self._finished()
            return
        where = "before its answer's head" if self._state == _HEAD else "mid-answer"
        reason = f": {exc}" if exc is not None else ""
        self.fail(
            EngineDied(
                "the engine stream broke: the engine failed while serving this request"
                f" (the connection closed {where}{reason}); it is not retried on another engine"
            )
        )

    def fail(self, exc: BaseException) -> None:
        if self._error is not None or self._state == _DONE:
            return
        self._error = exc
        if not self._head.done():
            self._head.set_exception(exc)
        self._wake()
        if self._sink is not None:
            self._finish_sink()
        self._connection.broken()

    def _finished(self) -> None:
        self._wake()
        if self._sink is not None:
            self._finish_sink()

    def _finish_sink(self) -> None:
        end = self._end
        self._sink = self._end = None
        if end is not None:
            end(self._error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------ HTTP/1.1

    def _feed_head(self, data: bytes) -> bytes:
        buffer = self._buffer + data if self._buffer else data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                raise EngineFailed(f"the engine's answer has a head over {MAX_HEAD_BYTES} bytes")
            self._buffer = buffer
            return b""
        self._buffer = b""
        head, rest = buffer[:end], buffer[end + 4 :]
        lines = head.decode("latin-1").split("\r\n")
        version, _, status = lines[0].partition(" ")
        code = status[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise EngineFailed(f"the engine's answer is not HTTP/1.1: {lines[0][:120]!r}")
        if code.startswith("1"):  # an interim answer (100 Continue): the real one follows
            return self._feed_head(rest) if rest else b""
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise EngineFailed(f"the engine's answer has a broken header: {line[:120]!r}")
            headers[name.strip().lower()] = value.strip()
        self.status, self.headers = int(code), headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = version == "HTTP/1.1" and "close" not in connection
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing, self._state = _CHUNKED, _SIZE
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise EngineFailed(
                    f"the engine's answer has a broken Content-Length: {headers['content-length']!r}"
                ) from None
            self._framing = _LENGTH
            self._state = _DATA if self._remaining else _DONE
        else:
            self._framing, self._state, self.keep_alive = _UNTIL_CLOSE, _DATA, False
        self._head.set_result(None)
        return rest

    def _decode(self, data: bytes) -> list[bytes]:
        """The body bytes in `data`, the framing taken off."""
        if self._framing == _UNTIL_CLOSE:
            return [data]
        if self._framing == _LENGTH:
            piece = data[: self._remaining]
            self._remaining -= len(piece)
            if not self._remaining:
                self._state = _DONE
                self.keep_alive = self.keep_alive and len(piece) == len(data)
            return [piece] if piece else []
        out: list[bytes] = []
        if self._buffer:
            data, self._buffer = self._buffer + data, b""
        pos, size = 0, len(data)
        while pos < size:
            state = self._state
            if state == _DATA:
                end = pos + self._remaining
                if end > size:
                    out.append(data[pos:])
                    self._remaining = end - size
                    return out
                out.append(data[pos:end])
                pos, self._state = end, _DATA_END
            elif state in (_SIZE, _TRAILER):
                end = data.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_LINE_BYTES:
                        raise EngineFailed("the engine's chunked answer has a line over 4096 bytes")
                    self._buffer = data[pos:]
                    return out
                line = data[pos:end]
                pos = end + 2
                if state == _TRAILER:
                    if not line:
                        self._state = _DONE
                        self.keep_alive = self.keep_alive and pos == size  # nothing may follow the answer
                        return out
                    continue
                try:
                    chunk = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise EngineFailed(f"the engine's chunked answer is broken: {line[:40]!r}") from None
                if chunk < 0:
                    raise EngineFailed(f"the engine's chunked answer is broken: {line[:40]!r}")
                self._state, self._remaining = (_DATA, chunk) if chunk else (_TRAILER, 0)
            elif state == _DATA_END:
                if size - pos < 2:
                    self._buffer = data[pos:]
                    return out
                if data[pos : pos + 2] != b"\r\n":
                    raise EngineFailed("the engine's chunked answer is broken: no CRLF after a chunk")
                pos += 2
                self._state = _SIZE
            else:  # _DONE: what follows is not this answer's
                return out
        return out


EngineAnswer = aiohttp.ClientResponse | EngineResponse
"""An engine's answer: this module's for streams from `http://` engines, aiohttp's otherwise."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one answer at a time."""

    __slots__ = ("_key", "_pool", "idle_since", "lost", "response", "transport")

    def __init__(self, pool: StreamPool, key: tuple[str, int]) -> None:
        self._pool = pool
        self._key = key
        self.transport: asyncio.Transport | None = None
        self.response: EngineResponse | None = None
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing was asked: a server that talks out of turn is not reused
            self._close()
            return
        response.feed(data)

    def eof_received(self) -> bool:
        if self.response is not None:
            self.response.eof(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.response is not None:
            self.response.eof(exc)
        self._pool.forget(self)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    def broken(self) -> None:
        """The answer broke the protocol: this connection is not read again."""
        self._close()

    def finished(self, response: EngineResponse, *, reusable: bool) -> None:
        if self.response is not response:
            return
        self.response = None
        if reusable and not self.lost:
            response.resume_reading()  # whatever its reader did: a kept connection is read
            self._pool.keep(self._key, self)
        else:
            self._close()

    @property
    def reusable(self) -> bool:
        """Open, between answers, and read (its next answer arrives)."""
        transport = self.transport
        return (
            self.response is None and not self.lost and transport is not None
            and not transport.is_closing() and transport.is_reading()
        )

    def _close(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.close()

    def send(self, request: tuple[bytes, ...]) -> EngineResponse:
        assert self.transport is not None and self.response is None
        response = self.response = EngineResponse(self)
        try:
            for part in request:
                self.transport.write(part)
        except (OSError, RuntimeError) as exc:  # closed under us: nothing was answered (a kept one is retried)
            response.fail(EngineFailed(f"the engine stream broke: cannot send: {exc}"))
        return response


class StreamPool:
    """Keep-alive connections to engines, for streamed answers (plain `http://` only)."""

    def __init__(self, connect_s: float, keepalive_s: float) -> None:
        self._connect_s = connect_s
        self._keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    @staticmethod
    def serves(url: str) -> bool:
        return URL(url).scheme == "http"

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> EngineResponse:
        """POST `body` to `url`; returns once the answer's head is in. A reused connection the
        server closed before answering (its keep-alive ran out meanwhile) is retried once on a
        new one: nothing was answered."""
        target = URL(url)
        host, port = target.host or "127.0.0.1", target.port or 80
        request = _request(target, host, port, body, headers)
        key = (host, port)
        connection = self._take(key)
        if connection is not None:
            response = connection.send(request)
            try:
                await _head(response)
                return response
            except EngineFailed as exc:
                if response.answered:
                    raise
                # Closed under a kept connection: its keep-alive ran out, or the engine died
                # serving this request. An engine that then refuses a new connection did die.
                try:
                    connection = await self._connect(host, port, key)
                except EngineUnavailable as refused:
                    raise EngineDied(
                        f"{exc.message}; then it refused a new connection ({refused.message})"
                    ) from refused
                response = connection.send(request)
                await _head(response)
                return response
        connection = await self._connect(host, port, key)
        response = connection.send(request)
        await _head(response)
        return response

    async def _connect(self, host: str, port: int, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_s):
                _, protocol = await loop.create_connection(lambda: _Connection(self, key), host, port)
        except TimeoutError:
            raise EngineUnavailable(f"cannot connect to the engine within {self._connect_s} s") from None
        except OSError as exc:
            raise EngineUnavailable(f"cannot reach the engine: {exc}") from exc
        return protocol

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if connection.reusable and now - connection.idle_since < self._keepalive_s:
                return connection
            connection._close()
        return None

    def keep(self, key: tuple[str, int], connection: _Connection) -> None:
        """Keep `connection` for a later answer; one that is not `reusable` is closed instead."""
        if not connection.reusable:
            connection._close()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(key, []).append(connection)

    def forget(self, connection: _Connection) -> None:
        idle = self._idle.get(connection._key)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection._close()
        self._idle.clear()


async def _head(response: EngineResponse) -> None:
    try:
        await response.head()
    except BaseException:  # a failure, a timeout, a client that left: this connection is not reused
        response.close()
        raise


def _request(target: URL, host: str, port: int, body: bytes, headers: dict[str, Any]) -> tuple[bytes, ...]:
    """The request's bytes, to write in order: one piece, or the head and a large body apart
    (a 140K-token prompt's ~1 MB body is not copied to put 200 bytes before it)."""
    path = target.raw_path_qs or "/"
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return (head, body) if len(body) > _JOINED_BODY_BYTES else (head + body,)
