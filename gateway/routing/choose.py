"""Choose the route and the engine for one request: the override header, else the policy.

The policy decides against what the picked engine serves (its probed output
modes, minus the gateway-parsed routes when onehop lacks the model's parsers,
minus a stock vLLM's derender for what its form cannot answer)
and its live load; a rule that names a pool moves the request to that pool,
and the route is decided again against what that pool's engines serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.upstream import vllm_derender
from gateway.config import ROUTES, Route
from gateway.edge.context import RequestContext
from gateway.upstream.engine_client import EngineClient, Target
from gateway.edge.errors import EngineUnavailable, InvalidRequest
from gateway.observe.spans import measured
from gateway.routing.datastore import Endpoint
from gateway.routing.picker import RequestFacts
from gateway.routing.policy import EngineState, NoRoute, RequestFeatures, decide
from gateway.serving.state import GatewayState

ROUTE_HEADER = "onehop-route"
"""Request header that picks the route (when the config allows it); the response names the route taken."""
GATEWAY_PARSED = frozenset({"text", "tokens"})
"""Routes on which the gateway itself parses reasoning and tool calls."""


@dataclass(frozen=True, slots=True)
class Decision:
    """A route for a request, and why: `basis` is a bounded label (rule name, `cost`,
    `default`, `header`), `reason` the policy's words for the answer's header and the trace."""

    route: Route
    basis: str
    reason: str
    pool: str | None
    """The pool a rule sent the request to (None: the model's main pool, or already there)."""


async def choose_route(
    state: GatewayState, ctx: RequestContext, features: RequestFeatures, prompt: Sequence[int]
) -> RequestContext:
    """`ctx` with the route and engine for it, decided in a `policy` span (the decision goes on
    the server span too)."""
    model = ctx.model
    facts = RequestFacts(
        prompt=prompt,
        session=ctx.session,
        tenant=ctx.tenant,
        constraint=features.constraint,
        cache_salt=state.salts.salt(ctx.tenant, features.cache_salt),
        priority=ctx.priority,
    )
    with measured(state, "policy", ctx.span) as span:
        engines = model.engines
        choice, available = await engines.pick_serving(facts)
        decision = decide_route(state, ctx, engines, choice.endpoint, available, features)
        pool = decision.pool
        if pool is not None:
            engines = model.pools[pool]  # `decide_route` names only pools this model has
            choice, available = await engines.pick_serving(facts)
            decision = decide_route(state, ctx, engines, choice.endpoint, available, features)
        endpoint, why = choice.endpoint, choice.why
        if span.is_recording():
            described = {
                "onehop.route": decision.route, "onehop.policy.rule": decision.basis,
                "onehop.policy.reason": decision.reason,
            }
            if pool is not None:
                described["onehop.pool"] = pool
            if why is not None:
                described["onehop.engine.choice"] = why
            span.set_attributes(described)
            ctx.span.set_attributes({**described, "onehop.engine.endpoint": endpoint.url})
    metrics = state.metrics
    metrics.child(metrics.policy_decisions, decision.route, decision.basis).inc()
    reason = decision.reason if why is None else f"{decision.reason}; engine by {why}"
    return ctx.with_target(Target(decision.route, engines, choice, facts), reason)


def decide_route(
    state: GatewayState,
    ctx: RequestContext,
    engines: EngineClient,
    endpoint: Endpoint,
    available: frozenset[str],
    features: RequestFeatures,
) -> Decision:
    """The override header if allowed, else the policy's decision against what `endpoint`
    serves and its live load."""
    model = ctx.model
    if features.endpoint == "chat" and not model.parses_locally:
        available = available - GATEWAY_PARSED  # a capability fallback: the engine must parse
    if "derender" in available and endpoint.vllm_derender and not vllm_derender.serves(features):
        available = available - {"derender"}  # stock vLLM's derender: non-streaming chat only
    wanted = ctx.headers.get(ROUTE_HEADER)
    if wanted and state.config.route_header:
        if wanted not in ROUTES:
            raise InvalidRequest(f"{ROUTE_HEADER} must be one of {', '.join(ROUTES)}", param=ROUTE_HEADER)
        if wanted not in available:
            raise InvalidRequest(f"route {wanted!r} is not available on this engine", param=ROUTE_HEADER)
        return Decision(ROUTES[ROUTES.index(wanted)], "header", f"{ROUTE_HEADER} header", None)
    load = endpoint.load
    engine = EngineState(routes=available, output_cpu_cores=load.output_cpu_cores, in_flight=load.in_flight)
    policy = state.policy(model)
    try:
        decision = decide(policy, features, engine)
    except NoRoute as exc:
        raise EngineUnavailable(str(exc)) from exc
    basis = decision.rule if decision.rule is not None else ("cost" if policy.default == "cost" else "default")
    pool = decision.pool
    if pool is not None and pool not in model.pools:
        raise EngineUnavailable(
            f"policy rule {decision.rule!r} sends to pool {pool!r}, which model {model.name!r} does not have"
        )
    if pool is not None and model.pools[pool] is engines:
        pool = None  # already there
    return Decision(decision.route, basis, decision.reason, pool)
