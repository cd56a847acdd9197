"""Choosing the route and the engine (`routing.choose_route`) in a running gateway, over a table of requests.

What `policy.decide` does alone is `test_policy.py`'s; here is what the gateway adds
around it: the routes the picked engine serves (probed from scripted engines:
real aiohttp apps on loopback ports, onehop engines with their output modes and a
stock vLLM 0.33), chat taking only engine-parsed routes when onehop lacks the
model's parsers, stock vLLM's derender form only for what it can answer, the
`onehop-route` header, a rule's pool (the route decided again against that
pool's engines), structured outputs picking the engine that enforces them, and
the engine's live load. The policy is the shipped `configs/policy.yaml` with one
rule added for the stock vLLM pool.

The decisions are made by a handler added to the gateway's own app, so the request
is a real one, through the gateway's middlewares (its errors in OpenAI's shape).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry import trace

from gateway.serving.app import create_app
from gateway.config import EngineEndpoint, GatewayConfig, ModelConfig
from gateway.upstream.engine_client import CAPABILITIES_PATH, VERSION_PATH
from gateway.routing.datastore import Load
from gateway.edge.context import Edge, RequestContext
from gateway.observe.outcome import Tally
from gateway.routing.policy import RequestFeatures
from gateway.routing.choose import choose_route
from gateway.serving.state import GATEWAY, GatewayState

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[3]
SHIPPED_POLICY = ROOT / "configs" / "policy.yaml"
STOCK_RULE = {"name": "stock-vllm", "match": {"header": {"name": "x-pool", "equals": "stock"}}, "route": "derender", "pool": "stock"}
PROMPT = [9707, 11, 1879]
ALL_MODES = ["derender", "text", "tokens"]


@dataclass
class Engines:
    """The scripted engines' base URLs, by role."""

    main: list[str] = field(default_factory=list)
    json: str = ""
    """The main pool's engine that enforces `structured_outputs.json` (the other enforces nothing)."""
    tokens_only: str = ""
    stock: str = ""
    foreign: str = ""


@dataclass
class Gateway:
    url: str
    state: GatewayState
    engines: Engines
    session: aiohttp.ClientSession


def scripted_engine(capabilities: dict[str, Any] | None, version: str = "") -> web.Application:
    """An engine that answers the gateway's probes: a onehop engine's capabilities, or (None) a stock
    vLLM's 404 there and its `/version`. It serves no generate: no request here gets that far."""

    async def caps(request: web.Request) -> web.Response:
        if capabilities is None:
            raise web.HTTPNotFound()
        return web.json_response(capabilities)

    async def version_of(request: web.Request) -> web.Response:
        return web.json_response({"version": version})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get(CAPABILITIES_PATH, caps)
    app.router.add_get(VERSION_PATH, version_of)
    app.router.add_get("/health", health)
    return app


def onehop_caps(modes: list[str], constraints: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"output_modes": modes, "structured_outputs": list(constraints), "max_model_len": 4096}


