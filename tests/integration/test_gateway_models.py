"""Several models behind one base_url: each with its own tokenizer, parsers and engines.

Two sim engines, one serving a Qwen3 model (qwen3 reasoning, hermes tool calls)
and one a Kimi-K2-format model (special-token markers), behind one gateway:
the `openai` SDK gets each model's own answers on every route, `/v1/models`
lists both, and a pool whose engines serve another model or other parsers is
refused at start with a message naming both sides.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypedDict

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from engine.qwen3.fixtures import cache_dir
from gateway.serving.app import create_app
from gateway.config import ConfigError, EngineEndpoint, GatewayConfig, ModelConfig
from tests.support import kimi_k2
from tests.support.engine import engine_server
from tests.support.family_tokenizers import build_family_tokenizer
from tests.support.gateway import configured_gateway
from tests.support.tools import WEATHER_TOOLS

ROUTES = ["derender", "text", "tokens"]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


class Parsers(TypedDict):
    """A model's parser pair, as both the engine and the gateway config name it."""

    reasoning_parser: str
    tool_parser: str


QWEN = Parsers(reasoning_parser="qwen3", tool_parser="hermes")
KIMI = Parsers(reasoning_parser="kimi_k2", tool_parser="kimi_k2")


def _kimi_dir() -> Path:
    return build_family_tokenizer(cache_dir(), "e2e-kimi_k2", [(text, True) for text in kimi_k2.SPECIALS])


@asynccontextmanager
async def _two_models(qwen3_tokenizer_dir: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """Engines for `qwen` and `kimi`, and a gateway serving both (`kimi` also as `moonshot`)."""
    kimi_dir = _kimi_dir()
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="qwen", backend_options={"seed": 3}, **QWEN) as (qwen_url, _),
        engine_server(kimi_dir, served_model_name="kimi", backend_options={"seed": 3}, **KIMI) as (kimi_url, _),
    ):
        config = GatewayConfig(
            models=[
                ModelConfig(name="qwen", tokenizer=str(qwen3_tokenizer_dir), engines=[EngineEndpoint(url=qwen_url)], **QWEN),
                ModelConfig(
                    name="kimi", aliases=["moonshot"], tokenizer=str(kimi_dir), engines=[EngineEndpoint(url=kimi_url)], **KIMI
                ),
            ],
            route_header=True,
        )
        async with configured_gateway(config) as (base, _):
            yield base, {"qwen": qwen_url, "kimi": kimi_url}


async def _answer(client: openai.AsyncOpenAI, model: str, route: str, stream: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": model, "messages": MESSAGES, "tools": WEATHER_TOOLS, "seed": 4, "max_tokens": 200,
        "extra_headers": {"onehop-route": route},
    }
    if not stream:
        completion = await client.chat.completions.create(**kwargs)
        message = completion.choices[0].message
        return {
            "model": completion.model,
            "reasoning": getattr(message, "reasoning", None) or "",
            "content": message.content or "",
            "calls": [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []],
            "finish": completion.choices[0].finish_reason,
        }
    reasoning, content, finish, names = "", "", None, set()
    calls: dict[int, dict[str, str]] = {}
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        names.add(chunk.model)
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"name": "", "arguments": ""})
                slot["name"] += (call.function.name or "") if call.function else ""
                slot["arguments"] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    (name,) = names
    return {
        "model": name,
        "reasoning": reasoning,
        "content": content,
        "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
        "finish": finish,
    }


async def test_each_model_gets_its_own_answers_on_every_route(qwen3_tokenizer_dir: Path) -> None:
    async with (
        _two_models(qwen3_tokenizer_dir) as (base, engines),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
        aiohttp.ClientSession() as session,
    ):
        answers: dict[str, dict[str, Any]] = {}
        for model in ("qwen", "kimi"):
            for route in ROUTES:
                for stream in (False, True):
                    answers[f"{model} {route} {'stream' if stream else 'json'}"] = await _answer(client, model, route, stream)
        for model in ("qwen", "kimi"):
            reference = answers[f"{model} derender json"]
            assert reference["model"] == model
            assert reference["finish"] == "tool_calls" and reference["calls"][0][0] == "get_weather"
            assert reference["reasoning"], f"{model}: the sim reasons first"
            for name, answer in answers.items():
                if name.startswith(model + " "):
                    assert answer == reference, f"{name} differs from {model} derender json"
        # The two families write different text: each model's markers were parsed by its own parsers.
        assert "<tool_call>" not in answers["qwen tokens json"]["content"]
        assert "<|tool_call" not in answers["kimi tokens json"]["content"]
        for route in ("derender", "tokens"):  # an alias is echoed on every route, as vLLM echoes a served name
            alias = await _answer(client, "moonshot", route, False)
            assert alias == {**answers[f"kimi {route} json"], "model": "moonshot"}

        # Each model's requests went to its own engine.
        served = {model: await _served(session, url) for model, url in engines.items()}
        assert served == {"qwen": 6, "kimi": 8}

        with pytest.raises(openai.NotFoundError, match="`nope`"):
            await client.chat.completions.create(model="nope", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError, match="`nope`"):
            await client.completions.create(model="nope", prompt="hi")


async def _served(session: aiohttp.ClientSession, engine_url: str) -> int:
    async with session.get(engine_url + "/metrics") as response:
        text = await response.text()
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "onehop_engine_requests"
            for sample in family.samples
            if sample.name.endswith("_total")
        )
    )


