"""The Responses store in a real `redis-server` (`state: {backend: redis}`), shared by two
gateways in front of one sim engine, through the OpenAI SDK: a response stored through one is
continued and fetched through the other and is another tenant's unknown id through either;
the bounds evict each owner's least recently used across both; with the server killed, what
needs the store is a 503 and the rest is served, and storing works again once it is back."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.apis.redis_responses import RedisResponseStore
from gateway.config import Auth, ResponseStoreConfig, StateConfig
from gateway.edge.errors import StateUnavailable
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server
from tests.support.redis_server import redis_server
from tests.support.waiting import wait_until

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
MODEL, TOKENS = "sim", 4
ASK = {"model": MODEL, "max_output_tokens": TOKENS}


@asynccontextmanager
async def _gateways(
    tokenizer: Path, tmp_path: Path, url: str, count: int = 2, store: ResponseStoreConfig | None = None
) -> AsyncIterator[list[str]]:
    """`count` gateways sharing the Redis server at `url` and one sim engine; their `/v1` URLs."""
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    config: dict[str, Any] = {"auth": Auth(api_keys_file=str(keys)), "state": StateConfig(backend="redis", url=url)}
    if store is not None:
        config["response_store"] = store
    async with AsyncExitStack() as stack:
        engine_url, _ = await stack.enter_async_context(engine_server(tokenizer))
        bases = [(await stack.enter_async_context(gateway_server(tokenizer, engine_url, **config)))[0] for _ in range(count)]
        yield bases


def _sdk(base: str, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key=KEYS[tenant], max_retries=0, timeout=10.0)


async def _unknown_id_answers(sdk: openai.AsyncOpenAI, response_id: str) -> list[tuple[int, str | None]]:
    """Each way to reach a stored response by its id: GET, a continuation, DELETE (status, code)."""
    answers: list[tuple[int, str | None]] = []
    for attempt in (
        sdk.responses.retrieve(response_id),
        sdk.responses.create(input="and?", previous_response_id=response_id, model=MODEL, max_output_tokens=TOKENS),
        sdk.responses.delete(response_id),
    ):
        try:
            await attempt
        except openai.APIStatusError as exc:
            answers.append((exc.status_code, exc.code))
        else:
            answers.append((200, None))
    return answers


async def test_a_response_stored_through_one_gateway_is_continued_through_the_other_and_only_by_its_tenant(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    async with redis_server(tmp_path) as server, _gateways(qwen3_tokenizer_dir, tmp_path, server.url) as (one, other):
        async with _sdk(one, "alpha") as alpha_one, _sdk(other, "alpha") as alpha_other:
            first = await alpha_one.responses.create(input="Remember the word kiwi.", model=MODEL, max_output_tokens=TOKENS)
            assert (await alpha_other.responses.retrieve(first.id)).id == first.id
            second = await alpha_other.responses.create(input="Which word?", previous_response_id=first.id, model=MODEL, max_output_tokens=TOKENS)
            assert second.previous_response_id == first.id
            # Streamed through one (kept before its last event went out), continued through the other.
            events = [event async for event in await alpha_one.responses.create(
                input="And now?", previous_response_id=second.id, stream=True, model=MODEL, max_output_tokens=TOKENS
            )]
            last = events[-1]
            assert last.type in ("response.completed", "response.incomplete")
            assert (await alpha_other.responses.retrieve(last.response.id)).status == last.response.status

        unknown = "resp_" + "0" * 32
        async with _sdk(one, "beta") as beta_one, _sdk(other, "beta") as beta_other:
            expected = await _unknown_id_answers(beta_one, unknown)
            assert [status for status, _ in expected] == [404, 400, 404]  # OpenAI's: a 400 for an unknown previous id
            for beta in (beta_one, beta_other):
                assert await _unknown_id_answers(beta, first.id) == expected

        async with _sdk(one, "alpha") as alpha_one, _sdk(other, "alpha") as alpha_other:
            assert (await alpha_one.responses.retrieve(first.id)).id == first.id  # beta's tries changed nothing
            await alpha_other.responses.delete(first.id)
            assert await _unknown_id_answers(alpha_one, first.id) == expected


async def test_each_owners_least_recently_used_are_evicted_across_both_gateways(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    store = ResponseStoreConfig(max_entries=3, max_tenant_entries=2)
    async with (
        redis_server(tmp_path) as server,
        _gateways(qwen3_tokenizer_dir, tmp_path, server.url, store=store) as (one, other),
        _sdk(one, "alpha") as alpha_one,
        _sdk(other, "alpha") as alpha_other,
        _sdk(one, "beta") as beta_one,
    ):
        a = (await alpha_one.responses.create(input="a", model=MODEL, max_output_tokens=TOKENS)).id
        b = (await alpha_other.responses.create(input="b", model=MODEL, max_output_tokens=TOKENS)).id
        kept = (await beta_one.responses.create(input="beta's", model=MODEL, max_output_tokens=TOKENS)).id
        await alpha_other.responses.retrieve(a)  # a is now alpha's more recent, whoever read it
        c = (await alpha_one.responses.create(input="c", model=MODEL, max_output_tokens=TOKENS)).id  # past alpha's share: b goes
        found = {}
        for name, response_id in {"a": a, "b": b, "c": c}.items():
            try:
                found[name] = (await alpha_other.responses.retrieve(response_id)).id == response_id
            except openai.NotFoundError:
                found[name] = False
        assert found == {"a": True, "b": False, "c": True}
        assert (await beta_one.responses.retrieve(kept)).id == kept  # alpha's answers evicted only alpha's


def _bounds(**fields: int) -> ResponseStoreConfig:
    big = {"max_entries": 1_000, "max_bytes": 1 << 30, "max_tenant_entries": 1_000, "max_tenant_bytes": 1 << 30}
    return ResponseStoreConfig(**{**big, **fields})


async def test_the_redis_store_counts_bytes_as_the_memory_store_and_leaves_nothing_behind(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        state = StateConfig(backend="redis", url=server.url, key_prefix="t:")
        one = 400 + 100 + 2  # entry_size(b"x" * 100, b"[]")
        store = RedisResponseStore(state, _bounds(max_bytes=3 * one + 10, max_tenant_bytes=2 * one + 10))
        try:
            assert await store.put("a", "r1", b"x" * 100, []) and await store.put("a", "r2", b"x" * 100, [])
            assert await store.put("a", "r3", b"x" * 100, [])  # past a's share in bytes: r1 goes
            assert await store.get("a", "r1") is None and await store.get("a", "r2") is not None
            assert await store.put("b", "r1", b"x" * 100, [], session="s")  # the same id, another owner's
            assert await store.put("b", "r4", b"x" * 100, [])  # past the whole: anyone's oldest, a's r3, goes
            assert await store.get("a", "r3") is None
            found = await store.get("b", "r1")
            assert found is not None and found.session == "s" and bytes(found.response) == b"x" * 100
            assert not await store.put("a", "r2", b"x" * 3 * one, [])  # over the share alone: refused, the old r2 gone
            assert await store.get("a", "r2") is None
            for owner, rid in (("b", "r1"), ("b", "r4")):
                assert await store.delete(owner, rid)
            assert not await store.delete("b", "r1")
            left = sorted(key.decode() for key in await store.redis.keys("t:*"))
            assert left == ["t:bytes", "t:tick"] and await store.redis.get("t:bytes") == b"0"
        finally:
            await store.close()


async def test_a_store_that_does_not_answer_is_state_unavailable_in_its_timeout(tmp_path: Path) -> None:
    """A port that accepts and never answers (a hung server): the call gives up in `timeout_s`."""
    accepted: list[asyncio.StreamWriter] = []

    def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    store = RedisResponseStore(StateConfig(backend="redis", url=f"redis://127.0.0.1:{port}", timeout_s=0.2))
    try:
        async with asyncio.timeout(2.0):
            with pytest.raises(StateUnavailable, match="unavailable"):
                await store.get("a", "r1")
    finally:
        await store.close()
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()


class _Load:
    """Clients that keep asking until told to stop: chat completions and `store: false`
    Responses (which need no store) and `store: true` ones (which do); every answer's status
    and error code, counted by kind."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.answers: dict[str, Counter[tuple[int, str | None]]] = {
            kind: Counter() for kind in ("chat", "unstored", "stored")
        }
        self.stop = asyncio.Event()

    async def run(self, clients: int) -> None:
        async with _sdk(self.base, "alpha") as sdk:
            await asyncio.gather(*(self._client(sdk) for _ in range(clients)))

    async def _client(self, sdk: openai.AsyncOpenAI) -> None:
        while not self.stop.is_set():
            for kind in self.answers:
                self.answers[kind][await self._ask(sdk, kind)] += 1

    async def _ask(self, sdk: openai.AsyncOpenAI, kind: str) -> tuple[int, str | None]:
        try:
            if kind == "chat":
                messages: Any = [{"role": "user", "content": "hi"}]
                await sdk.chat.completions.create(model="sim", messages=messages, max_tokens=4)
            else:
                await sdk.responses.create(input="hi", store=kind == "stored", model=MODEL, max_output_tokens=TOKENS)
        except openai.APIStatusError as exc:
            return exc.status_code, exc.code
        return 200, None

    def count(self, kind: str, answer: tuple[int, str | None]) -> int:
        return self.answers[kind][answer]


