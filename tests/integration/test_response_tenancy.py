"""Stored Responses per tenant, through a real gateway with two tenants' API keys in front of
a sim engine: another tenant's response is answered exactly as an unknown id, `metadata` is
bounded as OpenAI bounds it, one tenant's answers evict its own and not another's, and what
the store holds stays near its byte bound."""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.config import Auth, ResponseStoreConfig
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

# A long scenario (kills, crashes, hundreds of streams): kept out of the default suite, run
# by CI's `-m slow` stage.
SLOW = pytest.mark.slow

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}


@asynccontextmanager
async def _gateway(tokenizer: Path, tmp_path: Path, store: ResponseStoreConfig | None = None, auth: bool = True) -> AsyncIterator[str]:
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    config: dict[str, Any] = {"auth": Auth(api_keys_file=str(keys))} if auth else {}
    if store is not None:
        config["response_store"] = store
    async with engine_server(tokenizer) as (engine_url, _), gateway_server(tokenizer, engine_url, **config) as (base, _):
        yield base


@asynccontextmanager
async def _sessions(base: str) -> AsyncIterator[tuple[aiohttp.ClientSession, aiohttp.ClientSession]]:
    async with (
        aiohttp.ClientSession(base_url=base + "/", headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as alpha,
        aiohttp.ClientSession(base_url=base + "/", headers={"Authorization": f"Bearer {KEYS['beta']}"}) as beta,
    ):
        yield alpha, beta


async def _call(session: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    async with session.request(method, path, json=body) as response:
        return response.status, await response.read()


async def _create(session: aiohttp.ClientSession, **body: Any) -> str:
    status, raw = await _call(session, "POST", "responses", {"model": "sim", "max_output_tokens": 16, **body})
    assert status == 200, raw
    return str(json.loads(raw)["id"])


async def _probes(session: aiohttp.ClientSession, response_id: str) -> list[tuple[int, bytes]]:
    """Every way to reach a stored response by its id (the input-items list is not served: it
    must answer the same however the id stands)."""
    return [
        await _call(session, "GET", f"responses/{response_id}"),
        await _call(session, "GET", f"responses/{response_id}/input_items"),
        await _call(session, "POST", "responses", {"model": "sim", "input": "and?", "previous_response_id": response_id}),
        await _call(session, "DELETE", f"responses/{response_id}"),
    ]


async def test_another_tenants_response_is_answered_as_an_unknown_id(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    async with _gateway(qwen3_tokenizer_dir, tmp_path) as base, _sessions(base) as (alpha, beta):
        mine = await _create(alpha, input="A secret of alpha's.")
        foreign = await _probes(beta, mine)
        assert [status for status, _ in foreign] == [404, 404, 400, 404]  # OpenAI answers an unknown previous id with a 400

        # Alpha still has it all: beta's attempts changed nothing.
        async with openai.AsyncOpenAI(base_url=base, api_key=KEYS["alpha"], max_retries=0) as sdk:
            assert (await sdk.responses.retrieve(mine)).id == mine
            following = await sdk.responses.create(model="sim", input="and?", previous_response_id=mine, max_output_tokens=8)
            assert following.previous_response_id == mine and following.usage is not None
            await sdk.responses.delete(mine)
        async with openai.AsyncOpenAI(base_url=base, api_key=KEYS["beta"], max_retries=0) as sdk:
            with pytest.raises(openai.NotFoundError):
                await sdk.responses.retrieve(following.id)

        # Now the id is unknown to everyone: beta's earlier answers were exactly these.
        assert await _probes(alpha, mine) == foreign
        assert await _probes(beta, mine) == foreign


async def test_with_auth_off_everyone_is_one_tenant(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    async with (
        _gateway(qwen3_tokenizer_dir, tmp_path, auth=False) as base,
        aiohttp.ClientSession(base_url=base + "/") as one,
        aiohttp.ClientSession(base_url=base + "/") as other,
    ):
        stored = await _create(one, input="hi")
        assert (await _call(other, "GET", f"responses/{stored}"))[0] == 200


METADATA_AT_BOUND = {f"key{index:02d}".ljust(64, "k"): "v" * 512 for index in range(16)}
METADATA_PAST_BOUND = [
    ({f"k{index}": "v" for index in range(17)}, "at most 16 properties"),
    ({"k" * 65: "v"}, "key too long"),
    ({"k": "v" * 513}, "string too long"),
]


@pytest.mark.parametrize("path", ["responses", "chat/completions"])
async def test_metadata_is_bounded_as_openai_bounds_it(qwen3_tokenizer_dir: Path, tmp_path: Path, path: str) -> None:
    def body(metadata: dict[str, str]) -> dict[str, Any]:
        if path == "responses":
            return {"model": "sim", "input": "hi", "max_output_tokens": 4, "metadata": metadata}
        return {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "metadata": metadata}

    async with _gateway(qwen3_tokenizer_dir, tmp_path) as base, _sessions(base) as (alpha, _):
        status, raw = await _call(alpha, "POST", path, body(METADATA_AT_BOUND))
        assert status == 200, raw
        for metadata, named in METADATA_PAST_BOUND:
            async with alpha.post(path, json=body(metadata)) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            assert error["param"] == "metadata" and error["type"] == "invalid_request_error"
            assert named in error["message"] and "metadata" in error["message"]


async def test_one_tenants_answers_evict_its_own_not_anothers(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Beta stores far more than the whole store holds; alpha's one answer stays, and beta
    loses its own oldest."""
    store = ResponseStoreConfig(max_bytes=400_000, max_tenant_bytes=100_000)
    async with _gateway(qwen3_tokenizer_dir, tmp_path, store) as base, _sessions(base) as (alpha, beta):
        kept = await _create(alpha, input="alpha's only answer")
        betas = [await _create(beta, input=f"{index} " + "padding " * 2_500) for index in range(24)]  # ~20 KB each
        assert (await _call(alpha, "GET", f"responses/{kept}"))[0] == 200
        found = [(await _call(beta, "GET", f"responses/{one}"))[0] for one in betas]
        assert found[0] == 404 and found[-1] == 200
        assert found == sorted(found, reverse=True), "the oldest went first"  # 404s, then 200s
        assert 2 <= found.count(200) <= 5  # 100 KB of ~20 KB answers


@SLOW
async def test_the_store_holds_about_its_byte_bound(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Filled several times over with answers of varied size (some with logprobs, which as
    Python objects take several times their JSON), the process grows by little more than
    the store's bound (tracemalloc: everything this process allocated after a warm-up).
    The prompts come from a small set the warm-up has already rendered, so the gateway's
    render cache and the engine's token cache do not grow while measuring."""
    bound = 2 << 20
    store = ResponseStoreConfig(max_bytes=bound, max_tenant_bytes=bound)
    rng = random.Random(11)
    prompts = [" ".join(f"w{rng.randrange(1000)}" for _ in range(words)) for words in (1, 30, 200, 600, 1200, 2000)]
    async with _gateway(qwen3_tokenizer_dir, tmp_path, store) as base, _sessions(base) as (alpha, _):

        async def ask(prompt: str, max_tokens: int, top_logprobs: int | None) -> int:
            body: dict[str, Any] = {"model": "sim", "input": prompt, "max_output_tokens": max_tokens}
            if top_logprobs is not None:
                body["top_logprobs"] = top_logprobs
            status, raw = await _call(alpha, "POST", "responses", body)
            assert status == 200, raw
            return len(raw) + len(prompt)

        for prompt in prompts:  # every prompt rendered, every token seen, every pool warm
            for top_logprobs in (None, 20, None, 20):
                await ask(prompt, 128, top_logprobs)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            offered = 0
            for _ in range(200):
                offered += await ask(rng.choice(prompts), rng.randrange(8, 128), rng.choice((None, 20)))
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert offered > 3 * bound, "the answers must overflow the store for the test to mean anything"
    assert grown <= 1.5 * bound, f"the process grew by {grown / bound:.2f}x the store's bound"
