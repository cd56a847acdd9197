"""Tenant quotas end to end: the Redis scripts against a real `redis-server`, two gateways
sharing it in front of one sim engine (a tenant's tokens_per_minute holds across both), the
429s and rate-limit headers as the OpenAI and Anthropic SDKs read them, the usage metrics,
and Redis killed and restarted under load."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import openai
import pytest
from opentelemetry.trace import INVALID_SPAN

from gateway.config import Auth, EngineEndpoint, GatewayConfig, StateConfig, Tenant
from gateway.edge.quota_check import QuotaCheck
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.outcome import Outcome, Tokens
from gateway.edge.quota import Limit
from gateway.edge.redis_quota import RedisQuotas
from gateway.serving.state import GatewayState
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server
from tests.support.redis_server import RedisServer, redis_server
from tests.support.waiting import wait_until

KEYS = {"alpha": "key-alpha", "beta": "key-beta", "gamma": "key-gamma"}
MODEL, TOKENS = "sim", 8
DAY = Limit("tokens_per_day", 1000, 86_400.0)  # refills ~0.01 token a second: still while a test runs
RPD = Limit("requests_per_minute", 3, 86_400.0)  # a requests bucket as slow, so that no request comes back


@asynccontextmanager
async def _store(server: RedisServer) -> AsyncIterator[RedisQuotas]:
    store = RedisQuotas(StateConfig(backend="redis", url=server.url, key_prefix="t:"))
    try:
        yield store
    finally:
        await store.close()


async def test_the_redis_scripts_reserve_all_or_nothing_and_settle_once(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server, _store(server) as store:
        first = await store.reserve("a b", "r1", [DAY, RPD], 600)
        assert first.admitted and [level.remaining for level in first.levels] == [400, 2]
        refused = await store.reserve("a b", "r2", [DAY, RPD], 500)
        assert not refused.admitted and refused.refused_by == "tokens_per_day"
        assert refused.retry_after_s == pytest.approx(100 * 86.4, rel=0.01)
        assert (await store.reserve("a b", "r3", [DAY, RPD], 400)).admitted  # the refusal took nothing
        assert await store.settle("a b", "r1", [DAY, RPD], 100)  # 500 given back
        assert not await store.settle("a b", "r1", [DAY, RPD], 100)  # settled once only
        again = await store.reserve("a b", "r4", [DAY, RPD], 500)
        assert again.admitted and again.levels[0].remaining == 0
        out = await store.reserve("a b", "r5", [DAY, RPD], 1)
        assert out.refused_by in ("tokens_per_day", "requests_per_minute") and not out.admitted
        # a settle over the reservation leaves a debt; one without usage leaves the reservation charged
        assert await store.settle("a b", "r4", [DAY, RPD], 800)
        assert await store.settle("a b", "r3", [DAY, RPD], None)
        level = float(await store.redis.hget("t:q:a%20b:tokens_per_day", "l") or 0)
        assert level == pytest.approx(-300, abs=1)
        assert 0 < await store.redis.pttl("t:q:a%20b:tokens_per_day") <= (1300 * 86.4 + 1) * 1000
        assert sorted(key.decode() for key in await store.redis.keys("t:q:r:*")) == []


async def test_concurrent_reserves_from_two_clients_never_overdraw(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server, _store(server) as one, _store(server) as other:
        tries = [(one if i % 2 else other).reserve("a", f"r{i}", [DAY], 30) for i in range(60)]
        decisions = await asyncio.gather(*tries)
        assert sum(decision.admitted for decision in decisions) == 1000 // 30


def _write_keys(tmp_path: Path) -> Auth:
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    return Auth(api_keys_file=str(keys))


@asynccontextmanager
async def _gateways(
    tokenizer: Path, tmp_path: Path, tenants: dict[str, Tenant], count: int, state: StateConfig | None = None
) -> AsyncIterator[list[tuple[str, GatewayState]]]:
    config: dict[str, Any] = {"auth": _write_keys(tmp_path), "tenants": tenants}
    if state is not None:
        config["state"] = state
    async with AsyncExitStack() as stack:
        engine_url, _ = await stack.enter_async_context(engine_server(tokenizer))
        yield [await stack.enter_async_context(gateway_server(tokenizer, engine_url, **config)) for _ in range(count)]


def _sdk(base: str, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key=KEYS[tenant], max_retries=0, timeout=10.0)


async def _chat(sdk: openai.AsyncOpenAI) -> tuple[int, int]:
    """(status, tokens used) of one small chat completion."""
    try:
        answer = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=TOKENS
        )
    except openai.APIStatusError as exc:
        return exc.status_code, 0
    assert answer.usage is not None
    return 200, answer.usage.total_tokens


async def test_a_tenants_tokens_per_minute_holds_across_two_gateways_sharing_redis(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    quota = 400
    tenants = {"alpha": Tenant(tokens_per_minute=quota)}
    async with (
        redis_server(tmp_path) as server,
        _gateways(qwen3_tokenizer_dir, tmp_path, tenants, 2, StateConfig(backend="redis", url=server.url)) as gateways,
        _sdk(gateways[0][0], "alpha") as one,
        _sdk(gateways[1][0], "alpha") as other,
        _sdk(gateways[0][0], "beta") as beta,
    ):
        started = asyncio.get_running_loop().time()
        answers: list[tuple[int, int]] = []
        for _ in range(10):  # 4 at once, over both gateways, until well past the quota
            answers += await asyncio.gather(*(_chat(sdk) for sdk in (one, other, one, other)))
        elapsed = asyncio.get_running_loop().time() - started
        statuses = Counter(status for status, _ in answers)
        assert set(statuses) == {200, 429} and statuses[429] >= 10, statuses
        admitted = sum(tokens for _, tokens in answers)
        largest = max(tokens for _, tokens in answers)
        refilled = quota * elapsed / 60
        assert quota - largest <= admitted <= quota + refilled + largest, (admitted, largest, refilled)
        assert (await _chat(beta))[0] == 200  # beta has no quota


async def test_over_quota_the_sdks_see_429s_with_their_rate_limit_headers(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    tenants = {"alpha": Tenant(requests_per_minute=1, tokens_per_minute=100_000), "*": Tenant(requests_per_minute=1)}
    async with _gateways(qwen3_tokenizer_dir, tmp_path, tenants, 1) as [(base, state)]:
        async with _sdk(base, "alpha") as sdk:
            ok = await sdk.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=TOKENS
            )
            assert ok.headers["x-ratelimit-limit-requests"] == "1"
            assert ok.headers["x-ratelimit-remaining-requests"] == "0"
            assert ok.headers["x-ratelimit-limit-tokens"] == "100000"
            assert ok.headers["x-ratelimit-reset-requests"] == "1m0s"
            with pytest.raises(openai.RateLimitError) as refused:
                await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        headers = refused.value.response.headers
        assert refused.value.code == "rate_limit_exceeded" and refused.value.type == "requests"
        assert 55 <= int(headers["retry-after"]) <= 60 and headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("s") and "x-ratelimit-reset-tokens" in headers

        claude = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=KEYS["beta"], max_retries=0)
        async with claude:
            first = await claude.messages.with_raw_response.create(
                model=MODEL, max_tokens=TOKENS, messages=[{"role": "user", "content": "hi"}]
            )
            assert first.headers["anthropic-ratelimit-requests-remaining"] == "0"
            with pytest.raises(anthropic.RateLimitError) as limited:
                await claude.messages.create(model=MODEL, max_tokens=TOKENS, messages=[{"role": "user", "content": "hi"}])
        error = limited.value
        assert error.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        said = error.response.headers
        assert said["anthropic-ratelimit-requests-limit"] == "1" and int(said["retry-after"]) >= 55
        assert said["anthropic-ratelimit-requests-reset"].endswith("Z") and "x-ratelimit-limit-requests" not in said

        metrics = state.metrics.render().decode()
    assert 'onehop_gateway_quota_rejections_total{limit="requests_per_minute",tenant="alpha"} 1.0' in metrics
    assert 'onehop_gateway_quota_rejections_total{limit="requests_per_minute",tenant="*"} 1.0' in metrics  # beta
    assert 'onehop_gateway_tenant_requests_total{tenant="alpha"} 2.0' in metrics
    assert 'onehop_gateway_tenant_tokens_total{kind="completion",tenant="alpha"}' in metrics
    assert 'tenant="beta"' not in metrics  # unnamed in `tenants:`: counted as "*"
    assert 'onehop_gateway_quota_reserved_tokens{tenant="alpha"} 0.0' in metrics


async def _load(base: str, stop: asyncio.Event, answers: Counter[int], clients: int = 4) -> None:
    async with _sdk(base, "alpha") as sdk:

        async def client() -> None:
            while not stop.is_set():
                answers[(await _chat(sdk))[0]] += 1

        await asyncio.gather(*(client() for _ in range(clients)))


async def _used(store: RedisQuotas, limit: Limit) -> float:
    """What the bucket lacks of its capacity now (refilled to the server's clock)."""
    level, at = await store.redis.hmget(store.bucket_key("alpha", limit), ["l", "t"])
    if level is None:
        return 0.0
    seconds, micros = await store.redis.time()
    now_ms = seconds * 1000 + micros // 1000
    return limit.capacity - limit.refilled(float(level), (now_ms - int(at)) / 1000)


async def test_redis_killed_and_restarted_mid_load_admits_while_down_and_counts_once_after(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """quota_on_failure: open: while Redis is down every request is served (counted as
    admitted unchecked); settles that failed then are retried after the restart without
    counting again, so the bucket holds exactly what was used since."""
    day = Limit("tokens_per_day", 100_000, 86_400.0)
    tenants = {"alpha": Tenant(tokens_per_day=day.capacity)}
    async with redis_server(tmp_path) as server:
        state_config = StateConfig(backend="redis", url=server.url, timeout_s=0.3)
        async with _gateways(qwen3_tokenizer_dir, tmp_path, tenants, 1, state_config) as [(base, state)]:
            answers: Counter[int] = Counter()
            stop = asyncio.Event()
            load = asyncio.create_task(_load(base, stop, answers))
            unavailable = state.metrics.quota_unavailable.labels("admitted")
            try:
                await wait_until(lambda: answers[200] >= 8, what="answers before the kill")
                await server.kill()
                served = answers[200]
                await wait_until(lambda: unavailable._value.get() >= 4, what="requests admitted unchecked")
                await wait_until(lambda: answers[200] >= served + 8, what="answers while Redis is down")
            finally:
                stop.set()
                await load
            assert set(answers) == {200}, answers
            await server.start()
            async with _sdk(base, "alpha") as sdk, _store(server) as store:
                store.prefix = state_config.key_prefix
                used = [await _chat(sdk) for _ in range(6)]
                assert all(status == 200 for status, _ in used)
                await wait_until(lambda: state.quotas.settling == 0, what="every settle done or given up")
                assert await store.redis.keys(f"{store.prefix}q:r:*") == []
                assert await _used(store, day) == pytest.approx(sum(tokens for _, tokens in used), abs=2)


@pytest.mark.parametrize("route", ["derender", "text", "tokens"])
async def test_a_client_that_leaves_mid_stream_pays_what_its_engine_generated_not_its_reservation(
    qwen3_tokenizer_dir: Path, tmp_path: Path, route: str
) -> None:
    """A stream cut after a few chunks: the engine's abort answer says what the request used
    (on the derender route the gateway saw no token count), and the settle charges that, not
    the 2,000-token completion budget it reserved."""
    day = Limit("tokens_per_day", 100_000, 86_400.0)
    budget = 2000
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(redis_server(tmp_path))
        engine_url, engine = await stack.enter_async_context(
            engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 10})
        )
        state_config = StateConfig(backend="redis", url=server.url)
        base, state = await stack.enter_async_context(
            gateway_server(
                qwen3_tokenizer_dir, engine_url, auth=_write_keys(tmp_path), state=state_config,
                tenants={"alpha": Tenant(tokens_per_day=day.capacity)}, route_header=True,
            )
        )
        sdk = await stack.enter_async_context(_sdk(base, "alpha"))
        store = await stack.enter_async_context(_store(server))
        store.prefix = state_config.key_prefix
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count to a thousand"}], max_tokens=budget,
            stream=True, stream_options={"include_usage": True}, extra_headers={"onehop-route": route},
        )
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 5:
                break
        reserved = await _used(store, day)
        assert reserved > budget  # the prompt and the whole completion budget are held
        await stream.close()
        await wait_until(lambda: not engine.running, what="the engine request stopped")
        await wait_until(lambda: state.quotas.settling == 0, what="the settle done")
        await wait_until(lambda: state.quotas.settling == 0 and not state.background, what="the aborts answered")
        prompt = reserved - budget
        used = await _used(store, day)
        assert prompt + 4 <= used < prompt + 200, (prompt, used)  # what was generated before the abort
        assert await store.redis.keys(f"{store.prefix}q:r:*") == []


