"""The engine server's errors and their one translation to OpenAI-shaped JSON.

    EngineHTTPError             carries an HTTP status and an OpenAI error `type`
    ├── BadRequest        400   the request breaks the contract or this engine's limits
    ├── NotFound          404   unknown model or route
    ├── MethodNotAllowed  405
    ├── Conflict          409   a request id that is already running
    ├── PayloadTooLarge   413   the body is over the configured limit
    └── Unavailable       503   the backend is not ready or is shutting down

Errors raised deeper are mapped here, once, by `error_middleware`:
`ProtocolError`, `DerenderError`, `BackendRequestError` → 400;
`BackendError` → 500. After a stream has started, errors travel in-band
(an error event, then `[DONE]`), handled by the generate handler.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine.backends.base import BackendError, BackendRequestError
from derender.errors import DerenderError
from derender.parsers import UnknownParser
from wire.openai_schema import ErrorInfo, ErrorResponse
from wire.protocol import ProtocolError, encode

log = logging.getLogger(__name__)


class EngineHTTPError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(EngineHTTPError):
    status = 400
    type = "BadRequestError"


class NotFound(EngineHTTPError):
    status = 404
    type = "NotFoundError"


class MethodNotAllowed(EngineHTTPError):
    status = 405
    type = "MethodNotAllowedError"


class PayloadTooLarge(EngineHTTPError):
    status = 413
    type = "PayloadTooLargeError"


class Conflict(EngineHTTPError):
    status = 409
    type = "ConflictError"


class Unavailable(EngineHTTPError):
    status = 503
    type = "ServiceUnavailableError"


def as_http_error(exc: BaseException) -> EngineHTTPError:
    """The HTTP error a raised exception means to the client."""
    if isinstance(exc, EngineHTTPError):
        return exc
    if isinstance(exc, (ProtocolError, DerenderError, BackendRequestError, UnknownParser)):
        return BadRequest(str(exc))
    if isinstance(exc, BackendError):
        return EngineHTTPError(f"backend failed: {exc}")
    return EngineHTTPError("internal error")


def error_body(error: EngineHTTPError) -> bytes:
    return encode(
        ErrorResponse(error=ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.status))
    )


def error_response(error: EngineHTTPError) -> web.Response:
    response = web.Response(status=error.status, body=error_body(error), content_type="application/json")
    if isinstance(error, PayloadTooLarge):
        response.force_close()  # its body was never read: the connection cannot serve another request
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_aiohttp(exc))
    except Exception as exc:
        error = as_http_error(exc)
        log_failure(request, error, exc)
        return error_response(error)


REQUEST_ID_KEY = web.RequestKey("onehop_engine_request_id", str)
"""The generate request's id, once its body is decoded: the name its error lines carry."""


def log_failure(request: web.Request, error: EngineHTTPError, exc: Exception) -> None:
    """One line per server-side failure, named by the request id; a traceback only for an
    exception that is neither ours nor the backend's (a bug). Clients' mistakes are not logged."""
    if error.status < 500:
        return
    rid = request.get(REQUEST_ID_KEY, "-")
    if isinstance(exc, (EngineHTTPError, BackendError)):
        log.error("%s %s %s failed: %d %s", rid, request.method, request.path, error.status, error.message)
    else:
        log.error("%s %s %s failed: %s", rid, request.method, request.path, type(exc).__name__, exc_info=exc)


_AIOHTTP_ERRORS: dict[int, type[EngineHTTPError]] = {404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge}


def _from_aiohttp(exc: web.HTTPException) -> EngineHTTPError:
    kind = _AIOHTTP_ERRORS.get(exc.status)
    if kind is not None:
        return kind(exc.text or exc.reason)
    error = EngineHTTPError(exc.text or exc.reason)
    error.status = exc.status  # keep aiohttp's status for the rare others (e.g. 400 from its parser)
    return error
