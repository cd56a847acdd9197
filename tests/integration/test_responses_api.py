"""`/v1/responses` end to end: the `openai` SDK's `responses` client through a real gateway in
front of a sim engine, on every route, streamed and not; a function tool round trip both by
`previous_response_id` (the gateway's store) and by sending the items back; `parse()` with a
pydantic model; stored responses read and deleted; refusals named."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

ROUTES = ["derender", "text", "tokens"]
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


def _route(route: str) -> dict[str, Any]:
    return {"extra_headers": {"onehop-route": route}}


@pytest.mark.parametrize("route", ROUTES)
async def test_text_answer_streamed_and_not_agree(client: openai.AsyncOpenAI, route: str) -> None:
    whole = await client.responses.create(model="sim", input="Say something.", instructions="Be brief.", **_route(route))
    assert whole.status == "completed" and whole.id.startswith("resp_")
    assert [item.type for item in whole.output] == ["reasoning", "message"]  # the sim thinks first
    assert whole.output_text and whole.usage is not None and whole.usage.output_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = [event async for event in await client.responses.create(
        model="sim", input="Say something.", instructions="Be brief.", stream=True, **_route(route))]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert streamed == final.output_text == whole.output_text  # the sim's answer depends on the prompt alone
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("route", ROUTES)
async def test_function_tool_round_trip_by_previous_response_id(client: openai.AsyncOpenAI, route: str) -> None:
    first = await client.responses.create(model="sim", input="Weather in Paris?", tools=[WEATHER], **_route(route))  # type: ignore[list-item]
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in calls[0].arguments
    second = await client.responses.create(
        model="sim",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        **_route(route),
    )
    assert second.status == "completed" and second.previous_response_id == first.id
    # The stored turn reached the model: the prompt grew by the first answer and the tool output.
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


async def test_function_tool_round_trip_streamed_without_store(client: openai.AsyncOpenAI) -> None:
    events = [event async for event in await client.responses.create(
        model="sim", input="Weather in Paris?", tools=[WEATHER], store=False, stream=True)]  # type: ignore[list-item]
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    final = events[-1].response  # type: ignore[union-attr]
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
    ("extra", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "file_search"),
        ({"background": True}, "background"),
        ({"truncation": "sometimes"}, "truncation"),
    ],
)
async def test_what_is_not_served_is_refused_by_name(client: openai.AsyncOpenAI, extra: dict[str, Any], named: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="sim", input="Hi", extra_body=extra)
    assert named in str(refused.value.message)