async def test_a_settle_that_failed_while_redis_was_down_is_retried_after_its_restart_without_counting(
    tmp_path: Path,
) -> None:
    """The settle of a request that reserved before the crash finds its reservation gone with the
    old server's memory: it changes nothing, and a new reservation is settled as usual."""
    config = GatewayConfig(
        model=MODEL, tokenizer="unused", engines=[EngineEndpoint(url="http://127.0.0.1:1")],
        tenants={"alpha": Tenant(tokens_per_day=DAY.capacity)},
    )  # fmt: skip
    async with redis_server(tmp_path) as server:
        state = msgspec.structs.replace(config.state, backend="redis", url=server.url, timeout_s=0.3)
        config = msgspec.structs.replace(config, state=state)
        metrics = GatewayMetrics()
        check = QuotaCheck(config, RedisQuotas(state), metrics)
        try:
            assert await check.reserve("alpha", "before", 300) is not None
            await server.kill()
            check.on_outcome(_outcome("before", 100))
            retried = metrics.quota_unavailable.labels("settle_retried")
            await wait_until(lambda: retried._value.get() >= 1, what="a settle tried again")
            await server.start()
            assert await check.reserve("alpha", "after", 50) is not None
            check.on_outcome(_outcome("after", 20))
            await wait_until(lambda: check.settling == 0, what="both settles done")
            assert metrics.quota_unavailable.labels("settle_failed")._value.get() == 0
            async with _store(server) as store:
                store.prefix = state.key_prefix
                assert await _used(store, DAY) == pytest.approx(20, abs=0.5)
        finally:
            await check.close()


