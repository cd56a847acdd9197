"""The dashboard as a user sees it: a real `prometheus` (the OS package) scrapes a gateway and
a sim engine through scripted traffic of every kind (tests/support/observed_traffic.py), then
every query of configs/grafana/onehop-dashboard.json is evaluated through Prometheus' HTTP API.

Each query must return a series (a panel with none shows "No data"), and the counts must be
what the clients saw: requests by endpoint, route and status, tokens from the usage the clients
got, the stream the engine broke mid-way as an error. The queries are read from the dashboard
when the test runs, so a new panel is checked without a word here.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Admission, Auth, Balancing, EngineEndpoint, GatewayConfig, Tenant
from gateway.serving.state import GatewayState
from tests.integration.test_kv_routing import joined
from tests.integration.test_sim_prefix_cache import capabilities, cached_engine
from tests.support.cutting_proxy import cutting_proxy
from tests.support.dashboard import Query, dashboard_queries
from tests.support.gateway import configured_gateway
from tests.support.observed_traffic import MODEL, ROUTES, SHARED_PREFIX, Ledger, Traffic, status_class
from tests.support.prometheus_server import prometheus_server
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.observability, pytest.mark.asyncio(loop_scope="module")]

KEYS = {"alpha": "key-alpha", "capped": "key-capped", "metered": "key-metered", "anonymous": "key-anonymous"}
"""Tenants by key; `anonymous`'s key names no tenant (its label is `*`)."""
TENANTS = {
    "alpha": Tenant(),
    "capped": Tenant(max_concurrency=1, max_queue=0),  # a second request while one runs: a 429
    "metered": Tenant(requests_per_minute=1),  # a second request within the minute: a 429
}
ITL_MS = 2
ONLY_ON_FAILURES = {
    "onehop_gateway_background_restarts_total": "a background loop that raised",
    "onehop_gateway_kv_event_errors_total": "a KV event batch lost, or a stored block not indexed",
    "onehop_gateway_kv_replays_total": "a KV event batch missed and asked for again",
    "onehop_gateway_quota_unavailable_total": "the Redis quota store not answering",
}
"""Metrics the dashboard reads that only failures this traffic does not cause create (a loop
restart is a bug's mark: no traffic can cause one). Their queries may return no series, as long
as their panel shows 0 meanwhile (`noValue`)."""
_METRIC = re.compile(r"\b(onehop_\w+)")


@dataclass
class Observed:
    ledger: Ledger
    queries: dict[Query, list[dict[str, Any]]]
    requests: dict[tuple[str, ...], float]
    """endpoint, route, status → onehop_gateway_requests_total."""
    tokens: dict[tuple[str, ...], float]
    """endpoint, route, kind → onehop_gateway_tokens_total."""
    tenant_tokens: dict[tuple[str, ...], float]
    stream_errors: dict[tuple[str, ...], float]
    """endpoint, route, error → onehop_gateway_stream_errors_total."""
    models: set[str]
    """`model` label values of onehop_gateway_tokens_total."""
    scraped: set[str]
    """Names of the onehop series Prometheus holds."""


def _key_lines() -> str:
    return "".join(f"{key}\n" if name == "anonymous" else f"{name} {key}\n" for name, key in KEYS.items())


def _tenant_label(name: str) -> str:
    return name if name in TENANTS else "*"


def _answered(state: GatewayState) -> int:
    """Requests the gateway has counted (outcomes emitted), from its own /metrics text."""
    families = text_string_to_metric_families(state.metrics.render().decode())
    return int(sum(s.value for f in families if f.name == "onehop_gateway_requests" for s in f.samples if s.name.endswith("_total")))


