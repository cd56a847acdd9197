"""The gateway's access log: one line per request, without query strings.

aiohttp's default line carries the request line, query string included, and
clients do send secrets there (`?api_key=...`, signed URLs). This logger
writes the method, the path alone, the status, the size, the time, the
request id (the answer's id, `-` where there is none), which the error lines carry too,
and the trace id (`-` with tracing off, or for a path that opens no trace).

The status of an API request is its outcome's (`gateway.observe.outcome`): 499 for a
client that left mid-answer, an error's status for a stream that ended with an error
event after its 200 headers, so the line agrees with the metrics and the trace.
"""

from __future__ import annotations

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from plumbing.telemetry import trace_id
from gateway.edge.context import OUTCOME_KEY, SPAN_KEY
from gateway.edge.errors import REQUEST_ID_KEY


class AccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        outcome = request.get(OUTCOME_KEY)
        span = request.get(SPAN_KEY)
        self.logger.info(
            '%s "%s %s" %s %s %.3fs %s %s',
            request.remote,
            request.method,
            request.path,  # never `path_qs`: the query may hold a key
            outcome.status if outcome is not None else response.status,
            response.body_length,
            time,
            request.get(REQUEST_ID_KEY, "-"),
            (trace_id(span) if span is not None else None) or "-",
        )