def _outcome(request_id: str, used: int) -> Outcome:
    return Outcome(
        request_id=request_id, endpoint="chat", model=MODEL, tenant="alpha", route="derender", status=200,
        error=None, finish_reasons=("stop",), tokens=Tokens(prompt=used // 2, completion=used - used // 2),
        duration_s=0.1, span=INVALID_SPAN,
    )  # fmt: skip


async def test_with_quota_on_failure_closed_a_quota_tenant_gets_503s_while_redis_is_down(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    tenants = {"alpha": Tenant(tokens_per_minute=100_000)}
    async with redis_server(tmp_path) as server:
        state_config = StateConfig(backend="redis", url=server.url, timeout_s=0.3, quota_on_failure="closed")
        async with _gateways(qwen3_tokenizer_dir, tmp_path, tenants, 1, state_config) as [(base, state)]:
            async with _sdk(base, "alpha") as alpha, _sdk(base, "beta") as beta:
                assert (await _chat(alpha))[0] == 200
                await server.kill()
                with pytest.raises(openai.InternalServerError) as down:
                    await alpha.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
                assert down.value.status_code == 503 and down.value.code == "state_unavailable"
                assert (await _chat(beta))[0] == 200  # no quota: nothing to check
                await server.start()
                await wait_until(lambda: state.quotas.settling == 0, what="settles done")
                assert (await _chat(alpha))[0] == 200
            assert state.metrics.quota_unavailable.labels("refused")._value.get() == 1
