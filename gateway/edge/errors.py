"""The gateway's errors and their one translation to OpenAI's error JSON.

Every error is `{"error": {"message", "type", "param", "code"}}` with OpenAI's
`type` vocabulary and a string (or null) `code`, as OpenAI's own API answers
and as client libraries match on (`context_length_exceeded`, `model_not_found`,
`invalid_api_key`, `rate_limit_exceeded`):

    GatewayError                  status  type / code
    ├── InvalidRequest      400   invalid_request_error / null, or a named code
    │                             (`context_length_exceeded`, `unknown_parameter`)
    ├── Unauthorized        401   invalid_request_error / invalid_api_key
    ├── ModelNotFound       404   invalid_request_error / model_not_found
    ├── RouteNotFound       404   invalid_request_error / unknown_url
    ├── NotFound            404   invalid_request_error / null (a stored response that is not here)
    ├── MethodNotAllowed    405   invalid_request_error / method_not_allowed
    ├── RequestTimeout      408   invalid_request_error / request_timeout (the body did not arrive in time)
    ├── PayloadTooLarge     413   invalid_request_error / request_too_large
    ├── UnsupportedMediaType 415  invalid_request_error / unsupported_media_type (a form, text/plain)
    ├── Unprocessable       422   invalid_request_error / null (well-formed but impossible)
    ├── RateLimited         429   requests / rate_limit_exceeded
    │   └── QuotaExceeded   429   tokens or requests / rate_limit_exceeded (a tenant's quota)
    ├── EngineUnavailable   503   server_error / engine_unavailable (no engine answered)
    │   ├── EngineTimeout   504   server_error / engine_timeout (too slow, or went silent)
    │   └── EngineRoutesOff 503   server_error / engine_unavailable (a 403: its generate API is off)
    ├── StateUnavailable    503   server_error / state_unavailable (the shared store did not answer)
    ├── Saturated           503   server_error / overloaded (admission: slots busy, queue full or wait too long)
    ├── StreamDeadline      504   server_error / stream_deadline_exceeded (not retried)
    └── EngineFailed        502   server_error / engine_failed (an answer we cannot pass on)
        └── EngineDied      502   server_error / engine_failed (the connection closed while the
                                  engine served it: not replayed on another engine)

`gateway_error_middleware` maps every raised exception to one of these;
engine 4xx answers are passed on with the engine's message. After the first
byte of a stream, errors travel in-band (an error event, then `[DONE]`;
`gateway.relay.responder.Responder.stream`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from wire.openai_schema import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] | None = None
    """Extra response headers (e.g. `Retry-After` on a 429)."""
    close_connection = False
    """The connection cannot serve another request (its body was never read to the end)."""
    logged = True
    """A 5xx writes an error line; one the gateway sheds on purpose, by the thousand under
    overload, is counted in its metric instead."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code: str | None = "invalid_api_key"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code: str | None = "model_not_found"


class RouteNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code: str | None = "unknown_url"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code: str | None = "request_timeout"
    close_connection = True


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code: str | None = "request_too_large"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"
    code: str | None = "unsupported_media_type"


class Unprocessable(GatewayError):
    status = 422
    type = "invalid_request_error"


class RateLimited(GatewayError):
    status = 429
    type = "requests"
    code: str | None = "rate_limit_exceeded"


class QuotaExceeded(RateLimited):
    """A tenant's quota (`tenants.NAME.tokens_per_minute`, ...) holds less than the request
    needs: its type says which kind of limit, as OpenAI's does (`tokens` or `requests`)."""


class EngineUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code: str | None = "engine_unavailable"


class EngineTimeout(EngineUnavailable):
    """The engine did not answer, or stopped answering, in time (a 504; retried like a 503)."""

    status = 504
    type = "server_error"
    code: str | None = "engine_timeout"


class EngineRoutesOff(EngineUnavailable):
    """The engine answered 403 to the generate API (stock vLLM without `--enable-scale-out`):
    it is healthy, it just serves none of the gateway's routes; another engine is tried."""


