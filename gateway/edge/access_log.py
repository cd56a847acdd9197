"""The gateway's access log: one line per request, without query strings.

aiohttp's default line carries the request line, query string included, and
clients do send secrets there (`?api_key=...`, signed URLs). This logger
writes the method, the path alone, the status, the size, the time and the
request id (the answer's id, `-` where there is none), which the error lines carry too.
"""

from __future__ import annotations

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from gateway.edge.errors import REQUEST_ID_KEY


class AccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        self.logger.info(
            '%s "%s %s" %s %s %.3fs %s',
            request.remote,
            request.method,
            request.path,  # never `path_qs`: the query may hold a key
            response.status,
            response.body_length,
            time,
            request.get(REQUEST_ID_KEY, "-"),
        )
