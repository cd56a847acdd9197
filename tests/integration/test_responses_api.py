"""`/v1/responses` end to end: the `openai` SDK's `responses` client through a real gateway in
front of a sim engine, on every route, streamed and not; a function tool round trip both by
`previous_response_id` (the gateway's store) and by sending the items back; `parse()` with a
pydantic model; stored responses read and deleted; refusals named; Codex CLI's request shapes
(namespace, custom and hosted tools, its own fields) and vLLM's sampling extras."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncStream
from openai.types.responses import (
    CustomToolParam,
    NamespaceToolParam,
    Response,
    ResponseCompletedEvent,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseStreamEvent,
)
from pydantic import BaseModel, Field

from engine.qwen3.fixtures import cache_dir
from gateway.config import Agents as AgentsConfig
from gateway.serving.state import GatewayState
from tests.support import harmony_tokenizer
from tests.support.engine import engine_server
from tests.support.family_tokenizers import build_family_tokenizer
from tests.support.gateway import gateway_server
from tests.support.narrow import of

Agents = tuple[openai.AsyncOpenAI, GatewayState]

ROUTES = ["derender", "text", "tokens"]
# Sent as clients send it, without `strict`: the SDK's FunctionToolParam requires that key (the
# API leaves it optional), so the calls that pass WEATHER ignore the list-item error it gives.
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class City(BaseModel):
    name: str = Field(max_length=40)
    population: int = Field(ge=0)


@pytest.fixture
async def client(qwen3_tokenizer_dir: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as sdk,
    ):
        yield sdk


@pytest.fixture
async def agents(qwen3_tokenizer_dir: Path) -> AsyncIterator[Agents]:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, state),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as sdk,
    ):
        yield sdk, state


def _route(route: str) -> dict[str, Any]:
    return {"extra_headers": {"onehop-route": route}}


def stream_of(answer: Response | AsyncStream[ResponseStreamEvent]) -> AsyncStream[ResponseStreamEvent]:
    """The events of a `stream=True` create, typed: the SDK's overloads cannot tell its stream from an
    answer when some of the call's options come in a `**` dict or as a tool it does not type."""
    assert isinstance(answer, AsyncStream), f"expected a stream, got {answer!r}"
    return answer


@pytest.mark.parametrize("route", ROUTES)
async def test_text_answer_streamed_and_not_agree(client: openai.AsyncOpenAI, route: str) -> None:
    whole = of(Response, await client.responses.create(model="sim", input="Say something.", instructions="Be brief.", **_route(route)))
    assert whole.status == "completed" and whole.id.startswith("resp_")
    assert [item.type for item in whole.output] == ["reasoning", "message"]  # the sim thinks first
    assert whole.output_text and whole.usage is not None and whole.usage.output_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = [event async for event in stream_of(await client.responses.create(
        model="sim", input="Say something.", instructions="Be brief.", stream=True, **_route(route)))]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = of(ResponseCompletedEvent, events[-1]).response
    assert streamed == final.output_text == whole.output_text  # the sim's answer depends on the prompt alone
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("route", ROUTES)
async def test_function_tool_round_trip_by_previous_response_id(client: openai.AsyncOpenAI, route: str) -> None:
    first = of(Response, await client.responses.create(model="sim", input="Weather in Paris?", tools=[WEATHER], **_route(route)))  # type: ignore[list-item]
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in calls[0].arguments
    second = of(Response, await client.responses.create(
        model="sim",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        **_route(route),
    ))
    assert second.status == "completed" and second.previous_response_id == first.id
    # The stored turn reached the model: the prompt grew by the first answer and the tool output.
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


async def test_function_tool_round_trip_streamed_without_store(client: openai.AsyncOpenAI) -> None:
    events = [event async for event in stream_of(await client.responses.create(
        model="sim", input="Weather in Paris?", tools=[WEATHER], store=False, stream=True))]  # type: ignore[list-item]
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    final = of(ResponseCompletedEvent, events[-1]).response
    call = next(item for item in final.output if item.type == "function_call")
    assert done.arguments == call.arguments and call.name == "get_weather"
    with pytest.raises(openai.BadRequestError):  # not stored: it cannot be continued
        await client.responses.create(model="sim", previous_response_id=final.id, input="and?")
    items: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = await client.responses.create(model="sim", input=items, tools=[WEATHER], store=False)  # type: ignore[list-item]
    assert second.status == "completed"


@pytest.mark.parametrize("route", ROUTES)
async def test_parse_gives_a_valid_instance(client: openai.AsyncOpenAI, route: str) -> None:
    answer = await client.responses.parse(model="sim", input="Describe a city.", text_format=City, **_route(route))
    assert isinstance(answer.output_parsed, City)


async def test_reasoning_effort_none_turns_thinking_off(client: openai.AsyncOpenAI) -> None:
    answer = await client.responses.create(model="sim", input="Hi", reasoning={"effort": "none"})
    assert [item.type for item in answer.output] == ["message"]


