"""The policy in the running gateway: hot reload under load, and live feedback moving routes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineMetrics
from gateway.routing.feedback import CPU_METRIC, IN_FLIGHT_METRIC, load_between, parse_sample
from gateway.serving.state import GATEWAY
from tests.integration.test_gateway_separate_engine import MESSAGES
from tests.support.engine import engine_server

POLICY_A = "rules:\n  - name: alpha\n    match: {}\n    route: tokens\n"
POLICY_B = "rules:\n  - name: beta\n    match: {}\n    route: text\n"
BROKEN = "rules:\n  - name: gamma\n    mach: {}\n    route: text\n"


async def _gateway(engine_url: str, tokenizer_dir: Path, **config: Any) -> Any:
    from aiohttp.test_utils import TestServer

    from gateway.serving.app import create_app
    from gateway.config import EngineEndpoint, GatewayConfig

    config = {"route_header": True, "policy_header": True, **config}
    settings = GatewayConfig(model="sim", tokenizer=str(tokenizer_dir), engines=[EngineEndpoint(url=engine_url)], **config)
    server = TestServer(create_app(settings), handler_cancellation=True)
    await server.start_server()
    return server


async def _chat(session: aiohttp.ClientSession, url: str, **extra: Any) -> tuple[int, str, str]:
    body = {"model": "sim", "messages": MESSAGES, "max_tokens": 16, "stream": True, **extra}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        return resp.status, resp.headers["onehop-route"], resp.headers["onehop-policy"]


async def test_reload_under_load_never_mixes_policies(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_A)
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        server = await _gateway(engine_url, qwen3_tokenizer_dir, policy=str(policy), policy_poll_s=0.01)
        state = server.app[GATEWAY]
        url = str(server.make_url("")).rstrip("/")
        stop = asyncio.Event()

        async def rewrite() -> None:
            texts = [POLICY_B, BROKEN, POLICY_A]
            turn = 0
            while not stop.is_set():
                # Replaced atomically, as a ConfigMap update or an editor's save does.
                staged = tmp_path / "policy.yaml.new"
                staged.write_text(texts[turn % 3])
                staged.replace(policy)
                if turn % 2:
                    state.policy_file.reload()  # what SIGHUP does
                turn += 1
                await asyncio.sleep(0.015)

        writer = asyncio.ensure_future(rewrite())
        try:
            async with aiohttp.ClientSession() as session:
                gate = asyncio.Semaphore(8)

                async def one() -> tuple[int, str, str]:
                    async with gate:
                        return await _chat(session, url)

                results = await asyncio.gather(*(one() for _ in range(80)))
        finally:
            stop.set()
            await writer
            await server.close()
    assert all(status == 200 for status, _, _ in results)
    pairs = {(route, "alpha" in reason, "beta" in reason) for _, route, reason in results}
    assert pairs <= {("tokens", True, False), ("text", False, True)}, pairs
    assert state.policy_file.rejected > 0 and state.policy_file.reloads > 0


def test_feedback_rate_from_engine_metrics() -> None:
    before = parse_sample('onehop_engine_output_cpu_seconds_total{mode="text"} 1.0\n', at=10.0)
    after = parse_sample(
        'onehop_engine_output_cpu_seconds_total{mode="text"} 1.5\n'
        'onehop_engine_output_cpu_seconds_total{mode="derender"} 0.5\n'
        'onehop_engine_in_flight_requests{mode="text"} 3.0\n',
        at=12.0,
    )
    load = load_between(before, after)
    assert (load.output_cpu_cores, load.in_flight) == (0.5, 3)


async def test_live_feedback_sheds_to_tokens_and_back(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Under load the engine's measured output CPU passes the budget: requests move to the token route,
    and back to derender once it cools. The budget sits above one request's estimate, below a busy engine."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("default: cost\ncost:\n  engine_budget_cores: 0.002\n")
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        server = await _gateway(engine_url, qwen3_tokenizer_dir, policy=str(policy), feedback_interval_s=0.1)
        url = str(server.make_url("")).rstrip("/")
        loop = asyncio.get_running_loop()
        try:
            async with aiohttp.ClientSession() as session:
                assert (await _chat(session, url))[1] == "derender"
                busy = asyncio.Event()

                async def load() -> None:
                    while not busy.is_set():
                        await asyncio.gather(
                            *(_chat(session, url, max_tokens=400, logprobs=True, top_logprobs=20) for _ in range(4))
                        )

                routes_seen = []
                loader = asyncio.ensure_future(load())
                deadline = loop.time() + 20
                while loop.time() < deadline:
                    routes_seen.append((await _chat(session, url))[1])
                    if routes_seen[-1] == "tokens":
                        break
                    await asyncio.sleep(0.05)
                busy.set()
                await loader
                assert routes_seen[-1] == "tokens", routes_seen
                deadline = loop.time() + 20
                while loop.time() < deadline:
                    await asyncio.sleep(0.2)
                    if (await _chat(session, url))[1] == "derender":
                        break
                else:
                    raise AssertionError("the route did not move back to derender after the engine cooled")
        finally:
            await server.close()


async def test_the_policy_header_is_ascii_whatever_the_rule_is_called(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    # HTTP header values are ASCII; a UTF-8 one breaks clients (httpx-based SDKs refuse it).
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  - name: café-规则\n    match: {}\n    route: tokens\n", encoding="utf-8")
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _):
        server = await _gateway(engine_url, qwen3_tokenizer_dir, policy=str(policy))
        try:
            async with aiohttp.ClientSession() as session:
                status, route, reason = await _chat(session, str(server.make_url("")).rstrip("/"))
        finally:
            await server.close()
    assert (status, route) == (200, "tokens")
    assert reason == r"rule 'caf\xe9-\u89c4\u5219' (always) -> tokens"


def test_feedback_reads_what_prometheus_clients_parser_reads() -> None:
    """The line scan finds the same two sums as prometheus_client's parser, over a real engine
    exposition plus lines that could fool it; it refuses what is not exposition."""
    metrics = EngineMetrics()
    for mode, seconds in (("text", 1.25), ("derender", 0.5), ("tokens", 0.125)):
        metrics.output_cpu.labels(mode).inc(seconds)
        metrics.inter_token_latency.labels(mode).observe(0.01)
    metrics.in_flight.labels("text").set(3)
    text = generate_latest(metrics.registry).decode() + (
        'onehop_engine_output_cpu_seconds_total{mode="odd} label", x="{"} 2.0 1700000000000\n'
        "onehop_engine_output_cpu_seconds_total_other 9.0\n"
    )
    expected = {CPU_METRIC: 0.0, IN_FLIGHT_METRIC: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in expected:
                expected[sample.name] += sample.value
    parsed = parse_sample(text, at=1.0)
    assert (parsed.cpu_seconds, parsed.in_flight) == (expected[CPU_METRIC], int(expected[IN_FLIGHT_METRIC])) == (3.875, 3)
    with pytest.raises(ValueError):
        parse_sample("<html><body>502 Bad Gateway</body></html>", at=1.0)
