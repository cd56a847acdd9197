"""Tenants' prefix caches kept apart by the gateway's `cache_salt` (`gateway.edge.tenancy`), end to
end: a sim engine with a prefix cache publishing vLLM's KV events, a gateway with API keys of
three tenants, the OpenAI SDK as each tenant's client. The salt each request reached the engine
with is read off the engine's own events (vLLM's: the first block's extra keys)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.config import Auth, GatewayConfig, EngineEndpoint, Tenant
from gateway.edge.tenancy import CacheSalts
from tests.integration.test_sim_prefix_cache import Subscriber, cached_engine, capabilities, prose
from tests.support.gateway import configured_gateway
from wire.kv_events import BlockStored

pytest_plugins = ["tests.integration.test_sim_prefix_cache"]  # its `session` and `subscribe` fixtures


async def test_each_tenant_gets_its_own_salt_and_a_clients_salt_is_replaced(
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    tmp_path: Path,
    session: aiohttp.ClientSession,
    subscribe: Callable[[str], Subscriber],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ONEHOP_CACHE_SALT_SECRET", "a deployment's secret")
    keys = tmp_path / "keys"
    keys.write_text("alpha key-alpha\nbeta key-beta\nlab key-lab\n")
    prompt = qwen3_tokenizer.decode(prose(qwen3_tokenizer, 300))
    async with cached_engine(qwen3_tokenizer_dir) as (engine, _):
        subscriber = subscribe((await capabilities(session, engine))["kv_events"]["endpoint"])
        await subscriber.join(session, engine)
        config = GatewayConfig(
            model="sim", tokenizer=str(qwen3_tokenizer_dir), engines=[EngineEndpoint(url=engine)],
            auth=Auth(api_keys_file=str(keys)), tenants={"lab": Tenant(share_cache=True)},
        )
        async with configured_gateway(config) as (base, _state):

            async def ask(key: str, salt: str | None = None) -> tuple[int, Any]:
                """(cached prompt tokens, the first block's extra keys in the blocks it stored)."""
                async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
                    answer = await client.chat.completions.create(
                        model="sim", messages=[{"role": "user", "content": prompt}], max_tokens=4,
                        extra_body={"cache_salt": salt} if salt else None,
                    )
                assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
                cached = answer.usage.prompt_tokens_details.cached_tokens or 0
                stored = None
                if cached == 0:  # a cold prompt: its blocks are stored, and published
                    _, batch = await subscriber.next()
                    [event] = batch.events
                    assert isinstance(event, BlockStored)
                    stored = event.extra_keys[0] if event.extra_keys else None
                return cached, stored

            salts = CacheSalts(config)
            cold, alpha_salt = await ask("key-alpha", salt="alpha's own choice")
            assert cold == 0 and alpha_salt == [salts.salt("alpha", None)]  # the gateway's, not the client's
            assert (await ask("key-alpha"))[0] > 0  # alpha's second request: its own blocks
            cold, beta_salt = await ask("key-beta", salt="alpha's own choice")
            assert cold == 0 and beta_salt not in (None, alpha_salt)  # the same prompt, another tenant: cold
            cold, lab_salt = await ask("key-lab", salt="lab-1")
            assert cold == 0 and lab_salt == ["lab-1"]  # a tenant that shares cache keeps the client's salt
            assert (await ask("key-lab", salt="lab-1"))[0] > 0


def test_salts_are_keyed_by_the_secret_and_stable_across_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    config = GatewayConfig(model="m", tokenizer="t", engines=[EngineEndpoint(url="http://e:1")])
    monkeypatch.setenv("ONEHOP_CACHE_SALT_SECRET", "one")
    first = CacheSalts(config)
    assert first.salt("alpha", None) == CacheSalts(config).salt("alpha", "ignored")  # same secret: same salt
    assert first.salt(None, "client") == "client"  # no tenant: the client's, as vLLM
    monkeypatch.setenv("ONEHOP_CACHE_SALT_SECRET", "two")
    assert CacheSalts(config).salt("alpha", None) != first.salt("alpha", None)
