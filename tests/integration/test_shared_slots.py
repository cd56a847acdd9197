"""Admission limits across gateways (`gateway.edge.shared_slots`): two gateways share a real
`redis-server` (`state.backend: redis`) in front of one sim engine, and the engine's own count
of running requests shows that the global and a tenant's `max_concurrency` hold over both
together; a process that dies holding leases gives them up within the lease's life."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp

from engine.state import EngineState
from gateway.config import Admission, Auth, EngineEndpoint, GatewayConfig, StateConfig, Tenant
from gateway.edge.shared_slots import GRANTED, SATURATED, TENANT_FULL, SharedSlots
from tests.support.engine import engine_server
from tests.support.gateway import configured_gateway
from tests.support.redis_server import redis_server

BODY = {"model": "sim", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4, "ignore_eos": True}


@asynccontextmanager
async def two_gateways(
    tokenizer: Path, tmp_path: Path, url: str, admission: Admission, tenants: dict[str, Tenant]
) -> AsyncIterator[tuple[list[str], EngineState]]:
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha\nbeta key-beta\n")
    async with AsyncExitStack() as stack:
        engine, engine_state = await stack.enter_async_context(engine_server(tokenizer, backend_options={"itl_ms": 50}))
        config = GatewayConfig(
            model="sim", tokenizer=str(tokenizer), engines=[EngineEndpoint(url=engine)],
            auth=Auth(api_keys_file=str(keys)), admission=admission, tenants=tenants,
            state=StateConfig(backend="redis", url=url),
        )
        bases = [(await stack.enter_async_context(configured_gateway(config)))[0] for _ in range(2)]
        yield bases, engine_state


async def most_running(engine: EngineState, load: asyncio.Future[list[int]]) -> tuple[int, list[int]]:
    """The most requests the engine ran at once while `load` ran (read at every loop turn it
    yields: each request starts and ends in a callback), and the load's statuses."""
    most = 0
    while not load.done():
        most = max(most, len(engine.running))
        await asyncio.sleep(0)  # each turn of the loop: the count at every change is seen
    return most, load.result()


async def post(session: aiohttp.ClientSession, base: str, key: str) -> int:
    async with session.post(base + "/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status


async def test_the_global_and_a_tenants_limit_hold_across_two_gateways(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    admission = Admission(max_concurrency=2, queue_timeout_s=20)
    tenants = {"alpha": Tenant(max_concurrency=1)}
    async with (
        redis_server(tmp_path) as server,
        two_gateways(qwen3_tokenizer_dir, tmp_path, server.url, admission, tenants) as (bases, engine),
        aiohttp.ClientSession() as session,
    ):
        # beta: 8 requests, 4 through each gateway; each gateway alone would run 2 at once.
        load = asyncio.gather(*(post(session, bases[i % 2], "key-beta") for i in range(8)))
        most, statuses = await most_running(engine, load)
        assert statuses == [200] * 8 and most == 2
        # alpha, limited to 1 in all: 4 requests, 2 through each gateway.
        load = asyncio.gather(*(post(session, bases[i % 2], "key-alpha") for i in range(4)))
        most, statuses = await most_running(engine, load)
        assert statuses == [200] * 4 and most == 1


async def test_leases_of_a_process_that_died_come_back(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        state = StateConfig(backend="redis", url=server.url)
        dead, alive = SharedSlots(state, lease_s=0.3), SharedSlots(state, lease_s=0.3)
        try:
            assert (await dead.take("a", 2, 1))[0] == GRANTED
            assert (await dead.take("b", 2, None))[0] == GRANTED
            assert (await alive.take("c", 2, None))[0] == SATURATED
            assert (await alive.take("a", 3, 1))[0] == TENANT_FULL
            # `dead` renews nothing and gives nothing back, as a killed process: within the
            # lease's life its slots are free again.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while (await alive.take("a", 2, 1))[0] != GRANTED:
                assert loop.time() < deadline, "the dead process's leases never expired"
                await alive.wait()
            verdict, lease = await alive.take("b", 2, None)
            assert verdict == GRANTED and lease
            await alive.give_back(lease)
            assert (await alive.take("b", 2, None))[0] == GRANTED
        finally:
            await dead.close()
            await alive.close()