async def test_models_are_listed_with_their_context(qwen3_tokenizer_dir: Path) -> None:
    async with (
        _two_models(qwen3_tokenizer_dir) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
        aiohttp.ClientSession() as session,
    ):
        listed = await client.models.list()
        assert [m.id for m in listed.data] == ["qwen", "kimi"]
        assert all(m.model_extra and m.model_extra["max_model_len"] > 0 for m in listed.data)
        kimi = await client.models.retrieve("kimi")
        assert kimi.id == "kimi"
        assert (await client.models.retrieve("moonshot")).id == "kimi"
        async with session.get(base + "/models/nope") as response:
            assert response.status == 404
            assert "`nope`" in (await response.json())["error"]["message"]


async def _refused(config: GatewayConfig) -> str:
    server = TestServer(create_app(config))
    try:
        with pytest.raises(ConfigError) as refused:
            await server.start_server()
    finally:
        await server.close()
    return str(refused.value)


async def test_a_pool_that_serves_another_model_or_other_parsers_is_refused(qwen3_tokenizer_dir: Path) -> None:
    kimi_dir = _kimi_dir()
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="qwen", **QWEN) as (qwen_url, _),
        engine_server(kimi_dir, served_model_name="kimi", **{**KIMI, "tool_parser": None}) as (kimi_url, _),
    ):
        wrong_model = GatewayConfig(
            models=[
                ModelConfig(name="qwen", tokenizer=str(qwen3_tokenizer_dir), engines=[EngineEndpoint(url=qwen_url)], **QWEN),
                ModelConfig(name="kimi", tokenizer=str(kimi_dir), engines=[EngineEndpoint(url=qwen_url)], **KIMI),
            ]
        )
        message = await _refused(wrong_model)
        assert qwen_url in message and "'qwen'" in message and "'kimi'" in message

        wrong_parsers = GatewayConfig(model="kimi", tokenizer=str(kimi_dir), engines=[EngineEndpoint(url=kimi_url)], **KIMI)
        message = await _refused(wrong_parsers)
        assert kimi_url in message and "tool parser None" in message and "'kimi_k2'" in message


MODEL_POLICY = """
rules:
  - name: qwen-tokens
    match: {model: qwen}
    route: tokens
  - name: kimi-batch
    match: {model: kimi, header: {name: x-batch, equals: "1"}}
    route: text
    pool: batch
default: derender
"""


async def test_policy_rules_match_the_model_and_send_to_its_pools(qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(MODEL_POLICY)
    kimi_dir = _kimi_dir()
    async with (
        engine_server(qwen3_tokenizer_dir, served_model_name="qwen", **QWEN) as (qwen_url, _),
        engine_server(kimi_dir, served_model_name="kimi", **KIMI) as (kimi_url, _),
        engine_server(kimi_dir, served_model_name="kimi", **KIMI) as (batch_url, _),
        aiohttp.ClientSession() as session,
    ):
        config = GatewayConfig(
            models=[
                ModelConfig(name="qwen", tokenizer=str(qwen3_tokenizer_dir), engines=[EngineEndpoint(url=qwen_url)], **QWEN),
                ModelConfig(
                    name="kimi", aliases=["moonshot"], tokenizer=str(kimi_dir), engines=[EngineEndpoint(url=kimi_url)],
                    pools={"batch": [EngineEndpoint(url=batch_url)]}, **KIMI,
                ),
            ],
            policy=str(tmp_path / "policy.yaml"),
            policy_header=True,
        )
        async with (
            configured_gateway(config) as (base, _),
            openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
        ):
            for model, headers, route, rule in (
                ("qwen", {}, "tokens", "qwen-tokens"),
                ("kimi", {}, "derender", "default"),
                ("moonshot", {"x-batch": "1"}, "text", "kimi-batch"),  # an alias matches as its model
                ("qwen", {"x-batch": "1"}, "tokens", "qwen-tokens"),
            ):
                raw = await client.chat.completions.with_raw_response.create(
                    model=model, messages=MESSAGES, max_tokens=4, extra_headers=headers
                )
                assert (raw.headers["onehop-route"], rule in raw.headers["onehop-policy"]) == (route, True), model
        served = {name: await _served(session, url) for name, url in (("qwen", qwen_url), ("kimi", kimi_url), ("batch", batch_url))}
        assert served == {"qwen": 2, "kimi": 1, "batch": 1}


async def test_a_tool_parser_whose_markers_the_vocabulary_lacks_stops_the_start(qwen3_tokenizer_dir: Path) -> None:
    """Kimi K2's call markers are no tokens of Qwen3's vocabulary: every tool request would fail,
    so the start fails instead, naming the marker (the engine likewise)."""
    from engine.app import create_app as create_engine_app
    from engine.config import EngineConfig
    from derender.parsers import UnknownParser

    config = GatewayConfig(
        model="qwen", tokenizer=str(qwen3_tokenizer_dir), engines=[EngineEndpoint(url="http://127.0.0.1:9")], tool_parser="kimi_k2"
    )
    message = await _refused(config)
    assert "tool parser 'kimi_k2'" in message and "<|tool_calls_section_begin|>" in message

    engine = TestServer(create_engine_app(EngineConfig(model=str(qwen3_tokenizer_dir), backend="sim", tool_parser="kimi_k2")))
    try:
        with pytest.raises(UnknownParser, match="tool_calls_section_begin"):
            await engine.start_server()
    finally:
        await engine.close()
