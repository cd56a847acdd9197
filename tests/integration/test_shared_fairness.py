"""Fair queueing across gateways (`gateway.edge.shared_fairness`, `state.fairness_sync_s`): the
served-tokens account in a real `redis-server` (push, pull, decay, the server gone); the order
leases are taken in across processes; a gateway's queue ordering by what a tenant was served
through another gateway (and, with per-process counters, not); and end to end two gateways
sharing the server and two slots in front of one sim engine, tenant alpha flooding through
the first while beta trickles through the second.

The bound is the one-process bound (docs/gateway.md, "Priority and fair queueing"): with C
slots each held at most one service time S, a request of a tenant below its share waits at
most about S; across processes a lease poll (`POLL_S`) more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.config import Admission, Auth, EngineEndpoint, GatewayConfig, StateConfig, Tenant
from gateway.edge.admission import Claim, Gate
from gateway.edge.shared_fairness import KEEP_S, OTHERS, SharedFairness
from gateway.edge.shared_slots import GRANTED, SATURATED, Place, SharedSlots
from tests.support.engine import engine_server
from tests.support.gateway import configured_gateway
from tests.support.redis_server import redis_server
from tests.support.waiting import wait_until

SERVICE_TOKENS = 4
ITL_MS = 50
BODY = {
    "model": "sim", "messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": SERVICE_TOKENS, "ignore_eos": True,
}


def account(url: str, half_life_s: float = 10.0, missed: list[int] | None = None) -> SharedFairness:
    state = StateConfig(backend="redis", url=url, timeout_s=0.2)
    return SharedFairness(state, ["alpha", "beta"], (lambda: missed.append(1)) if missed is not None else None, half_life_s)


async def test_charges_are_pushed_and_pulled_and_each_process_tells_its_own_from_the_others(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        one, two = account(server.url), account(server.url)
        try:
            one.charge("alpha", 100.0)
            one.charge("zeta", 5.0)  # no `tenants:` entry of its own: the "*" bucket
            two.charge(None, 3.0)  # no tenant at all: "*" too
            assert one.rank("alpha") == 100.0  # counted here before any round
            await one.sync()
            await two.sync()
            assert two.served == pytest.approx({"alpha": 100.0, OTHERS: 8.0}, rel=1e-3)
            assert two.rank("alpha") == two.elsewhere("alpha") == pytest.approx(100.0, rel=1e-3)
            assert two.elsewhere(None) == pytest.approx(5.0, rel=1e-3)  # its own 3 are not elsewhere
            two.charge("alpha", 50.0)
            two.charge("beta", 7.0)
            assert two.rank("alpha") == pytest.approx(150.0, rel=1e-3)  # pending charges count at once
            await two.sync()
            await one.sync()
            assert one.rank("alpha") == pytest.approx(150.0, rel=1e-2)
            assert one.elsewhere("alpha") == pytest.approx(50.0, rel=1e-2)
            assert one.elsewhere("beta") == pytest.approx(7.0, rel=1e-2)
            assert one.elsewhere(None) == pytest.approx(3.0, rel=1e-2)
        finally:
            await one.close()
            await two.close()


async def test_the_counters_decay_by_the_servers_clock_and_leave_nothing_forever(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        fast = account(server.url, half_life_s=0.05)
        client = aioredis.Redis.from_url(server.url)
        try:
            fast.charge("alpha", 1000.0)
            fast.charge("beta", 1.0)
            await fast.sync()
            first, before = fast._server_ms, fast.served["alpha"]
            await asyncio.sleep(0.1)  # the subject is time passing: two half-lives of it
            await fast.sync()
            assert fast._server_ms is not None and first is not None
            halvings = (fast._server_ms - first) / 50
            assert fast.served["alpha"] == pytest.approx(before * 0.5**halvings, rel=1e-3)

            async def forgotten() -> bool:
                await fast.sync()
                return "beta" not in fast.served

            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while not await forgotten():  # 1 token per weight falls under FORGOTTEN in 10 half-lives
                assert loop.time() < deadline, fast.served
            ttl = await client.pttl("onehop:fair:served")
            assert 0 < ttl <= KEEP_S * 1000
            fast.charge("alpha", -1e9)  # a correction beyond what decay left stops at zero
            await fast.sync()
            assert fast.served.get("alpha", 0.0) == 0.0
        finally:
            await fast.close()
            await client.aclose()


async def test_with_the_server_down_a_round_is_skipped_and_counted(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        missed: list[int] = []
        one = account(server.url, missed=missed)
        try:
            one.charge("alpha", 40.0)
            await one.sync()
            await server.kill()
            one.charge("alpha", 60.0)
            assert one.rank("alpha") == 100.0
            started = time.perf_counter()
            await one.sync()
            assert time.perf_counter() - started < 1.0  # bounded by state.timeout_s, never blocking
            assert missed == [1]
            assert one.rank("alpha") == 40.0  # dropped, not pushed twice after an ambiguous failure
            await server.start()  # empty: what it held is gone
            one.charge("beta", 5.0)
            await one.sync()
            assert one.served == pytest.approx({"beta": 5.0})
            assert missed == [1]
        finally:
            await one.close()


async def test_a_free_lease_waits_for_the_request_ahead_in_another_process(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        state = StateConfig(backend="redis", url=server.url)
        first, second = SharedSlots(state), SharedSlots(state)
        heavy, light, urgent = Place(0, 500.0, "alpha"), Place(0, 5.0, "beta"), Place(-1, 500.0, "alpha")
        try:
            verdict, lease = await first.take("alpha", 1, None, heavy)
            assert verdict == GRANTED
            assert (await second.take("beta", 1, None, light))[0] == SATURATED  # it waits, and says so
            await first.give_back(lease)
            # The slot is free, but beta, served less, waits for it in the other process.
            assert (await first.take("alpha", 1, None, heavy))[0] == SATURATED
            verdict, lease = await second.take("beta", 1, None, light)
            assert verdict == GRANTED
            await second.give_back(lease)
            # A more urgent priority goes before a lower rank.
            assert (await first.take("alpha", 1, None, urgent))[0] == GRANTED
            assert (await second.take("beta", 1, None, light))[0] == SATURATED
            await first.give_back(next(iter(first.held)))
            verdict, lease = await first.take("alpha", 1, None, urgent)
            assert verdict == GRANTED
            await first.give_back(lease)
            # Without a place (sharing off), whoever asks first.
            verdict, lease = await first.take("alpha", 1, None)
            assert verdict == GRANTED
            await first.give_back(lease)
            # A waiter that asks no more (it left) is forgotten within WAITING_MS.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while (await first.take("alpha", 1, None, heavy))[0] != GRANTED:
                assert loop.time() < deadline, "the waiter that left held the slot"
                await first.wait()
        finally:
            await first.close()
            await second.close()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-process"])
async def test_the_second_gateways_queue_counts_what_a_tenant_was_served_through_the_first(
    tmp_path: Path, shared: bool
) -> None:
    """alpha was served 2,000 tokens through gateway 1 and nothing through gateway 2, where
    beta was served 100. At gateway 2 alpha then beta queue behind the one slot: with the
    counters shared beta goes first; with each process's own, alpha does (it owes nothing here)."""
    async with redis_server(tmp_path) as server:
        fairness = [account(server.url) for _ in range(2)] if shared else [None, None]
        first, second = (Gate(Admission(max_concurrency=1), fairness=f) for f in fairness)
        try:
            async with first.slot(Claim("alpha"), lambda: 2000):
                pass
            if fairness[0] is not None and fairness[1] is not None:
                await fairness[0].sync()  # what each process's background round does
                await fairness[1].sync()
            served: list[str] = []
            let_go = asyncio.Event()

            async def one(tenant: str, hold: bool = False) -> None:
                async with second.slot(Claim(tenant), lambda: 100):
                    served.append(tenant)
                    if hold:
                        await let_go.wait()

            holder = asyncio.ensure_future(one("beta", hold=True))
            await wait_until(lambda: second.in_use == 1, what="beta holds the slot")
            waiting = [asyncio.ensure_future(one(tenant)) for tenant in ("alpha", "beta")]
            await wait_until(lambda: second.waiting == 2, what="alpha, then beta, waiting")
            let_go.set()
            await asyncio.gather(holder, *waiting)
            assert served == (["beta", "beta", "alpha"] if shared else ["beta", "alpha", "beta"])
        finally:
            await first.close()
            await second.close()


