"""End to end with the official `openai` SDK: gateway + embedded engine (sim backend), every route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from engine.config import EngineConfig
from onehop.serve import embedded
from engine.state import ENGINE
from gateway.serving.state import GATEWAY

ROUTES = ["derender", "text", "tokens"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    }
]
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.fixture
async def gateway(qwen3_tokenizer_dir: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, Any]]:
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim", backend_options={"seed": 3})
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running:
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        try:
            yield client, running.gateway[GATEWAY]
        finally:
            await client.close()


def route(name: str) -> dict[str, Any]:
    return {"extra_headers": {"onehop-route": name}}


def visible_message(completion: Any) -> list[dict[str, Any]]:
    """What a client sees of a non-streaming chat completion (tool-call ids are random per route)."""
    out = []
    for choice in completion.choices:
        message = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        logprobs = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
        out.append(
            {
                "index": choice.index,
                "content": message.content,
                "reasoning": getattr(message, "reasoning", None),
                "tool_calls": calls,
                "finish_reason": choice.finish_reason,
                "logprobs": [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in logprobs],
            }
        )
    return out


async def visible_stream(stream: Any) -> dict[str, Any]:
    """A streamed chat answer folded per choice, plus the usage chunk."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    roles = []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            entry = choices.setdefault(choice.index, {"content": "", "reasoning": "", "calls": {}, "finish": None, "logprobs": []})
            delta = choice.delta
            if delta.role:
                roles.append(delta.role)
            entry["content"] += delta.content or ""
            entry["reasoning"] += getattr(delta, "reasoning", None) or ""
            for call in delta.tool_calls or []:
                slot = entry["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                if call.function and call.function.name:
                    slot["name"] = call.function.name
                slot["arguments"] += (call.function.arguments or "") if call.function else ""
            if choice.logprobs and choice.logprobs.content:
                entry["logprobs"] += [(lp.token, lp.logprob) for lp in choice.logprobs.content]
            if choice.finish_reason:
                entry["finish"] = choice.finish_reason
    for entry in choices.values():
        entry["calls"] = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(entry["calls"].items())]
    return {"choices": dict(sorted(choices.items())), "usage": usage, "roles": roles}


async def test_chat_with_tools_and_reasoning_is_identical_on_every_route(gateway: Any) -> None:
    client, _ = gateway
    answers = {}
    for name in ROUTES:
        completion = await client.chat.completions.create(
            model="sim", messages=MESSAGES, tools=TOOLS, logprobs=True, top_logprobs=2, seed=5, **route(name)
        )
        answers[name] = visible_message(completion)
    assert answers["derender"] == answers["text"] == answers["tokens"]
    choice = answers["derender"][0]
    assert choice["reasoning"] and choice["finish_reason"] == "tool_calls"
    assert [name for name, _ in choice["tool_calls"]] == ["get_weather"]
    assert set(choice["tool_calls"][0][1]) >= {"city", "unit"}
    assert all(len(top) == 2 for _, _, top in choice["logprobs"])