async def decide_route(http: web.Request) -> web.Response:
    """The route, pool and engine `choose_route` picks for the features in the body (and the headers)."""
    state = http.app[GATEWAY]
    body = await http.json()
    model = state.model(body.pop("model"))
    headers = {k.lower(): v for k, v in http.headers.items()}
    features = RequestFeatures(model=model.name, headers=headers, **body)
    edge = Edge(
        request_id="chatcmpl-1", endpoint="chat", tenant=None, owner="anonymous", headers=http.headers,
        span=trace.INVALID_SPAN, started=time.perf_counter(), deadline=None, tally=Tally(),
    )
    routed = await choose_route(state, RequestContext.decoded(edge, model, model.name, None), features, PROMPT)
    target = routed.routed
    pools = {id(engines): name for name, engines in model.pools.items()} | {id(model.engines): "main"}
    pool = pools[id(target.engines)]
    return web.json_response(
        {"route": target.route, "pool": pool, "engine": target.endpoint.url, "reason": routed.tally.reason}
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    servers = [
        TestServer(app)
        for app in (
            scripted_engine(onehop_caps(ALL_MODES)),
            scripted_engine(onehop_caps(ALL_MODES, ("json",))),
            scripted_engine(onehop_caps(["tokens"])),
            scripted_engine(None, version="0.33.1"),
            scripted_engine(onehop_caps(ALL_MODES)),
        )
    ]
    for server in servers:
        await server.start_server()
    plain, json_engine, tokens_only, stock, foreign = (str(s.make_url("")).rstrip("/") for s in servers)
    engines = Engines(main=[plain, json_engine], json=json_engine, tokens_only=tokens_only, stock=stock, foreign=foreign)
    policy = yaml.safe_load(SHIPPED_POLICY.read_text())
    policy["rules"].append(STOCK_RULE)
    policy_path = tmp_path_factory.mktemp("routing") / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(policy))
    tokenizer = str(qwen3_tokenizer_dir)
    config = GatewayConfig(
        models=[
            ModelConfig(
                name="qwen3", tokenizer=tokenizer, reasoning_parser="qwen3", tool_parser="hermes",
                engines=[EngineEndpoint(url=url) for url in engines.main],
                pools={"batch": [EngineEndpoint(url=tokens_only)], "stock": [EngineEndpoint(url=stock)]},
            ),
            # A tool parser onehop does not implement: chat takes only the routes where the engine parses.
            ModelConfig(
                name="foreign", tokenizer=tokenizer, reasoning_parser="qwen3", tool_parser="jamba",
                engines=[EngineEndpoint(url=foreign)], pools={"batch": [EngineEndpoint(url=tokens_only)]},
            ),
        ],
        route_header=True,
        policy=str(policy_path),
        policy_poll_s=60,
    )
    app = create_app(config)
    app.router.add_post("/decide", decide_route)
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            yield Gateway(str(server.make_url("")).rstrip("/"), app[GATEWAY], engines, session)
    finally:
        await server.close()
        for engine in servers:
            await engine.close()


