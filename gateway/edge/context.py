"""What the pipeline knows about one request, as plain values (no aiohttp `Request`).

    Edge            built where the request arrives, before its body is read: its id,
                    the caller (tenant, owner), its headers, the server span, the
                    arrival time and deadline, the tally its outcome is made from
    RequestContext  the edge, once the body is decoded: the model, the session, and
                    after routing the decided target

Both are frozen: a step that learns something returns a new context (`with_target`).
The one mutable part is the `Tally`, the request's account of what it became (route,
tokens, finish reasons), which the observe middleware turns into the outcome event.
Steps after the edge take a context, so routing, the engine requests and the answer
can be driven by anything that builds one, not only by an aiohttp handler.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web
from opentelemetry.trace import INVALID_SPAN, Span

from gateway.edge.auth import TENANT_KEY, owner
from gateway.edge.quota import Decision
from gateway.upstream.engine_client import Target
from gateway.observe.outcome import Outcome, Tally
from gateway.serving.runtime import ModelRuntime

SPAN_KEY = web.RequestKey("onehop_span", Span)
"""The server span the observe middleware opened."""
STARTED_KEY = web.RequestKey("onehop_started", float)
"""perf_counter() at the request's arrival, for time to first token and the stream deadline."""
TALLY_KEY = web.RequestKey("onehop_tally", Tally)
"""What the request became, for its outcome event and its answer's headers."""
OUTCOME_KEY = web.RequestKey("onehop_outcome", Outcome)
"""The request's outcome, once emitted: what its access log line reports."""
QUOTA_KEY = web.RequestKey("onehop_quota", Decision)
"""The tenant quota's decision for an admitted request, for its answer's rate-limit headers."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    """What is known of a request where it arrives, before its body is read."""

    request_id: str
    """The answer's id (`chatcmpl-...`): also the engine requests' id, the logs' and `X-Request-Id`."""
    endpoint: str
    """chat, completions, responses or messages."""
    tenant: str | None
    owner: str
    """Whose stored responses the request may read (`gateway.edge.auth.Caller.owner`)."""
    headers: Mapping[str, str]
    """The request's headers (case-insensitive lookups)."""
    span: Span
    started: float
    """perf_counter() at arrival."""
    deadline: float | None
    """perf_counter() by which the answer must have ended (`timeouts.stream_deadline_s` from
    arrival); None: no bound."""
    tally: Tally

    @classmethod
    def of(cls, http: web.Request, endpoint: str, request_id: str, deadline_s: float | None) -> Edge:
        """The edge of `http`; a request the observe middleware did not see gets a tally of its
        own and the no-op span (no outcome is emitted for it)."""
        tally = http.get(TALLY_KEY)
        started: float = http.get(STARTED_KEY, time.perf_counter())  # aiohttp types get() as Any, whatever the key
        return cls(
            request_id=request_id,
            endpoint=endpoint,
            tenant=http.get(TENANT_KEY),
            owner=owner(http),
            headers=http.headers,
            span=http.get(SPAN_KEY, INVALID_SPAN),
            started=started,
            deadline=None if deadline_s is None else started + deadline_s,
            tally=tally if tally is not None else Tally(),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestContext(Edge):
    """The edge and what the decoded request settled: the model, the session, and (once
    routing decided) the target."""

    model: ModelRuntime
    model_name: str
    """The name the answer carries: the client's, which may be an alias of `model.name`."""
    session: str | None
    """The conversation's key (`gateway.flow.session`), sent to engines as `X-Session-ID`."""
    priority: int = 0
    """The request's priority (`gateway.edge.priority`): its place in the admission queue, and
    the engines' `priority`."""
    target: Target | None = None

    @classmethod
    def decoded(
        cls, edge: Edge, model: ModelRuntime, model_name: str | None, session: str | None, priority: int = 0
    ) -> RequestContext:
        edge.tally.model = model.name
        known = {field.name: getattr(edge, field.name) for field in dataclasses.fields(Edge)}
        return cls(**known, model=model, model_name=model_name or model.name, session=session, priority=priority)

    def with_target(self, target: Target, reason: str) -> RequestContext:
        """The context once routing decided; the route and its reason go on the tally (the
        answer's headers and the outcome name them)."""
        self.tally.route, self.tally.reason, self.tally.engine = target.route, reason, target.endpoint.url
        return dataclasses.replace(self, target=target)

    @property
    def routed(self) -> Target:
        """The decided target (only steps after routing ask)."""
        if self.target is None:
            raise RuntimeError("the request was not routed yet")
        return self.target
