"""Structured outputs end to end: the `openai` SDK's `parse()` and vLLM's `structured_outputs`
extension through a real gateway in front of sim engines, on every route.

The sim engine writes an instance of the schema (after its reasoning, as vLLM constrains only
once reasoning ends); the gateway maps `response_format` to `sampling_params.structured_outputs`
as vLLM does and sends a constrained request only to an engine that enforces its kind.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import aiohttp
import openai
import pytest
from pydantic import BaseModel

from tests.support.engine import engine_server, post_json
from tests.support.gateway import gateway_server

ROUTES = ["derender", "text", "tokens"]
ASK = [{"role": "user", "content": "Describe a person."}]


class Address(BaseModel):
    city: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]
    tags: list[str]
    home: Address
    nickname: str | None
    born: datetime


@pytest.fixture
async def gateway(qwen3_tokenizer_dir: Path) -> Any:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        yield client, base


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("thinking", [True, False])
async def test_parse_gives_a_valid_instance_on_every_route(gateway: Any, route: str, thinking: bool) -> None:
    client, _ = gateway
    answer = await client.chat.completions.parse(
        model="sim",
        messages=ASK,
        response_format=Person,
        max_tokens=1000,
        extra_headers={"onehop-route": route},
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
    )
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person), message.content
    assert Person.model_validate_json(message.content or "") == message.parsed
    reasoning = getattr(message, "reasoning", None) or (message.model_extra or {}).get("reasoning")
    assert bool(reasoning) == thinking  # the schema holds after the reasoning, which stays out of content


@pytest.mark.parametrize("route", ROUTES)
async def test_streamed_json_schema_and_completions(gateway: Any, route: str) -> None:
    client, _ = gateway
    schema = Person.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    stream = await client.chat.completions.create(
        model="sim", messages=ASK, response_format=response_format, max_tokens=1000, stream=True,
        extra_headers={"onehop-route": route},
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    Person.model_validate_json(text)
    completion = await client.completions.create(
        model="sim", prompt="A person as JSON:", max_tokens=1000, extra_headers={"onehop-route": route},
        extra_body={"response_format": response_format},
    )
    Person.model_validate_json(completion.choices[0].text)


async def test_vllm_structured_outputs_choice_json_and_json_object(gateway: Any) -> None:
    client, _ = gateway
    choices = ["red", "green", "blue"]
    for n in range(4):
        answer = await client.chat.completions.create(
            model="sim", messages=ASK, seed=n, extra_body={"structured_outputs": {"choice": choices}}
        )
        assert answer.choices[0].message.content in choices
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = await client.chat.completions.create(
        model="sim", messages=ASK, max_tokens=200, extra_body={"structured_outputs": {"json": json.dumps(schema)}}
    )
    assert isinstance(json.loads(answer.choices[0].message.content or "")["ok"], bool)
    answer = await client.chat.completions.create(model="sim", messages=ASK, max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


async def test_what_cannot_be_constrained_is_a_400_naming_it(gateway: Any) -> None:
    client, _ = gateway
    with pytest.raises(openai.BadRequestError, match=r"structured_outputs\.regex") as regex:  # the sim enforces no regex
        await client.chat.completions.create(model="sim", messages=ASK, extra_body={"structured_outputs": {"regex": "a+"}})
    assert regex.value.param == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="one kind of structured outputs"):
        await client.chat.completions.create(
            model="sim", messages=ASK, extra_body={"structured_outputs": {"choice": ["a"], "regex": "a"}}
        )
    with pytest.raises(openai.BadRequestError, match="structural_tag"):
        await client.chat.completions.create(model="sim", messages=ASK, response_format={"type": "structural_tag"})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="forced tool call"):
        await client.chat.completions.create(
            model="sim", messages=ASK, tools=[tool], tool_choice="required", response_format={"type": "json_object"}
        )


def _generated(engine: Any) -> float:
    """Generate requests an engine served (its `onehop_engine_requests_total`)."""
    return sum(s.value for m in engine.metrics.requests.collect() for s in m.samples if s.name.endswith("_total"))


async def test_only_engines_that_enforce_the_constraint_are_picked(qwen3_tokenizer_dir: Path) -> None:
    """A tokens-only engine enforces nothing; beside one that does, it never gets a constrained
    request; alone, a constrained request is a 400 and a plain one is still served."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = {"model": "sim", "messages": ASK, "max_tokens": 50, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    async with (
        engine_server(qwen3_tokenizer_dir, tokens_only=True) as (blind_url, blind),
        engine_server(qwen3_tokenizer_dir) as (able_url, able),
        aiohttp.ClientSession() as session,
    ):
        async with gateway_server(qwen3_tokenizer_dir, [blind_url, able_url]) as (base, _):
            for _ in range(8):
                status, answer, _ = await post_json(session, base + "/chat/completions", constrained)
                assert status == 200, answer
                assert isinstance(json.loads(answer["choices"][0]["message"]["content"])["n"], int)
        assert (_generated(blind), _generated(able)) == (0, 8)
        async with gateway_server(qwen3_tokenizer_dir, blind_url) as (base, _):
            status, answer, _ = await post_json(session, base + "/chat/completions", constrained)
            assert status == 400 and "structured_outputs.json" in answer["error"]["message"], answer
            status, answer, _ = await post_json(session, base + "/chat/completions", {"model": "sim", "messages": ASK, "max_tokens": 3})
            assert status == 200, answer


async def test_the_engine_refuses_a_kind_its_backend_cannot_enforce(qwen3_tokenizer_dir: Path) -> None:
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _), aiohttp.ClientSession() as session:
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "structured_outputs": {"grammar": "root ::= \"a\""}}}
        status, answer, _ = await post_json(session, engine_url + "/inference/v1/generate", body)
        assert status == 400 and "structured_outputs.grammar" in answer["error"]["message"], answer
        async with session.get(engine_url + "/inference/v1/capabilities") as response:
            assert (await response.json())["structured_outputs"] == ["choice", "json", "json_object"]
