"""Choose the route and the engine for one request: the override header, else the policy.

The policy decides against what the picked engine serves (its probed output
modes, minus the gateway-parsed routes when onehop lacks the model's parsers,
minus a stock vLLM's derender for what its form cannot answer)
and its live load; a rule that names a pool moves the request to that pool,
and the route is decided again against what that pool's engines serve.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from gateway.config import ROUTES, Route
from gateway import vllm_derender
from gateway.engine_client import EngineClient, Target
from gateway.errors import EngineUnavailable, InvalidRequest
from gateway.observe import SPAN_KEY, measured
from gateway.policy import EngineState, NoRoute, RequestFeatures, decide
from gateway.runtime import ModelRuntime
from gateway.state import GatewayState

ROUTE_HEADER = "onehop-route"
"""Request header that picks the route (when the config allows it); the response names the route taken."""
ROUTE_KEY = web.RequestKey("onehop_route", str)
REASON_KEY = web.RequestKey("onehop_policy_reason", str)
GATEWAY_PARSED = frozenset({"text", "tokens"})
"""Routes on which the gateway itself parses reasoning and tool calls."""


async def choose_route(
    state: GatewayState, model: ModelRuntime, http: web.Request, features: RequestFeatures, prompt: Sequence[int]
) -> Target:
    """The route and engine for this request, in a `policy` span; the decision goes on the server span too."""
    with measured(state, "policy", http[SPAN_KEY]) as span:
        engines = model.engines
        endpoint, available = await engines.pick_serving(prompt, constraint=features.constraint)
        route, basis, pool = _decide(state, model, http, engines, endpoint.url, available, features)
        if pool is not None:
            engines = model.pools[pool]  # `_decide` names only pools this model has
            endpoint, available = await engines.pick_serving(prompt, constraint=features.constraint)
            route, basis, _ = _decide(state, model, http, engines, endpoint.url, available, features)
        reason = http[REASON_KEY]
        if span.is_recording():
            decision = {"onehop.route": route, "onehop.policy.rule": basis, "onehop.policy.reason": reason}
            if pool is not None:
                decision["onehop.pool"] = pool
            span.set_attributes(decision)
            http[SPAN_KEY].set_attributes({**decision, "onehop.engine.endpoint": endpoint.url})
    state.metrics.policy_decisions.labels(route, basis).inc()
    return Target(route, engines, endpoint)


def _decide(
    state: GatewayState,
    model: ModelRuntime,
    http: web.Request,
    engines: EngineClient,
    url: str,
    available: frozenset[str],
    features: RequestFeatures,
) -> tuple[Route, str, str | None]:
    """The override header if allowed, else the policy's decision; with its basis (rule name,
    `cost`, `default` or `header`), a bounded label for metrics, and the rule's pool."""
    if features.endpoint == "chat" and not model.parses_locally:
        available = available - GATEWAY_PARSED  # a capability fallback: the engine must parse
    if "derender" in available and engines.derender_form(url) == "vllm" and not vllm_derender.serves(features):
        available = available - {"derender"}  # stock vLLM's derender: non-streaming chat only
    wanted = http.headers.get(ROUTE_HEADER)
    if wanted and state.config.route_header:
        if wanted not in ROUTES:
            raise InvalidRequest(f"{ROUTE_HEADER} must be one of {', '.join(ROUTES)}", param=ROUTE_HEADER)
        if wanted not in available:
            raise InvalidRequest(f"route {wanted!r} is not available on this engine", param=ROUTE_HEADER)
        http[ROUTE_KEY], http[REASON_KEY] = wanted, f"{ROUTE_HEADER} header"
        return wanted, "header", None
    load = state.feedback.load(url)
    engine = EngineState(routes=available, output_cpu_cores=load.output_cpu_cores, in_flight=load.in_flight)
    policy = state.policy(model)
    try:
        decision = decide(policy, features, engine)
    except NoRoute as exc:
        raise EngineUnavailable(str(exc)) from exc
    http[ROUTE_KEY], http[REASON_KEY] = decision.route, decision.reason
    basis = decision.rule if decision.rule is not None else ("cost" if policy.default == "cost" else "default")
    pool = decision.pool
    if pool is not None and pool not in model.pools:
        raise EngineUnavailable(
            f"policy rule {decision.rule!r} sends to pool {pool!r}, which model {model.name!r} does not have"
        )
    if pool is not None and model.pools[pool] is engines:
        pool = None  # already there
    return decision.route, basis, pool
