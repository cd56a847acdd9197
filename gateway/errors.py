"""The gateway's errors and their one translation to OpenAI's error JSON.

    GatewayError                  an HTTP status and an OpenAI error `type`
    ├── InvalidRequest      400   malformed or unsupported request (names the field)
    ├── Unauthorized        401
    ├── ModelNotFound       404
    ├── RouteNotFound       404
    ├── MethodNotAllowed    405
    ├── RequestTimeout      408   the request body did not arrive in time
    ├── PayloadTooLarge     413
    ├── UnsupportedMediaType 415  a body that is not JSON (a form, text/plain)
    ├── Unprocessable       422   well-formed but impossible (e.g. prompt longer than the context)
    ├── RateLimited         429
    ├── EngineUnavailable   503   no engine answered
    │   └── EngineTimeout   504   an engine answered too slowly, or went silent
    ├── StreamDeadline      504   a stream ran past `timeouts.stream_deadline_s` (not retried)
    └── EngineFailed        502   an engine answered with an error we cannot pass on as the client's

`gateway_error_middleware` maps every raised exception to one of these;
engine 4xx answers are passed on with the engine's message. After the first
byte of a stream, errors travel in-band (an error event, then `[DONE]`;
`gateway.relay.respond_stream`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from engine.openai_schema import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode


class GatewayError(Exception):
    status = 500
    type = "InternalServerError"
    headers: dict[str, str] | None = None
    """Extra response headers (e.g. `Retry-After` on a 429)."""
    close_connection = False
    """The connection cannot serve another request (its body was never read to the end)."""

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status


class InvalidRequest(GatewayError):
    status = 400
    type = "BadRequestError"


class Unauthorized(GatewayError):
    status = 401
    type = "AuthenticationError"


class ModelNotFound(GatewayError):
    status = 404
    type = "NotFoundError"


class RouteNotFound(GatewayError):
    status = 404
    type = "NotFoundError"


class RequestTimeout(GatewayError):
    status = 408
    type = "RequestTimeoutError"
    close_connection = True


class PayloadTooLarge(GatewayError):
    status = 413
    type = "PayloadTooLargeError"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "UnsupportedMediaTypeError"


class Unprocessable(GatewayError):
    status = 422
    type = "UnprocessableEntityError"


class RateLimited(GatewayError):
    status = 429
    type = "RateLimitError"


class EngineUnavailable(GatewayError):
    status = 503
    type = "ServiceUnavailableError"


class EngineTimeout(EngineUnavailable):
    """The engine did not answer, or stopped answering, in time (a 504; retried like a 503)."""

    status = 504
    type = "GatewayTimeoutError"


class StreamDeadline(GatewayError):
    """A stream lasted longer than `timeouts.stream_deadline_s`: a limit of the gateway's, so
    neither retried on another engine nor held against the engine's circuit."""

    status = 504
    type = "GatewayTimeoutError"


class EngineFailed(GatewayError):
    status = 502
    type = "BadGatewayError"


def error_json(error: GatewayError) -> bytes:
    return _encode(ErrorResponse(error=ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.status)))


def as_gateway_error(exc: BaseException) -> GatewayError:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, web.HTTPException):  # aiohttp's own: an unknown path, a wrong method, a huge body
        kind = _AIOHTTP_KINDS.get(exc.status)
        if kind is None:
            error = GatewayError(exc.text or exc.reason, status=exc.status)
            error.type = _STATUS_TYPES.get(exc.status, "APIError" if exc.status < 500 else "InternalServerError")
            return error
        return kind(exc.text or exc.reason, status=exc.status)
    return GatewayError("internal error")


class MethodNotAllowed(GatewayError):
    status = 405
    type = "MethodNotAllowedError"


_AIOHTTP_KINDS: dict[int, type[GatewayError]] = {
    400: InvalidRequest, 404: RouteNotFound, 405: MethodNotAllowed, 408: RequestTimeout, 413: PayloadTooLarge,
    415: UnsupportedMediaType, 429: RateLimited,
}
_STATUS_TYPES = {422: "UnprocessableEntityError"}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ERROR_KEY = web.RequestKey("onehop_error", str)
"""The class of the error a request was answered with, for the trace's `error.type`."""
REQUEST_ID_KEY = web.RequestKey("onehop_request_id", str)
"""The answer's id (`chatcmpl-...`), also its engine requests' id: the one name a request has in
the gateway's error lines, the access log, the `X-Request-Id` response header and the engines' logs."""


@web.middleware
async def gateway_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = as_gateway_error(exc)
    except Exception as exc:
        error = as_gateway_error(exc)
        _log(request, error, exc)
    request[ERROR_KEY] = type(error).__name__
    response = web.Response(status=error.status, body=error_json(error), content_type="application/json", headers=error.headers)
    if error.close_connection:
        response.force_close()
    return response


def _log(request: web.Request, error: GatewayError, exc: Exception) -> None:
    """One line per server-side failure, named by the request id; a traceback only for an
    exception that is not one of ours (a bug). A client's own mistakes are in the access log."""
    if error.status < 500:
        return
    rid = request.get(REQUEST_ID_KEY, "-")
    if exc is error:
        log.error("%s %s %s failed: %d %s", rid, request.method, request.path, error.status, error.message)
    else:
        log.error("%s %s %s failed: %s", rid, request.method, request.path, type(exc).__name__, exc_info=exc)


class ClientGone(Exception):
    """The client closed the connection while its stream was being written (not an error of ours)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response
