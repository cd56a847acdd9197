"""aiohttp's server, answering its own errors in the API's shape (the gateway and the engine).

A request aiohttp's HTTP parser refuses (a garbled request line, a header over
its size limit, a bad chunked body) never reaches the application or its error
middleware: aiohttp answers it itself, in plain text, and logs a full
traceback, the offending bytes included. `Runner` swaps in a connection
handler that answers such a request with JSON of the same status in the app's
error shape (`ERROR_BODY`: the gateway speaks OpenAI's, the engine vLLM's) and
logs one line naming the error's class, without the bytes.

Connections are bounded in time too (`ConnectionLimits`, from the app's
`CONNECTION_LIMITS`): an idle kept-alive connection is closed after
`keepalive_s` (aiohttp's own default is 3,630 s: 1,100 idle sockets once
locked every new client out), and a connection that starts a request but has
not sent its complete headers within `header_s` is closed (a slow-header
client holds a socket and a parser buffer for free otherwise). Every answer on a
connection that stays open says so in `Keep-Alive: timeout=N` (whole seconds of
`keepalive_s`): Node's fetch (undici) keeps an idle connection 4 s unless the
server names its own bound (then up to 10 minutes, less a second of margin), so
without it a Node agent opens a new connection for every turn that follows a tool
run of more than 4 s, and under `--workers N` lands on a random worker
(docs/gateway.md: the render cache under several workers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.web_protocol import RequestHandler

from wire.openai_schema import ENCODER, ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

ErrorBody = Callable[[int, str], bytes]
ERROR_BODY: web.AppKey[ErrorBody] = web.AppKey("onehop_error_body")
"""How an app shapes the errors its HTTP parser refuses (status, message → JSON body);
without it, vLLM's shape (`vllm_error_body`)."""

KEEPALIVE_S = 75.0
"""nginx's and aiohttp's historical default: above the gateway's and common clients' own idle
pool timeouts (the gateway drops idle engine connections after 4 s), so a client never sends
on a connection this side is closing."""
HEADER_S = 20.0
"""From a request's first byte to its last header byte (nginx's client_header_timeout is 60 s;
a real client sends its headers in one write)."""


@dataclass(frozen=True)
class ConnectionLimits:
    keepalive_s: float = KEEPALIVE_S
    """An idle kept-alive connection is closed after this long."""
    header_s: float = HEADER_S
    """A request's headers must be complete this long after its first byte, else the connection is closed."""


CONNECTION_LIMITS = web.AppKey("onehop_connection_limits", ConnectionLimits)
"""The app's connection time bounds; without it, `ConnectionLimits()`'s defaults."""


def keepalive_header(keepalive_s: float) -> str:
    """The `Keep-Alive` value for an idle bound of `keepalive_s`: whole seconds, rounded down, so a
    client never counts on more than the server keeps (0: do not reuse it)."""
    return f"timeout={math.floor(keepalive_s)}"


async def advertise_keepalive(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: name the idle bound on every answer whose connection stays open."""
    if _stays_open(request, response):
        limits = request.app.get(CONNECTION_LIMITS, ConnectionLimits())
        response.headers[hdrs.KEEP_ALIVE] = keepalive_header(limits.keepalive_s)


def _stays_open(request: web.Request, response: web.StreamResponse) -> bool:
    """What aiohttp has just written into the headers (`keep_alive` is settled before this signal)."""
    connection = response.headers.get(hdrs.CONNECTION, "").lower()
    if request.version < HttpVersion11:  # HTTP/1.0 closes unless both sides said keep-alive
        return connection == "keep-alive"
    return bool(response.keep_alive) and connection != "close"

_TYPES = {400: "BadRequestError", 408: "RequestTimeoutError", 413: "PayloadTooLargeError", 431: "BadRequestError"}


def vllm_error_body(status: int, message: str) -> bytes:
    """vLLM's error shape: a class-like `type`, the status as `code`."""
    error = ErrorInfo(message=message, type=_TYPES.get(status, "InternalServerError"), param=None, code=status)
    return ENCODER.encode(ErrorResponse(error=error))


def _message(exc: BaseException | None, status: int) -> str:
    if status >= 500:
        return "internal error"
    name = type(exc).__name__ if exc is not None else "malformed request"
    if name == "LineTooLong":
        return "malformed HTTP request: a request line or header is longer than this server accepts"
    return f"malformed HTTP request ({name})"


class _JSONErrorHandler(RequestHandler):
    _header_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        idle = not self._request_in_progress and not self._messages
        super().data_received(data)
        if self._messages:  # a whole request head arrived
            self._stop_header_timer()
        elif idle and data and self._header_timer is None and self.transport is not None:
            # The first bytes of a request head: the rest must follow within header_s.
            header_s = self._server().header_s
            self._header_timer = self._loop.call_later(header_s, self._headers_late, header_s)

    def _server(self) -> _JSONErrorServer:
        server = self._manager
        assert isinstance(server, _JSONErrorServer)  # the server that made this handler; None once lost
        return server

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self, header_s: float) -> None:
        self._header_timer = None
        if self._request_in_progress or self._messages or self.transport is None:
            return  # the head did come (its body is the handler's to time)
        log.info("closed a connection from %s: its request headers did not arrive within %g s", self.peername, header_s)
        self.force_close()

    async def _handle_request(self, request: web.BaseRequest, *args: Any) -> Any:
        self._stop_header_timer()  # bytes that came just before are the body's, not a new head's
        return await super()._handle_request(request, *args)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        text = _message(exc, status)
        if status >= 500:  # an exception that escaped every middleware: a bug, so its traceback
            log.error("request from %s failed outside the application: %s", request.remote, exc, exc_info=exc)
        else:
            log.warning("refused a request from %s: %d %s", request.remote, status, text)
        if request.writer.output_size > 0:  # the response has started: the connection is all we can end
            raise ConnectionError("the response has started; cannot send an error")
        body = self._server().error_body(status, text)
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


class _JSONErrorServer(web.Server):
    error_body: ErrorBody = staticmethod(vllm_error_body)
    header_s: float = HEADER_S

    def __call__(self) -> RequestHandler:
        return _JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """`web.AppRunner` whose connections answer aiohttp's own errors as JSON and keep (and
    advertise) the app's `ConnectionLimits`."""

    async def _make_server(self) -> web.Server:
        limits = self.app.get(CONNECTION_LIMITS, ConnectionLimits())
        self._kwargs.setdefault("keepalive_timeout", limits.keepalive_s)  # the connections' own setting
        if not self.app.frozen:  # the app's signals close when it starts (in the call below)
            self.app.on_response_prepare.append(advertise_keepalive)
        server = await super()._make_server()
        # Built by aiohttp itself (its signature changes between releases); only the
        # connection factory differs, and that subclass adds no state of its own.
        server.__class__ = _JSONErrorServer
        assert isinstance(server, _JSONErrorServer)
        server.error_body = self.app.get(ERROR_BODY, vllm_error_body)
        server.header_s = limits.header_s
        return server


def run_app(
    app: web.Application,
    *,
    host: str,
    port: int,
    loop: asyncio.AbstractEventLoop,
    reuse_port: bool = False,
    **runner_args: Any,
) -> None:
    """Serve `app` until SIGINT or SIGTERM, then shut down gracefully (as `web.run_app` does);
    `reuse_port`: share the port with other processes (SO_REUSEPORT)."""

    async def serve() -> None:
        runner = Runner(app, handler_cancellation=True, **runner_args)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        loop.run_until_complete(serve())
    finally:
        loop.close()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is built, else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
