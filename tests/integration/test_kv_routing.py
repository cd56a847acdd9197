"""Routing by the engines' KV cache (`balancing: {mode: kv_cache}`), end to end on loopback:
three sim engines with a prefix cache publishing vLLM's KV events on real ZMQ sockets, the
gateway subscribed to all three, requests through the OpenAI SDK.

What a user sees: a conversation's next turn goes to the engine that holds its blocks (the
policy header says so, the answer's usage counts the cached tokens), an engine that drops
its cache loses the preference, a busy holder is passed over where the cost formula says,
and an engine whose events cannot be read makes the pool hash the prefix instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import zmq
import zmq.asyncio

from gateway.config import KV_FILL_TOKENS, Balancing, EngineEndpoint, GatewayConfig
from gateway.serving.state import GatewayState
from gateway.upstream.engine_client import EngineClient
from tests.integration.test_sim_prefix_cache import cached_engine, capabilities, prose
from tests.support.engine import engine_server
from tests.support.gateway import configured_gateway
from tests.support.waiting import wait_until

SYSTEM_TOKENS = 800


@asynccontextmanager
async def three_engines_and_a_gateway(
    tokenizer_dir: Path,
    *,
    load_tokens: float = 512,
    fill_tokens: float = KV_FILL_TOKENS,
    extra_engines: Sequence[EngineEndpoint] = (),
    discover: bool = False,
    **options: Any,
) -> AsyncIterator[tuple[openai.AsyncOpenAI, GatewayState, list[str]]]:
    """Three cached engines (agent mode: quick, deterministic answers) and a kv_cache gateway
    subscribed to each (to the event sockets its config names, or with `discover` those the
    engines' capabilities name); yields an SDK client, the gateway's state and the engines' URLs."""
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as session:
        urls, members = [], []
        for _ in range(3):
            base, _state = await stack.enter_async_context(cached_engine(tokenizer_dir, **options))
            events = (await capabilities(session, base))["kv_events"]
            urls.append(base)
            if discover:
                members.append(EngineEndpoint(url=base))
            else:
                members.append(EngineEndpoint(url=base, kv_events=events["endpoint"],
                                              kv_replay=events["replay_endpoint"], kv_topic=events["topic"]))
        config = GatewayConfig(
            model="sim", tokenizer=str(tokenizer_dir), engines=[*members, *extra_engines], route_header=True,
            policy_header=True,
            balancing=Balancing(mode="kv_cache", kv_load_tokens=load_tokens, kv_fill_tokens=fill_tokens),
        )
        base, state = await stack.enter_async_context(configured_gateway(config))
        await joined(session, state, urls)
        client = await stack.enter_async_context(openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0))
        yield client, state, urls


async def joined(
    session: aiohttp.ClientSession, state: GatewayState, urls: list[str], engines: EngineClient | None = None
) -> None:
    """Until each subscriber (of the main pool, or of `engines`) has seen one of its engine's
    events (a PUB drops what it sends before a subscription reaches it): reset each (empty)
    cache until its `AllBlocksCleared` arrives."""
    subscribers = (engines or state.clients[0]).kv_subscribers
    for url in urls:
        subscriber = subscribers[url]
        for _ in range(200):
            async with session.post(url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            try:
                await wait_until(lambda s=subscriber: s.stats["AllBlocksCleared"] > 0, timeout=0.1)  # type: ignore[misc]
                break
            except AssertionError:
                continue
        else:
            raise AssertionError(f"the gateway never heard {url}'s KV events")


async def turn(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]], salt: str | None = None
) -> tuple[str, str, int]:
    """One chat turn (with vLLM's `cache_salt`, if given): (the engine's URL it went to, the
    policy header, cached prompt tokens)."""
    raw = await client.chat.completions.with_raw_response.create(
        model="sim", messages=messages, max_tokens=8, extra_body={"cache_salt": salt} if salt else None,  # type: ignore[arg-type]
    )
    answer = raw.parse()
    details = answer.usage.prompt_tokens_details if answer.usage is not None else None
    cached = details.cached_tokens if details is not None and details.cached_tokens is not None else 0
    return raw.headers["onehop-engine"], raw.headers["onehop-policy"], cached


def conversation(tokenizer: Any, theme: str, turns: int) -> list[dict[str, Any]]:
    system = {"role": "system", "content": tokenizer.decode(prose(tokenizer, SYSTEM_TOKENS, theme))}
    messages: list[dict[str, Any]] = [system]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i} about the {theme}?"})
        if i < turns - 1:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
    return messages


def held(state: GatewayState) -> dict[str, int]:
    index = state.clients[0].store.index
    assert index is not None
    return index.counts()