class StateUnavailable(GatewayError):
    """The shared state (`state:`, the Responses store) did not answer in `state.timeout_s`, or
    refused: only the requests that need it fail, and they may be retried once it is back. Not
    an engine's failure: never retried on another engine, never held against one's circuit."""

    status = 503
    type = "server_error"
    code: str | None = "state_unavailable"


class Saturated(GatewayError):
    """The gateway's pool is saturated (`gateway.edge.admission`): every slot is busy and the
    queue is full, or the wait for a slot ran out. Not the tenant's fault, so not a 429: a 503
    with `Retry-After`, as llm-d's flow control sheds."""

    status = 503
    type = "server_error"
    code: str | None = "overloaded"
    logged = False  # onehop_gateway_admission_rejections_total counts them


class StreamDeadline(GatewayError):
    """A stream lasted longer than `timeouts.stream_deadline_s`: a limit of the gateway's, so
    neither retried on another engine nor held against the engine's circuit."""

    status = 504
    type = "server_error"
    code: str | None = "stream_deadline_exceeded"


class EngineFailed(GatewayError):
    status = 502
    type = "server_error"
    code: str | None = "engine_failed"


class EngineDied(EngineFailed):
    """The engine closed the connection (or reset it) after the request was sent, before its
    answer ended. The request may be what killed it (a grammar that crashed its library
    took a whole pool down as it was retried on each engine: issue #27), so it is never
    replayed elsewhere: the client gets a 502 saying so."""


def error_json(error: GatewayError) -> bytes:
    return _encode(
        ErrorResponse(error=ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code))
    )


def status_error_json(status: int, message: str) -> bytes:
    """The body for an error the HTTP parser raised (the gateway's `ERROR_BODY`)."""
    return error_json(status_error(status, message))


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's code for a prompt over the context: what litellm, pydantic-ai and LangChain match
to fall back to a model with a larger context."""


def status_error(status: int, message: str) -> GatewayError:
    """The error for a status someone else chose (aiohttp, an engine, vLLM's render service).
    A refusal in vLLM's context-length words gets OpenAI's `context_length_exceeded` code."""
    kind = _STATUS_KINDS.get(status)
    error = kind(message, status=status) if kind is not None else GatewayError(message, status=status)
    if kind is None and status < 500:
        error.type = "invalid_request_error"
    return with_context_code(error)


def with_context_code(error: GatewayError) -> GatewayError:
    """A 400 in vLLM's words for a prompt over the context gets OpenAI's code for it."""
    if error.status == 400 and "maximum context length" in error.message:
        error.code = CONTEXT_LENGTH_EXCEEDED
    return error


def as_gateway_error(exc: BaseException) -> GatewayError:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, web.HTTPException):  # aiohttp's own: an unknown path, a wrong method, a huge body
        return status_error(exc.status, exc.text or exc.reason)
    return GatewayError("internal error")


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code: str | None = "method_not_allowed"


_STATUS_KINDS: dict[int, type[GatewayError]] = {
    400: InvalidRequest, 404: RouteNotFound, 405: MethodNotAllowed, 408: RequestTimeout, 413: PayloadTooLarge,
    415: UnsupportedMediaType, 429: RateLimited, 431: InvalidRequest,
}


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
    body = _error_body(request, error)
    response = web.Response(status=error.status, body=body, content_type="application/json", headers=error.headers)
    if error.close_connection:
        response.force_close()
    # The error's traceback holds this frame, whose `error` holds the error: kept, that cycle
    # would keep the request and everything it made until the cyclic collector ran.
    del error
    return response


ErrorBody = Callable[[GatewayError], bytes]
ERROR_BODIES: web.AppKey[dict[str, ErrorBody]] = web.AppKey("onehop_error_bodies")
"""Path prefixes whose API has its own error shape (Anthropic's on /v1/messages), and its writer."""


def _error_body(request: web.Request, error: GatewayError) -> bytes:
    for prefix, body in request.app.get(ERROR_BODIES, {}).items():
        if request.path.startswith(prefix):
            return body(error)
    return error_json(error)


def _log(request: web.Request, error: GatewayError, exc: Exception) -> None:
    """One line per server-side failure, named by the request id; a traceback only for an
    exception that is not one of ours (a bug). A client's own mistakes are in the access log."""
    if error.status < 500 or not error.logged:
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