async def test_redis_killed_and_restarted_mid_load_only_what_needs_it_is_a_503(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    async with redis_server(tmp_path) as server, _gateways(qwen3_tokenizer_dir, tmp_path, server.url, count=1) as (base,):
        load = _Load(base)
        clients = asyncio.create_task(load.run(clients=4))
        ok, down = (200, None), (503, "state_unavailable")
        try:
            await wait_until(lambda: load.count("stored", ok) >= 4, what="stored responses before the kill")
            await server.kill()
            served = {kind: load.count(kind, ok) for kind in ("chat", "unstored")}
            await wait_until(lambda: load.count("stored", down) >= 4, what="503s with the store down")
            await wait_until(
                lambda: all(load.count(kind, ok) >= served[kind] + 4 for kind in served),
                what="requests that need no store served while it is down",
            )
            await _streamed_while_down(base)
            await server.start()
            stored = load.count("stored", ok)
            await wait_until(lambda: load.count("stored", ok) >= stored + 4, what="storing again once it is back")
        finally:
            load.stop.set()
            await clients
        for kind, answers in load.answers.items():
            allowed = {ok, down} if kind == "stored" else {ok}
            assert set(answers) <= allowed, (kind, answers)
        async with _sdk(base, "alpha") as sdk:  # and the restarted store serves continuations
            first = await sdk.responses.create(input="hi", model=MODEL, max_output_tokens=TOKENS)
            assert (await sdk.responses.create(input="more", previous_response_id=first.id, model=MODEL, max_output_tokens=TOKENS)).id
            with pytest.raises(openai.NotFoundError):
                await sdk.responses.retrieve("resp_" + "0" * 32)


async def _streamed_while_down(base: str) -> None:
    """A streamed `store: true` answer whose store is down ends in the API's error event, not a
    broken stream; GET and a continuation are 503s in OpenAI's error shape."""
    headers = {"Authorization": f"Bearer {KEYS['alpha']}"}
    async with aiohttp.ClientSession(base_url=base + "/", headers=headers) as session:
        async with session.post("responses", json={"input": "hi", "stream": True, **ASK}) as response:
            assert response.status == 200
            events = [line for line in (await response.text()).split("\n\n") if line]
        assert events[-1].startswith("event: error\n")
        error = json.loads(events[-1].split("data: ", 1)[1])
        assert error["code"] == "state_unavailable" and "retry later" in error["message"]
        for method, path, body in (
            ("GET", "responses/resp_x", None),
            ("DELETE", "responses/resp_x", None),
            ("POST", "responses", {"input": "and?", "previous_response_id": "resp_x", **ASK}),
        ):
            async with session.request(method, path, json=body) as response:
                assert response.status == 503, (method, path)
                error = (await response.json())["error"]
            assert (error["type"], error["code"]) == ("server_error", "state_unavailable")