@asynccontextmanager
async def two_gateways(
    tokenizer: Path, tmp_path: Path, url: str, sync_s: float | None
) -> AsyncIterator[list[str]]:
    """Two gateways sharing the Redis server at `url` (two slots in all) and one sim engine."""
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha\nbeta key-beta\n")
    admission = Admission(max_concurrency=2, max_queue=10, queue_timeout_s=30)
    async with AsyncExitStack() as stack:
        engine, _ = await stack.enter_async_context(engine_server(tokenizer, backend_options={"itl_ms": ITL_MS}))
        config = GatewayConfig(
            model="sim", tokenizer=str(tokenizer), engines=[EngineEndpoint(url=engine)],
            auth=Auth(api_keys_file=str(keys)), admission=admission,
            tenants={"alpha": Tenant(), "beta": Tenant()},
            state=StateConfig(backend="redis", url=url, fairness_sync_s=sync_s),
        )
        yield [(await stack.enter_async_context(configured_gateway(config)))[0] for _ in range(2)]


async def ask(session: aiohttp.ClientSession, base: str, key: str) -> tuple[int, float]:
    """(status, seconds it took) of one chat request."""
    sent = time.perf_counter()
    async with session.post(base + "/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status, time.perf_counter() - sent


async def test_a_trickle_through_one_gateway_waits_at_most_one_service_time_behind_a_flood_through_another(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """alpha floods gateway 0 at 10 times its share for 2 s (two slots of ~0.2 s serve 10
    requests a second, 5 each); beta sends one request every 0.3 s through gateway 1."""
    async with (
        redis_server(tmp_path) as server,
        two_gateways(qwen3_tokenizer_dir, tmp_path, server.url, 0.1) as bases,
        aiohttp.ClientSession() as session,
    ):
        alone = min([(await ask(session, bases[1], "key-beta"))[1] for _ in range(3)])
        flood: list[asyncio.Task[tuple[int, float]]] = []
        trickle: list[asyncio.Task[tuple[int, float]]] = []

        async def alpha() -> None:
            for _ in range(100):  # 50 a second: paced load, not synchronisation
                flood.append(asyncio.ensure_future(ask(session, bases[0], "key-alpha")))
                await asyncio.sleep(0.02)

        async def beta() -> None:
            await asyncio.sleep(0.5)  # alpha holds both slots and a full queue by then
            for _ in range(6):
                trickle.append(asyncio.ensure_future(ask(session, bases[1], "key-beta")))
                await asyncio.sleep(0.3)

        await asyncio.gather(alpha(), beta())
        betas = await asyncio.gather(*trickle)
        alphas = await asyncio.gather(*flood)
    assert [status for status, _ in betas] == [200] * 6  # never refused
    waits = sorted(took - alone for _, took in betas)
    assert waits[-1] <= alone + 0.5, (waits, alone)  # one service time, and room for two shared CPUs
    statuses = {status for status, _ in alphas}
    assert 200 in statuses and 503 in statuses, statuses  # the pool was saturated, by alpha alone