async def test_stored_responses_are_read_and_deleted(client: openai.AsyncOpenAI) -> None:
    created = await client.responses.create(model="sim", input="Hi", max_output_tokens=8)
    assert created.status == "incomplete" and created.incomplete_details is not None
    assert created.incomplete_details.reason == "max_output_tokens"
    read = await client.responses.retrieve(created.id)
    assert read.id == created.id and read.output_text == created.output_text
    await client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(created.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"tools": [{"type": "namespace", "name": "empty", "description": "Nothing.", "tools": []}]}, "tools[0].tools"),
        ({"tools": [{"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}]},
         "tools[0].format.definition"),
        ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "output": "x"}]}, "input[1].call_id"),
    ],
)
async def test_what_is_not_served_is_refused_by_name(client: openai.AsyncOpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="sim", input="Hi", extra_body=extra)
    assert refused.value.param == param and refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]


# ------------------------------------------------------------ coding agents (Codex CLI 0.171's shapes)

AGENTS: NamespaceToolParam = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [{
        "type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
        "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"], "additionalProperties": False},
    }],
}
PATCH: CustomToolParam = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: /[a-z ]+/'},
}


def codex_body(tools: list[Any], **fields: Any) -> dict[str, Any]:
    """What Codex CLI 0.171 sends first with its default settings, cut to its shape."""
    return {
        "model": "sim",
        "stream": True,
        "input": [
            {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "id": "msg_2", "role": "developer", "content": [{"type": "input_text", "text": "<skills_instructions/>"}]},
            {"type": "message", "id": "msg_3", "role": "user", "content": [{"type": "input_text", "text": "Start a helper."}]},
        ],
        "tools": [*tools, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a249b4-97ba-7623-9179-2693ca0c3c9d",
        "client_metadata": {"x-codex-turn-metadata": '{"session_id": "01a249b4"}'},
        **fields,
    }


async def events_of(client: openai.AsyncOpenAI, body: dict[str, Any], route: str) -> list[ResponseStreamEvent]:
    stream = await client.responses.create(**{k: v for k, v in body.items() if k != "client_metadata"},
                                           extra_body={"client_metadata": body["client_metadata"]}, **_route(route))
    return [event async for event in stream_of(stream)]


def dropped(state: GatewayState, kind: str) -> float:
    return state.metrics.dropped_tools.labels("responses", kind)._value.get()


@pytest.mark.parametrize("route", ROUTES)
async def test_codex_namespace_call_and_its_output_without_call_id(agents: Agents, route: str) -> None:
    client, state = agents
    before = dropped(state, "web_search")
    events = await events_of(client, codex_body([AGENTS]), route)
    assert events[-1].type == "response.completed" and dropped(state, "web_search") == before + 1
    added = [event.item for event in events if event.type == "response.output_item.added" and event.item.type == "function_call"]
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    final = of(ResponseCompletedEvent, events[-1]).response
    call = next(item for item in final.output if item.type == "function_call")
    assert [(item.name, item.namespace) for item in added] == [("spawn_agent", "multi_agent_v1")]
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1") and "task" in call.arguments
    assert done[0].arguments == call.arguments and done[0].model_extra == {"name": "spawn_agent"}
    assert [tool.type for tool in final.tools] == ["namespace"]
    # Codex sends the call back with its namespace, and (after its goal tools) an output with none.
    body = codex_body([AGENTS])
    body["input"] += [
        {"type": "function_call", "call_id": call.call_id, "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": call.arguments},
        {"type": "function_call_output", "name": "spawn_agent", "namespace": "multi_agent_v1", "output": "agent 7 started"},
    ]
    again = await events_of(client, body, route)
    assert again[-1].type == "response.completed"


@pytest.mark.parametrize("route", ROUTES)
async def test_custom_tool_call_round_trip(client: openai.AsyncOpenAI, route: str) -> None:
    whole = of(Response, await client.responses.create(model="sim", input="Patch it.", tools=[PATCH], **_route(route)))
    call = of(ResponseCustomToolCall, whole.output[-1])
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.namespace is None
    assert call.input and not call.input.startswith("{")  # the text itself, not the function's JSON
    events = [event async for event in stream_of(await client.responses.create(
        model="sim", input="Patch it.", tools=[PATCH], stream=True, **_route(route)))]
    kinds = [event.type for event in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
    done = next(event for event in events if event.type == "response.custom_tool_call_input.done")
    final = of(ResponseCompletedEvent, events[-1]).response
    assert done.input == call.input == of(ResponseCustomToolCall, final.output[-1]).input  # the sim's answer depends on the prompt
    items: list[Any] = [
        {"role": "user", "content": "Patch it."},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name, "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"},
    ]
    second = await client.responses.create(model="sim", input=items, tools=[PATCH], store=False, **_route(route))
    assert second.status == "completed"
    followed = await client.responses.create(
        model="sim", previous_response_id=whole.id, tools=[PATCH],
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}], **_route(route))
    assert followed.usage is not None and whole.usage is not None
    assert followed.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens


