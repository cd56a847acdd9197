"""Named pools: a policy rule sends a tenant's requests (by API key) to its own engines."""

from __future__ import annotations

from pathlib import Path

import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest
from prometheus_client import Counter

from gateway.config import Auth, EngineEndpoint
from gateway.routing.policy import PolicyError
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
POLICY = """
rules:
  - name: batch-tenant
    match: {tenant: batch}
    route: text
    pool: batch
default: derender
"""


async def test_a_tenants_rule_moves_it_to_its_pool(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    (tmp_path / "keys").write_text("interactive-key\nbatch batch-key\n")
    auth = Auth(api_keys_file=str(tmp_path / "keys"))
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (main_url, main),
        engine_server(qwen3_tokenizer_dir, served_model_name="sim") as (batch_url, batch),
        gateway_server(
            qwen3_tokenizer_dir, main_url, pools={"batch": [EngineEndpoint(url=batch_url)]},
            policy=str(tmp_path / "policy.yaml"), auth=auth, route_header=False,
        ) as (base, _),
    ):
        for key, expected_route, rule in (("interactive-key", "derender", "default"), ("batch-key", "text", "batch-tenant")):
            async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
                for _ in range(3):
                    raw = await client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=2)
                    assert raw.headers["onehop-route"] == expected_route
                    assert rule in raw.headers["onehop-policy"]
        assert _served(main.metrics.requests) == {("derender", "200"): 3}
        assert _served(batch.metrics.requests) == {("text", "200"): 3}


def _served(requests: Counter) -> dict[tuple[str, str], float]:
    """An engine's request count by (mode, status)."""
    [family] = requests.collect()
    return {(s.labels["mode"], s.labels["status"]): s.value for s in family.samples if s.name.endswith("_total")}


async def test_a_rule_naming_an_unknown_pool_stops_the_start(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    with pytest.raises(PolicyError, match="pools the gateway config does not define: batch"):
        async with gateway_server(qwen3_tokenizer_dir, "http://127.0.0.1:9", policy=str(tmp_path / "policy.yaml")):
            pass
