"""aiohttp's server, answering its own errors in the API's shape (the gateway and the engine).

A request aiohttp's HTTP parser refuses (a garbled request line, a header over
its size limit, a bad chunked body) never reaches the application or its error
middleware: aiohttp answers it itself, in plain text, and logs a full
traceback, the offending bytes included. `Runner` swaps in a connection
handler that answers such a request with JSON of the same status in the app's
error shape (`ERROR_BODY`: the gateway speaks OpenAI's, the engine vLLM's) and
logs one line naming the error's class, without the bytes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from engine.openai_schema import ENCODER, ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

ErrorBody = Callable[[int, str], bytes]
ERROR_BODY = web.AppKey("onehop_error_body", ErrorBody)
"""How an app shapes the errors its HTTP parser refuses (status, message → JSON body);
without it, vLLM's shape (`vllm_error_body`)."""

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
        body = self._manager.error_body(status, text)  # type: ignore[union-attr]
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


class _JSONErrorServer(web.Server):
    error_body: ErrorBody = staticmethod(vllm_error_body)  # type: ignore[assignment]

    def __call__(self) -> RequestHandler:
        return _JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """`web.AppRunner` whose connections answer aiohttp's own errors as JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Built by aiohttp itself (its signature changes between releases); only the
        # connection factory differs, and that subclass adds no state of its own.
        server.__class__ = _JSONErrorServer
        server.error_body = self.app.get(ERROR_BODY, vllm_error_body)  # type: ignore[attr-defined]
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
