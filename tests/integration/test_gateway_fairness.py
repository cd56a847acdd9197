"""Priority and fair queueing in admission (`gateway.edge.admission`), end to end: a gateway
with API keys of two tenants and a small `max_concurrency` in front of a sim engine whose
answers take a known time, clients on loopback.

The bound the trickle's wait is held to (docs/gateway.md, "Priority and fair queueing"):
with C slots, each held for at most one service time S, some slot is given back within S of
any moment; a tenant that was served fewer tokens than a backlogged one (per weight) gets the
next slot given back, so a request of a tenant below its share waits at most about S, however
deep the other tenant's queue. First come, first served would make it wait for the whole
queue: max_queue / C service times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from gateway.config import Admission, Auth, EngineEndpoint, GatewayConfig, Tenant
from tests.support.engine import engine_server
from tests.support.gateway import configured_gateway
from tests.support.otlp import otlp_receiver
from tests.support.waiting import wait_until
from gateway.serving.state import GatewayState
from plumbing.telemetry import TracingConfig

SERVICE_TOKENS = 4
ITL_MS = 50
"""Each answer is SERVICE_TOKENS steps of ITL_MS at the engine: about 0.2 s of service."""
BODY = {
    "model": "sim", "messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": SERVICE_TOKENS, "ignore_eos": True,
}


@asynccontextmanager
async def tenants_gateway(
    tokenizer_dir: Path, engine: str, tmp_path: Path, admission: Admission, tenants: dict[str, Tenant]
) -> AsyncIterator[tuple[str, GatewayState]]:
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha\nbeta key-beta\n")
    config = GatewayConfig(
        model="sim", tokenizer=str(tokenizer_dir), engines=[EngineEndpoint(url=engine)],
        auth=Auth(api_keys_file=str(keys)), admission=admission, tenants=tenants,
    )
    async with configured_gateway(config) as running:
        yield running


async def ask(
    session: aiohttp.ClientSession, base: str, key: str, headers: dict[str, str] | None = None
) -> tuple[int, float, float]:
    """(status, when it was sent, seconds it took) of one chat request."""
    sent = time.perf_counter()
    async with session.post(
        base + "/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}", **(headers or {})}
    ) as response:
        await response.read()
        return response.status, sent, time.perf_counter() - sent


async def test_a_trickle_waits_at_most_one_service_time_behind_a_flood(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """alpha floods at 10 times its share (C=2 slots of ~0.2 s serve 10 requests a second, so
    5 each), beta sends a request every 0.3 s (about 3 a second, under its share)."""
    admission = Admission(max_concurrency=2, max_queue=40, queue_timeout_s=30)
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": ITL_MS}) as (engine, _),
        tenants_gateway(qwen3_tokenizer_dir, engine, tmp_path, admission, {}) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        alone = min([(await ask(session, base, "key-beta"))[2] for _ in range(3)])
        flood: list[asyncio.Task[tuple[int, float, float]]] = []
        trickle: list[asyncio.Task[tuple[int, float, float]]] = []

        async def alpha() -> None:
            for _ in range(150):  # 50 a second for 3 s: paced load, not synchronisation
                flood.append(asyncio.ensure_future(ask(session, base, "key-alpha")))
                await asyncio.sleep(0.02)

        async def beta() -> None:
            await asyncio.sleep(0.5)  # alpha's queue is deep by then
            for _ in range(10):
                trickle.append(asyncio.ensure_future(ask(session, base, "key-beta")))
                await asyncio.sleep(0.3)

        await asyncio.gather(alpha(), beta())
        betas = await asyncio.gather(*trickle)
        alphas = await asyncio.gather(*flood)
    assert [status for status, _, _ in betas] == [200] * 10  # never refused
    waits = sorted(took - alone for _, _, took in betas)
    bound = alone + 0.5  # one service time, and room for two shared CPUs' scheduling
    assert waits[-1] <= bound, (waits, alone)
    # The flood was refused where it was over: 503s once the queue was full of its own
    # requests, 429s when the trickle took a place it held beyond its share.
    statuses = {status for status, _, _ in alphas}
    assert statuses <= {200, 429, 503} and 503 in statuses and 429 in statuses, statuses
    served = [took for status, _, took in alphas if status == 200]
    assert max(served) > 4 * bound  # what first come, first served would have made beta wait


async def test_an_urgent_request_goes_before_queued_ones_and_its_priority_reaches_the_engine(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """One slot, held; alpha queues three, then beta (allowed -10) asks for -5 with vLLM's
    header: it is served next, and the engine gets -5. A hint beyond the allowance is capped."""
    tenants = {"alpha": Tenant(priority=2), "beta": Tenant(best_priority=-10)}
    async with otlp_receiver() as receiver:
        tracing = TracingConfig(endpoint=receiver.url)
        async with (
            engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": ITL_MS}, tracing=tracing) as (engine, _),
            tenants_gateway(qwen3_tokenizer_dir, engine, tmp_path, Admission(max_concurrency=1), tenants) as (base, state),
            aiohttp.ClientSession() as session,
        ):
            ended: list[str] = []

            async def one(name: str, key: str, headers: dict[str, str] | None = None) -> int:
                status, _, _ = await ask(session, base, key, headers)
                ended.append(name)
                return status

            gate = state.gate
            first = asyncio.ensure_future(one("first", "key-alpha"))
            await wait_until(lambda: gate.in_use == 1, what="the first request holds the slot")
            queued = [asyncio.ensure_future(one(f"low{i}", "key-alpha")) for i in range(3)]
            await wait_until(lambda: gate.waiting == 3, what="three queued")
            urgent = asyncio.ensure_future(one("urgent", "key-beta", {"X-Vllm-Priority": "-5"}))
            statuses = await asyncio.gather(first, *queued, urgent)
            assert statuses == [200] * 5
            assert ended[:2] == ["first", "urgent"], ended
            # beta asks beyond its allowance: capped at -10, not refused.
            assert (await ask(session, base, "key-beta", {"X-Vllm-Priority": "-99"}))[0] == 200
        # Leaving the engine's server shut its exporter down: its spans are all here.
    priorities = [span.attributes["onehop.priority"] for span in receiver.named("POST /inference/v1/generate")]
    assert sorted(priorities) == [-10, -5, 2, 2, 2, 2], priorities