async def test_streaming_with_usage_n2_is_identical_on_every_route(gateway: Any) -> None:
    client, _ = gateway
    answers = {}
    for name in ROUTES:
        stream = await client.chat.completions.create(
            model="sim",
            messages=MESSAGES,
            tools=TOOLS,
            n=2,
            seed=9,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=1,
            **route(name),
        )
        answers[name] = await visible_stream(stream)
    assert answers["derender"] == answers["text"] == answers["tokens"]
    result = answers["tokens"]
    assert set(result["choices"]) == {0, 1} and result["roles"] == ["assistant", "assistant"]
    assert result["usage"]["completion_tokens"] == sum(len(c["logprobs"]) for c in result["choices"].values())
    assert result["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]


@pytest.mark.parametrize(
    "tool_choice",
    ["none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["none", "auto", "required", "named"],
)
async def test_tool_choice(gateway: Any, tool_choice: Any) -> None:
    client, _ = gateway
    results = []
    for name in ROUTES:
        completion = await client.chat.completions.create(
            model="sim", messages=MESSAGES, tools=TWO_TOOLS, tool_choice=tool_choice, seed=1, **route(name)
        )
        results.append(visible_message(completion))
        streamed = await visible_stream(
            await client.chat.completions.create(
                model="sim", messages=MESSAGES, tools=TWO_TOOLS, tool_choice=tool_choice, seed=1, stream=True, **route(name)
            )
        )
        assert streamed["choices"][0]["calls"] == results[-1][0]["tool_calls"]
    assert results[0] == results[1] == results[2]
    choice = results[0][0]
    calls = choice["tool_calls"]
    if tool_choice == "none":
        assert calls == [] and "<tool_call>" in (choice["content"] or "")
    elif tool_choice == "auto":
        assert len(calls) == 1 and calls[0][0] in {"get_weather", "get_time"}
    else:
        assert len(calls) == 1 and choice["finish_reason"] == "tool_calls" and choice["reasoning"] is None
        if isinstance(tool_choice, dict):
            assert calls[0][0] == "get_time" and set(calls[0][1]) == {"tz"}


async def test_tool_choice_errors(gateway: Any) -> None:
    client, _ = gateway
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        await client.chat.completions.create(
            model="sim", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        await client.chat.completions.create(model="sim", messages=MESSAGES, tool_choice="required")


async def test_reasoning_off_and_stop(gateway: Any) -> None:
    client, _ = gateway
    results = []
    for name in ROUTES:
        completion = await client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": "Say something."}],
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            stop=["e"],
            seed=2,
            **route(name),
        )
        results.append(visible_message(completion))
        streamed = await visible_stream(
            await client.chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": "Say something."}],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                stop=["e"],
                seed=2,
                stream=True,
                **route(name),
            )
        )
        assert streamed["choices"][0]["content"] == (results[-1][0]["content"] or "")
    assert results[0] == results[1] == results[2]
    choice = results[0][0]
    assert choice["reasoning"] is None
    assert "e" not in (choice["content"] or "") and choice["finish_reason"] == "stop"


async def test_completions_with_a_prompt_list(gateway: Any) -> None:
    client, _ = gateway
    answers = {}
    for name in ROUTES:
        completion = await client.completions.create(
            model="sim", prompt=["Once upon a time", "The weather"], max_tokens=12, n=2, seed=4, **route(name)
        )
        answers[name] = [(c.index, c.text, c.finish_reason) for c in completion.choices], completion.usage.model_dump()
        stream = await client.completions.create(
            model="sim",
            prompt=["Once upon a time", "The weather"],
            max_tokens=12,
            n=2,
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
            **route(name),
        )
        texts: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        assert {i: t for i, t, _ in answers[name][0]} == texts
        assert usage is not None and usage["completion_tokens"] == answers[name][1]["completion_tokens"]
    assert answers["derender"] == answers["text"] == answers["tokens"]
    assert [i for i, _, _ in answers["tokens"][0]] == [0, 1, 2, 3]


async def test_completion_with_token_id_prompt(gateway: Any, qwen3_tokenizer: Any) -> None:
    client, _ = gateway
    ids = qwen3_tokenizer.encode("Hello there")
    completion = await client.completions.create(model="sim", prompt=ids, max_tokens=5, echo=False)
    assert completion.choices[0].text and completion.usage.prompt_tokens == len(ids)


async def test_models_and_errors(gateway: Any) -> None:
    client, _ = gateway
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim"]
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        await client.chat.completions.create(model="sim", messages=MESSAGES, extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="response_format"):  # a json_schema without its schema
        await client.chat.completions.create(
            model="sim", messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
        )
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.chat.completions.create(model="sim", messages=MESSAGES, temperature=7)
    with pytest.raises(openai.BadRequestError, match="onehop-route"):
        await client.chat.completions.create(model="sim", messages=MESSAGES, extra_headers={"onehop-route": "carrier-pigeon"})
    ok = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"


async def test_errors_carry_the_codes_clients_match_on(gateway: Any) -> None:
    """What litellm, LangChain and pydantic-ai look at: OpenAI's `type` and string `code`."""
    client, _ = gateway
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert (missing.value.type, missing.value.code) == ("invalid_request_error", "model_not_found")
    too_long = [{"role": "user", "content": "word " * 40_000}]  # more tokens than the 32768 context
    for create in (
        lambda: client.chat.completions.create(model="sim", messages=too_long, max_tokens=2),
        lambda: client.completions.create(model="sim", prompt=[1] * 33_000, max_tokens=2),
    ):
        with pytest.raises(openai.BadRequestError) as overflow:
            await create()
        assert (overflow.value.type, overflow.value.code) == ("invalid_request_error", "context_length_exceeded")
        assert "maximum context length is 32768 tokens" in overflow.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        await client.chat.completions.create(model="sim", messages=MESSAGES, extra_body={"foo_bar": 1})
    assert (unknown.value.code, unknown.value.param) == ("unknown_parameter", "foo_bar")
    with pytest.raises(openai.BadRequestError, match="functions") as legacy:
        await client.chat.completions.create(
            model="sim", messages=MESSAGES, functions=[{"name": "f", "parameters": {"type": "object"}}]
        )
    assert legacy.value.param == "functions"


async def test_client_disconnect_aborts_the_engine_request(qwen3_tokenizer_dir: Path) -> None:
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim", backend_options={"itl_ms": 5})
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running:
        backend = running.engine[ENGINE].backend  # assert on the engine's backend, not on the client
        for name in ROUTES:
            client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
            stream = await client.chat.completions.create(
                model="sim", messages=MESSAGES, stream=True, max_tokens=5000, extra_body={"ignore_eos": True}, **route(name)
            )
            count = 0
            async for _ in stream:
                count += 1
                if count == 5:
                    break
            assert backend.running()
            await stream.close()
            await client.close()
            deadline = asyncio.get_running_loop().time() + 2
            while backend.running() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            assert not backend.running(), name


async def test_gateway_metrics_after_real_requests(gateway: Any) -> None:
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    client, _ = gateway
    for name in ROUTES:
        await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4, **route(name))
    streamed: dict[str, int] = {}
    for name in ("derender", "tokens"):
        stream = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=6, stream=True, **route(name))
        streamed[name] = len([chunk async for chunk in stream])
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    async with aiohttp.ClientSession() as session, session.get(str(client.base_url).replace("/v1/", "/metrics")) as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {
        (s.labels["route"], s.labels["status"]): s.value
        for s in families["onehop_gateway_requests"].samples
        if s.name.endswith("_total")
    }
    assert counts[("derender", "200")] == counts[("tokens", "200")] == 2 and counts[("text", "200")] == 1
    assert counts[("none", "404")] == 1

    def by_route(name: str, suffix: str) -> dict[str, float]:
        return {s.labels["route"]: s.value for s in families[name].samples if s.name.endswith(suffix)}

    # Streams only: one first-token time each, and a gap per later write.
    assert by_route("onehop_gateway_time_to_first_token_seconds", "_count") == {"derender": 1, "tokens": 1}
    gaps = by_route("onehop_gateway_inter_token_latency_seconds", "_count")
    # The token route writes what one engine read made in one write: a chunk each, or fewer
    # writes when several engine events came together.
    assert 1 <= gaps["tokens"] <= streamed["tokens"] - 1
    assert gaps["derender"] >= 1  # the relay writes what arrives, however the bytes were cut
    assert by_route("onehop_gateway_request_duration_seconds", "_count") == {"derender": 2, "text": 1, "tokens": 2, "none": 1}
    stages = {
        s.labels["stage"]: s.value for s in families["onehop_gateway_stage_seconds"].samples if s.name.endswith("_count")
    }
    assert stages == {"render": 5, "policy": 5, "derender": 3}  # derender: the text and token routes only
    cpu = {s.labels["route"]: s.value for s in families["onehop_gateway_derender_cpu_seconds"].samples if s.name.endswith("_total")}
    assert set(cpu) == {"text", "tokens"} and all(v > 0 for v in cpu.values())
    decisions = {
        (s.labels["route"], s.labels["rule"]): s.value
        for s in families["onehop_gateway_policy_decisions"].samples
        if s.name.endswith("_total")
    }
    assert decisions == {("derender", "header"): 2, ("text", "header"): 1, ("tokens", "header"): 2}