async def _send_everything(traffic: Traffic, cut_next_stream: Any) -> None:
    for route in ROUTES:
        for stream in (False, True):
            await traffic.chat("alpha", route, stream=stream)
    await traffic.chat("alpha", "derender", stream=False, tools=True)
    await traffic.chat("alpha", "text", stream=True, tools=True)
    for _ in range(2):  # the second is served partly from the engine's prefix cache
        await traffic.chat("alpha", "tokens", stream=False, system=SHARED_PREFIX)
    await traffic.completion("alpha", "derender", stream=False)
    await traffic.completion("alpha", "tokens", stream=True)
    await traffic.response("alpha", "derender", stream=True)
    await traffic.response("alpha", "text", stream=False)
    await traffic.message("alpha", "derender", stream=False)
    await traffic.message("alpha", "tokens", stream=True)
    await traffic.chat("anonymous", "derender", stream=False)
    await traffic.bad_chat("alpha")
    await traffic.bad_message("alpha")
    await traffic.chat("metered", "derender", stream=False)
    client = await traffic.openai("metered")
    await traffic.refused("completions", "metered", lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=4))
    async with traffic.held_stream("capped", "derender"):  # then its client leaves: a 499
        capped = await traffic.openai("capped")
        await traffic.refused("completions", "capped", lambda: capped.completions.create(model=MODEL, prompt="Hi", max_tokens=4))
    cut_next_stream(3)
    _, raw = await traffic.broken_stream("alpha", "derender")
    assert b'"error"' in raw and raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def observed(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Observed]:
    folder = tmp_path_factory.mktemp("prometheus")
    keys = folder / "keys"
    keys.write_text(_key_lines())
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as session:
        engine_url, _ = await stack.enter_async_context(cached_engine(qwen3_tokenizer_dir, itl_ms=ITL_MS))
        events = (await capabilities(session, engine_url))["kv_events"]
        proxy_url, proxy = await stack.enter_async_context(cutting_proxy(engine_url))
        engine = EngineEndpoint(
            url=proxy_url, kv_events=events["endpoint"], kv_replay=events["replay_endpoint"], kv_topic=events["topic"]
        )
        config = GatewayConfig(
            model=MODEL, tokenizer=str(qwen3_tokenizer_dir), engines=[engine], route_header=True, policy_header=True,
            balancing=Balancing(mode="kv_cache"), auth=Auth(api_keys_file=str(keys)),
            admission=Admission(max_concurrency=32), tenants=TENANTS,
        )  # fmt: skip
        base_url, state = await stack.enter_async_context(configured_gateway(config))
        targets = {"onehop-gateway": base_url.removesuffix("/v1").removeprefix("http://"),
                   "onehop-engine": engine_url.removeprefix("http://")}  # fmt: skip
        prometheus = await stack.enter_async_context(prometheus_server(folder, targets))
        await joined(session, state, [proxy_url])
        await prometheus.scraped_after(time.time(), scrapes=1)  # so that rates see the traffic begin

        traffic = Traffic(base_url, KEYS, stack)
        await _send_everything(traffic, proxy.cut_next_stream)
        assert proxy.cuts == 1
        sent = len(traffic.ledger.sent)
        await wait_until(lambda: _answered(state) >= sent, what=f"the gateway counted all {sent} requests")
        await prometheus.scraped_after(time.time())

        queries = {query: await prometheus.query(query.expr) for query in dashboard_queries()}
        yield Observed(
            ledger=traffic.ledger,
            queries=queries,
            requests=await prometheus.values(
                "sum by (endpoint, route, status) (onehop_gateway_requests_total)", ("endpoint", "route", "status")
            ),
            tokens=await prometheus.values(
                "sum by (endpoint, route, kind) (onehop_gateway_tokens_total)", ("endpoint", "route", "kind")
            ),
            tenant_tokens=await prometheus.values(
                "sum by (tenant, kind) (onehop_gateway_tenant_tokens_total)", ("tenant", "kind")
            ),
            stream_errors=await prometheus.values(
                "sum by (endpoint, route, error) (onehop_gateway_stream_errors_total)", ("endpoint", "route", "error")
            ),
            models={key[0] for key in await prometheus.values("sum by (model) (onehop_gateway_tokens_total)", ("model",))},
            scraped={key[0] for key in await prometheus.values('count by (__name__) ({__name__=~"onehop_.+"})', ("__name__",))},
        )


async def test_every_dashboard_query_returns_a_series(observed: Observed) -> None:
    """A series per query, or else a query that reads only metrics of failures this traffic does
    not cause, on a panel that shows 0 meanwhile (a user never sees "No data")."""
    assert observed.queries, "the dashboard has no queries"
    empty = [query for query, series in observed.queries.items() if not series]
    unexplained = [
        f"{query.panel}: {query.expr}"
        for query in empty
        if not (set(_METRIC.findall(query.expr)) <= set(ONLY_ON_FAILURES) and query.no_value == "0")
    ]
    assert not unexplained, "panels showing 'No data' after traffic of every kind:\n  " + "\n  ".join(unexplained)


async def test_every_metric_the_dashboard_reads_was_scraped(observed: Observed) -> None:
    """Stronger than a series per query (a query may fall back to `or vector(0)`): the traffic
    created every series the panels read, but for the failures it does not cause."""
    read = {name for query in observed.queries for name in _METRIC.findall(query.expr)}
    missing = sorted(read - observed.scraped - set(ONLY_ON_FAILURES))
    assert not missing, f"the dashboard reads metrics no traffic created: {missing}"


async def test_requests_by_endpoint_route_and_status_are_what_clients_got(observed: Observed) -> None:
    counted: dict[tuple[str, str, str], int] = {}
    for (endpoint, route, status), value in observed.requests.items():
        key = (endpoint, route, status_class(int(status)))
        counted[key] = counted.get(key, 0) + int(value)
    assert counted == dict(observed.ledger.requests())


async def test_the_stream_broken_mid_way_is_counted_as_an_error(observed: Observed) -> None:
    (broken,) = [s for s in observed.ledger.sent if s.status >= 500]
    errors = {key[:2]: value for key, value in observed.stream_errors.items() if value}
    assert errors == {(broken.endpoint, broken.route): 1}
    failed = {key: value for key, value in observed.requests.items() if key[2].startswith("5")}
    assert failed == {(broken.endpoint, broken.route, next(iter(failed))[2]): 1} and len(failed) == 1


async def test_tokens_are_the_usage_the_clients_got(observed: Observed) -> None:
    hidden = observed.ledger.hidden_reasoning()  # Messages' clients are not told their reasoning tokens
    counted = {
        key: int(value) for key, value in observed.tokens.items() if value and not (key[2] == "reasoning" and key[:2] in hidden)
    }
    expected = observed.ledger.tokens()
    assert counted == expected
    assert {kind for _, _, kind in expected} == {"prompt", "cached", "completion", "reasoning"}
    assert observed.models == {MODEL}


async def test_tenant_tokens_are_the_usage_each_tenants_clients_got(observed: Observed) -> None:
    expected: dict[tuple[str, str], int] = {}
    for (tenant, kind), count in observed.ledger.tenant_tokens().items():
        key = (_tenant_label(tenant), kind)
        expected[key] = expected.get(key, 0) + count
    assert {key: int(value) for key, value in observed.tenant_tokens.items() if value} == expected