@pytest.mark.parametrize("discover", [False, True], ids=["configured", "from-capabilities"])
async def test_a_conversations_turns_stay_on_the_engine_that_holds_its_blocks(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, discover: bool
) -> None:
    async with three_engines_and_a_gateway(qwen3_tokenizer_dir, discover=discover) as (client, state, urls):
        assert set(state.clients[0].kv_subscribers) == set(urls)
        first, policy, cached = await turn(client, conversation(qwen3_tokenizer, "river", 1))
        assert cached == 0 and "engine by hash: 0 tokens cached" in policy, policy
        await wait_until(lambda: held(state).get(first, 0) >= SYSTEM_TOKENS // 16, what="the first turn's blocks indexed")
        for turns in (2, 3, 4):
            engine, policy, cached = await turn(client, conversation(qwen3_tokenizer, "river", turns))
            assert engine == first, policy
            assert "engine by cache:" in policy and cached >= SYSTEM_TOKENS - 16, (policy, cached)
            reported = int(policy.split("engine by cache: ")[1].split(" tokens")[0])
            assert reported >= cached - 16  # what the gateway expected, against what the engine found
        # Another conversation is no one's yet: it is hashed, and its own turns then follow it.
        other, policy, _ = await turn(client, conversation(qwen3_tokenizer, "forest", 1))
        assert "engine by hash" in policy
        await wait_until(lambda: held(state).get(other, 0) >= SYSTEM_TOKENS // 16, what="the other conversation indexed")
        assert (await turn(client, conversation(qwen3_tokenizer, "forest", 2)))[0] == other
        assert set(held(state)) <= set(urls)


async def test_a_salted_conversation_follows_its_salted_blocks_only(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> None:
    async with three_engines_and_a_gateway(qwen3_tokenizer_dir) as (client, state, _urls):
        first, _, _ = await turn(client, conversation(qwen3_tokenizer, "river", 1), salt="tenant-a")
        await wait_until(lambda: held(state).get(first, 0) >= SYSTEM_TOKENS // 16, what="the salted blocks indexed")
        engine, policy, cached = await turn(client, conversation(qwen3_tokenizer, "river", 2), salt="tenant-a")
        assert engine == first and "engine by cache:" in policy and cached >= SYSTEM_TOKENS - 16, (policy, cached)
        _, policy, cached = await turn(client, conversation(qwen3_tokenizer, "river", 2), salt="tenant-b")
        assert "engine by hash: 0 tokens cached" in policy and cached == 0, (policy, cached)


async def test_an_engine_that_drops_its_cache_loses_the_preference(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> None:
    async with three_engines_and_a_gateway(qwen3_tokenizer_dir) as (client, state, _urls), aiohttp.ClientSession() as http:
        holder, _, _ = await turn(client, conversation(qwen3_tokenizer, "river", 1))
        await wait_until(lambda: held(state).get(holder, 0) > 0, what="the blocks indexed")
        async with http.post(holder + "/reset_prefix_cache") as resp:  # as a restarted engine would be
            assert resp.status == 200
        await wait_until(lambda: held(state).get(holder, 0) == 0, what="the holder's entries cleared")
        _, policy, cached = await turn(client, conversation(qwen3_tokenizer, "river", 2))
        assert "engine by cache" not in policy and cached == 0, policy


@pytest.mark.parametrize("fill_tokens", [KV_FILL_TOKENS, 0.0], ids=["fill", "no-fill"])
async def test_new_conversations_sharing_a_system_prompt_spread_when_its_holders_cache_is_full(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, fill_tokens: float
) -> None:
    # Caches of 64 blocks: the 800-token system prompt (50 blocks) fills most of one. Each new
    # conversation is cheapest, by its prompt alone, where the system prompt is cached; with the
    # fill term a full holder costs more than prefilling the system prompt once elsewhere.
    async with three_engines_and_a_gateway(
        qwen3_tokenizer_dir, fill_tokens=fill_tokens, cache_blocks=64
    ) as (client, state, urls):
        store = state.clients[0].store
        await wait_until(  # the feedback loop read each engine's size from its metrics
            lambda: all(store.endpoints[url].load.cache_blocks == 64 for url in urls), what="the caches' sizes"
        )
        system = conversation(qwen3_tokenizer, "river", 1)[0]
        engines = []
        for n in range(4):
            engine, _, _ = await turn(client, [system, {"role": "user", "content": f"Task {n}: the mill race?"}])
            engines.append(engine)
            await wait_until(
                lambda at=engine: held(state).get(at, 0) >= SYSTEM_TOKENS // 16,  # type: ignore[misc]
                what="its blocks indexed",
            )
    if fill_tokens:
        assert len(set(engines)) == 3, engines  # the second and third went to empty engines
    else:
        assert len(set(engines)) == 1, engines  # every one followed the system prompt


async def test_a_busy_holder_is_passed_over_where_the_formula_says(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> None:
    # Each outstanding request weighs 256 tokens. The holder keeps the conversation's turns
    # while its load weighs less than the prefill it saves (the whole prompt, about 850 tokens
    # and growing: each held turn's blocks are stored too), so it takes at least three (3 ×
    # 256 < 850), and the first turn sent elsewhere is the one where an idle engine's cost
    # (the whole prompt) fell below the holder's: 256 × its outstanding, give or take the
    # holder's uncached tail.
    load = 256
    async with three_engines_and_a_gateway(  # the fill term off: the load term alone decides here
        qwen3_tokenizer_dir, load_tokens=load, fill_tokens=0, itl_ms=40
    ) as (client, state, _):
        holder, _, _ = await turn(client, conversation(qwen3_tokenizer, "river", 1))
        await wait_until(lambda: held(state).get(holder, 0) >= SYSTEM_TOKENS // 16, what="the blocks indexed")
        streams, engines, policies = [], [], []
        for turns in range(2, 10):  # each held open (reading nothing past the headers): it stays outstanding
            stream = await client.chat.completions.with_raw_response.create(
                model="sim", messages=conversation(qwen3_tokenizer, "river", turns), max_tokens=400, stream=True,  # type: ignore[arg-type]
            )
            streams.append(stream)
            engines.append(stream.headers["onehop-engine"])
            policies.append(stream.headers["onehop-policy"])
            if engines[-1] != holder:
                break
        try:
            assert engines[:3] == [holder] * 3, engines
            assert engines[-1] != holder, engines  # passed over before nine open turns
            busy = len(engines) - 1  # the holder's outstanding turns when it was passed over
            cost = float(policies[-1].split("cost ")[1])  # the idle engine's: the whole prompt
            assert load * (busy - 1) - 64 <= cost <= load * busy + 64, (busy, policies[-1])
        finally:
            for stream in streams:
                await stream.parse().close()  # type: ignore[union-attr]


async def test_with_p_d_the_prefill_pool_is_picked_by_cache_and_the_decode_pool_by_load(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path
) -> None:
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as session:
        prefills = [await stack.enter_async_context(cached_engine(qwen3_tokenizer_dir)) for _ in range(3)]
        decodes = [await stack.enter_async_context(engine_server(qwen3_tokenizer_dir)) for _ in range(2)]
        config = GatewayConfig(
            model="sim", tokenizer=str(qwen3_tokenizer_dir), policy_header=True,
            engines=[EngineEndpoint(url=url) for url, _ in decodes],
            prefill_engines=[EngineEndpoint(url=url) for url, _ in prefills],  # events from their capabilities
            balancing=Balancing(mode="kv_cache"),
        )
        base, state = await stack.enter_async_context(configured_gateway(config))
        pool = state.model("sim").prefill
        assert pool is not None and state.model("sim").engines.store.index is None  # the decode side keeps none
        urls = [url for url, _ in prefills]
        await joined(session, state, urls, pool)
        client = await stack.enter_async_context(openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0))

        def hits() -> dict[str, int]:
            counted = {url: engine.backend.prefix_cache_stats() for url, engine in prefills}  # type: ignore[attr-defined]
            return {url: stats.hits for url, stats in counted.items()}

        engine, policy, _ = await turn(client, conversation(qwen3_tokenizer, "river", 1))
        assert engine in {url for url, _ in decodes} and "engine by hash: cost 0" in policy, policy
        index = pool.store.index
        assert index is not None
        await wait_until(lambda: max(index.counts().values(), default=0) >= SYSTEM_TOKENS // 16, what="prefill indexed")
        holder = max(index.counts(), key=lambda url: index.counts()[url])
        before = hits()
        for turns in (2, 3):
            _, policy, _ = await turn(client, conversation(qwen3_tokenizer, "river", turns))
            assert "engine by cache" not in policy, policy  # the decode engine: by its load
        after = hits()
        assert after[holder] - before[holder] >= 2 * (SYSTEM_TOKENS - 16), (before, after)  # both turns prefilled there
        assert all(after[url] == before[url] for url in urls if url != holder)


async def test_an_engine_whose_events_cannot_be_read_makes_the_pool_hash(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> None:
    context = zmq.asyncio.Context()
    garbage = context.socket(zmq.PUB)  # a fourth engine's "events": not msgpack
    port = garbage.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with engine_server(qwen3_tokenizer_dir) as (fourth, _):
            broken = EngineEndpoint(url=fourth, kv_events=f"tcp://127.0.0.1:{port}")
            async with three_engines_and_a_gateway(qwen3_tokenizer_dir, extra_engines=[broken]) as (client, state, _):
                index = state.clients[0].store.index
                assert index is not None
                subscriber = state.clients[0].kv_subscribers[fourth]
                for seq in range(200):  # until the subscription takes: then the garbage is read
                    await garbage.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
                    if await _counted(subscriber):
                        break
                await wait_until(lambda: index.is_stale(fourth), what="the fourth engine marked stale")
                for theme in ("river", "forest", "meadow"):
                    _, policy, _ = await turn(client, conversation(qwen3_tokenizer, theme, 1))
                    assert "engine by hash: an engine's KV index is stale" in policy, policy
    finally:
        garbage.close(linger=0)
        context.term()


async def _counted(subscriber: Any) -> bool:
    """Whether the subscriber has read (and counted) a payload it could not decode, given a moment."""
    try:
        await wait_until(lambda: subscriber.stats["decode"] > 0, timeout=0.05)
    except AssertionError:
        return False
    return True


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK reads proxy settings from the environment; loopback must not go through one."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------ cached tokens, reported to clients


async def cached_in_every_api(client: openai.AsyncOpenAI, anthropic_client: Any, route: str, prompt: str, stream: bool) -> dict[str, int]:
    """Each API's own field for the prompt tokens the engine had cached, one request each."""
    headers = {"onehop-route": route}
    messages = [{"role": "user", "content": prompt}]
    found: dict[str, int] = {}
    if stream:
        chat_stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model="sim", messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True},
            extra_headers=headers,
        )
        usage = [chunk.usage async for chunk in chat_stream if chunk.usage is not None][-1]
    else:
        usage = (await client.chat.completions.create(model="sim", messages=messages, max_tokens=4, extra_headers=headers)).usage  # type: ignore[arg-type]
    assert usage is not None and usage.prompt_tokens_details is not None
    found["chat"] = usage.prompt_tokens_details.cached_tokens or 0
    completion = await client.completions.create(model="sim", prompt=prompt, max_tokens=4, extra_headers=headers)
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    found["completions"] = completion.usage.prompt_tokens_details.cached_tokens or 0
    if stream:
        events = [event async for event in await client.responses.create(
            model="sim", input=prompt, max_output_tokens=16, stream=True, extra_headers=headers)]
        response = events[-1].response  # type: ignore[union-attr]
    else:
        response = await client.responses.create(model="sim", input=prompt, max_output_tokens=16, extra_headers=headers)
    assert response.usage is not None
    found["responses"] = response.usage.input_tokens_details.cached_tokens
    message = await anthropic_client.messages.create(
        model="sim", max_tokens=16, messages=messages, extra_headers=headers, stream=False,
    )
    found["messages"] = message.usage.cache_read_input_tokens or 0
    return found


@pytest.mark.parametrize(
    ("route", "stream"),
    [  # two in the default suite (the engine's usage relayed; the gateway's own derender), the rest in CI's long runs
        ("derender", True),
        ("tokens", False),
        pytest.param("derender", False, marks=pytest.mark.slow),
        pytest.param("text", False, marks=pytest.mark.slow),
        pytest.param("text", True, marks=pytest.mark.slow),
        pytest.param("tokens", True, marks=pytest.mark.slow),
    ],
)
async def test_every_api_reports_the_engines_cached_tokens_on_every_route(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, route: str, stream: bool
) -> None:
    prompt = qwen3_tokenizer.decode(prose(qwen3_tokenizer, 400, f"harbour {route} {stream}"))
    async with cached_engine(qwen3_tokenizer_dir) as (engine, _), AsyncExitStack() as stack:
        config = GatewayConfig(model="sim", tokenizer=str(qwen3_tokenizer_dir), engines=[EngineEndpoint(url=engine)],
                               route_header=True)
        base, _state = await stack.enter_async_context(configured_gateway(config))
        client = await stack.enter_async_context(openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0))
        claude = await stack.enter_async_context(
            anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="unused", max_retries=0)
        )
        cold = await cached_in_every_api(client, claude, route, prompt, stream)
        warm = await cached_in_every_api(client, claude, route, prompt, stream)
    assert cold["chat"] == 0  # the first request of all found nothing cached
    for api, cached in warm.items():  # each API's prompt was sent before: its full blocks are cached
        assert cached >= 384, (api, warm)