async def decide(gateway: Gateway, headers: dict[str, str] | None = None, **features: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": "qwen3", **features}
    async with gateway.session.post(gateway.url + "/decide", json=body, headers=headers or {}) as response:
        return response.status, await response.json()


def decisions(state: GatewayState, route: str, basis: str) -> float:
    value = state.metrics.registry.get_sample_value("onehop_gateway_policy_decisions_total", {"route": route, "rule": basis})
    return value or 0.0


@contextmanager
def loaded(state: GatewayState, urls: list[str], cores: float) -> Iterator[None]:
    """The engines' live load, as the feedback loop would have measured it."""
    endpoints = [e for engines in state.clients for e in engines.store.endpoints.values() if e.url in urls]
    for endpoint in endpoints:
        endpoint.load = Load(output_cpu_cores=cores)
    try:
        yield
    finally:
        for endpoint in endpoints:
            endpoint.load = Load()


@dataclass(frozen=True)
class Case:
    name: str
    features: dict[str, Any]
    route: str
    basis: str
    """The rule's name, `cost` or `header`: the metric's label."""
    pool: str = "main"
    headers: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    """A part of the policy's reason (the `onehop-policy` header)."""


CASES = [
    Case("plain chat on a cool engine: the cost model keeps one hop", {}, "derender", "cost", reason="cost: derender would add"),
    Case("wide logprobs: the shipped rule hands them to the gateway", {"logprobs": True, "top_logprobs": 10}, "tokens", "wide-logprobs"),
    Case("top_logprobs without logprobs asks for none", {"top_logprobs": 20}, "derender", "cost"),
    Case("the debug header's rule", {}, "text", "debug-text", headers={"x-onehop-debug": "text"}),
    Case(
        "a rule's pool, decided again against its engines: tokens only", {"tenant": "batch"}, "tokens", "batch-tenant",
        pool="batch", reason="derender unavailable on this engine, fallback -> tokens",
    ),
    Case("stock vLLM's derender form: a whole chat answer", {}, "derender", "stock-vllm", pool="stock", headers={"x-pool": "stock"}),
    Case(
        "stock vLLM's derender form cannot stream", {"stream": True}, "text", "stock-vllm", pool="stock",
        headers={"x-pool": "stock"}, reason="fallback -> text",
    ),
    Case(
        "stock vLLM's derender form is for chat only", {"endpoint": "completions"}, "text", "stock-vllm", pool="stock",
        headers={"x-pool": "stock"},
    ),
    Case(
        "stock vLLM's derender form cannot force a tool call", {"tools": True, "forced_tool": True}, "text", "stock-vllm",
        pool="stock", headers={"x-pool": "stock"},
    ),
    Case("the route header", {}, "text", "header", headers={"onehop-route": "text"}, reason="onehop-route header"),
    Case(
        "the route header over every rule", {"logprobs": True, "top_logprobs": 20}, "derender", "header",
        headers={"onehop-route": "derender", "x-pool": "stock"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_the_route_and_engine_chosen(gateway: Gateway, case: Case) -> None:
    counted = decisions(gateway.state, case.route, case.basis)
    status, decision = await decide(gateway, case.headers, **case.features)
    assert status == 200, decision
    assert (decision["route"], decision["pool"]) == (case.route, case.pool)
    pool_engines = {"main": gateway.engines.main, "batch": [gateway.engines.tokens_only], "stock": [gateway.engines.stock]}
    assert decision["engine"] in pool_engines[case.pool]
    assert case.reason in decision["reason"]
    assert decisions(gateway.state, case.route, case.basis) == counted + 1


async def test_a_hot_engine_sheds_to_the_token_route_and_a_cool_one_takes_it_back(gateway: Gateway) -> None:
    with loaded(gateway.state, gateway.engines.main, cores=1.0):
        status, decision = await decide(gateway)
    assert (status, decision["route"]) == (200, "tokens")
    assert decision["reason"].startswith("cost: engine at 1.00")
    status, decision = await decide(gateway)
    assert (status, decision["route"]) == (200, "derender")


async def test_structured_outputs_go_to_the_engine_that_enforces_them(gateway: Gateway) -> None:
    # Two engines in the pool, picked at random: whichever comes first, the one that enforces json serves.
    for _ in range(6):
        status, decision = await decide(gateway, constraint="json")
        assert (status, decision["engine"]) == (200, gateway.engines.json)
    status, refusal = await decide(gateway, constraint="regex")
    assert status == 400
    assert "no engine of this model enforces structured_outputs.regex" in refusal["error"]["message"]


# ------------------------------------------------------------ a model whose parsers onehop lacks


async def test_chat_for_parsers_onehop_lacks_takes_only_engine_parsed_routes(gateway: Gateway) -> None:
    debug = {"x-onehop-debug": "text"}
    status, decision = await decide(gateway, debug, model="foreign")
    assert (status, decision["route"]) == (200, "derender")
    assert "text unavailable on this engine, fallback -> derender" in decision["reason"]
    # Completions parse nothing: the text route stays open to them.
    status, decision = await decide(gateway, debug, model="foreign", endpoint="completions")
    assert (status, decision["route"], decision["engine"]) == (200, "text", gateway.engines.foreign)
    status, refusal = await decide(gateway, {"onehop-route": "tokens"}, model="foreign")
    assert status == 400 and "route 'tokens' is not available on this engine" in refusal["error"]["message"]


async def test_a_pool_that_serves_no_route_the_request_can_take_is_unavailable(gateway: Gateway) -> None:
    # The batch pool serves only tokens, a route this model's chat cannot take.
    status, refusal = await decide(gateway, model="foreign", tenant="batch")
    assert status == 503 and "no fallback is served" in refusal["error"]["message"]


async def test_a_rule_naming_a_pool_the_model_lacks_is_unavailable(gateway: Gateway) -> None:
    status, refusal = await decide(gateway, {"x-pool": "stock"}, model="foreign")
    assert status == 503
    assert "sends to pool 'stock', which model 'foreign' does not have" in refusal["error"]["message"]


# ------------------------------------------------------------ the route header's checks


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        ("bogus", "onehop-route must be one of derender, text, tokens, tokens-remote"),
        ("tokens-remote", "route 'tokens-remote' is not available on this engine"),
    ],
)
async def test_a_route_header_the_engine_cannot_serve_is_refused(gateway: Gateway, wanted: str, message: str) -> None:
    status, refusal = await decide(gateway, {"onehop-route": wanted})
    assert status == 400 and message in refusal["error"]["message"]