@pytest.mark.parametrize("route", ROUTES)
async def test_a_forced_custom_tool_on_an_engine_without_grammars_is_a_forced_call(client: openai.AsyncOpenAI, route: str) -> None:
    answer = of(Response, await client.responses.create(  # type: ignore[call-overload]  # WEATHER, as above
        model="sim", input="Patch it.", tools=[WEATHER, PATCH], tool_choice={"type": "custom", "name": "apply_patch"},
        **_route(route)))
    calls = [of(ResponseCustomToolCall, item) for item in answer.output]
    assert [(call.type, call.name) for call in calls] == [("custom_tool_call", "apply_patch")]


async def test_hosted_tools_refused_when_the_config_says_so(qwen3_tokenizer_dir: Path) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url, agents=AgentsConfig(hosted_tools="refuse")) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as sdk,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.responses.create(model="sim", input="Hi", tools=[WEATHER, {"type": "web_search"}])  # type: ignore[list-item]
        assert refused.value.param == "tools[1].type" and "web_search" in refused.value.message


async def test_ignore_eos_runs_to_the_limit(client: openai.AsyncOpenAI) -> None:
    plain = await client.responses.create(model="sim", input="Hi", max_output_tokens=400)
    assert plain.status == "completed" and plain.usage is not None and plain.usage.output_tokens < 400
    held = await client.responses.create(model="sim", input="Hi", max_output_tokens=400, extra_body={"ignore_eos": True, "min_p": 0.1})
    assert held.status == "incomplete" and held.usage is not None and held.usage.output_tokens == 400


async def test_input_tokens_counts_the_prompt_create_renders(client: openai.AsyncOpenAI) -> None:
    counted = await client.responses.input_tokens.count(model="sim", input="Weather in Paris?", instructions="Be brief.", tools=[WEATHER])  # type: ignore[list-item]
    assert counted.object == "response.input_tokens"
    created = await client.responses.create(model="sim", input="Weather in Paris?", instructions="Be brief.", tools=[WEATHER])  # type: ignore[list-item]
    assert created.usage is not None and counted.input_tokens == created.usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        await client.responses.input_tokens.count(model="sim", input=[])


@pytest.mark.parametrize("route", ROUTES)
async def test_a_forced_call_with_a_json_format_is_answered_with_the_call(client: openai.AsyncOpenAI, route: str) -> None:
    answer = of(Response, await client.responses.create(  # type: ignore[call-overload]  # WEATHER, as above
        model="sim", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
        text={"format": {"type": "json_schema", "name": "city", "schema": City.model_json_schema()}}, **_route(route)))
    assert [item.type for item in answer.output] == ["function_call"]
    assert of(ResponseFunctionToolCall, answer.output[0]).name == "get_weather"
    assert answer.text is not None and answer.text.format is not None and answer.text.format.type == "json_schema"


@pytest.fixture
async def harmony(qwen3_tokenizer_dir: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    """gpt-oss's output (Harmony, the `openai` tool parser and `openai_gptoss` reasoning) from
    the sim, read by the gateway: the combination vLLM 0.33 refuses every non-function tool on."""
    folder = build_family_tokenizer(cache_dir(), "e2e-openai", [(text, True) for text in harmony_tokenizer.MARKERS])
    parsers = {"tool_parser": "openai", "reasoning_parser": "openai_gptoss"}
    async with (
        engine_server(folder, backend_options={"seed": 11}, **parsers) as (engine_url, _),
        gateway_server(folder, engine_url, **parsers) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as sdk,
    ):
        yield sdk


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("tool", "kind", "name", "namespace"),
    [
        (WEATHER, "function_call", "get_weather", None),
        (AGENTS, "function_call", "spawn_agent", "multi_agent_v1"),
        (PATCH, "custom_tool_call", "apply_patch", None),
        ({**AGENTS, "tools": [PATCH]}, "custom_tool_call", "apply_patch", "multi_agent_v1"),
    ],
)
async def test_harmony_calls_of_every_tool_kind(
    harmony: openai.AsyncOpenAI, route: str, tool: dict[str, Any], kind: str, name: str, namespace: str | None
) -> None:
    body = codex_body([tool], stream=False)
    whole = of(Response, await harmony.responses.create(**{k: v for k, v in body.items() if k != "client_metadata"}, **_route(route)))
    call = whole.output[-1]
    assert isinstance(call, (ResponseFunctionToolCall, ResponseCustomToolCall)), call
    assert (call.type, call.name, call.namespace) == (kind, name, namespace)
    assert call.type == "function_call" or not call.input.startswith("{")  # a custom tool's text itself
    events = await events_of(harmony, codex_body([tool]), route)
    final = of(ResponseCompletedEvent, events[-1]).response
    assert final.output[-1].model_dump(exclude={"id", "call_id"}) == call.model_dump(exclude={"id", "call_id"})  # the prompt decides it
    output = {"type": "function_call_output" if kind == "function_call" else "custom_tool_call_output", "call_id": call.call_id, "output": "ok"}
    sent_back = call.model_dump(exclude={"id", "status"}, exclude_none=True)
    items: list[Any] = [*body["input"], sent_back, output]  # Codex's own items, as it sends them
    again = await harmony.responses.create(model="sim", input=items, tools=[tool], **_route(route))  # type: ignore[list-item]  # a tool of any kind, WEATHER among them
    assert again.status == "completed"
