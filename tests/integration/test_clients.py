"""Third-party clients as users run them, through `base_url`, against a gateway in front of a
sim engine: LangChain's `ChatOpenAI` (structured output by its default method, a tool round
trip) and litellm's `acompletion` (streamed, and with `response_format`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field, SecretStr

from tests.support.engine import engine_server
from tests.support.gateway import gateway_server

ASK = [{"role": "user", "content": "Describe a city."}]


class City(BaseModel):
    name: str
    population: int = Field(ge=0)
    landmarks: list[str]


@pytest.fixture
async def base(qwen3_tokenizer_dir: Path) -> AsyncIterator[str]:
    async with engine_server(qwen3_tokenizer_dir) as (engine_url, _), gateway_server(qwen3_tokenizer_dir, engine_url) as (url, _):
        yield url


@pytest.mark.parametrize("route", ["derender", "text", "tokens"])
async def test_langchain_structured_output_by_its_default_method(base: str, route: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="sim", base_url=base, api_key=SecretStr("none"), max_retries=0, default_headers={"onehop-route": route})
    city = await llm.with_structured_output(City).ainvoke("Describe a city.")
    assert isinstance(city, City)


async def test_langchain_tool_round_trip(base: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model="sim", base_url=base, api_key=SecretStr("none"), max_retries=0).bind_tools([get_weather])
    messages: list[Any] = [HumanMessage("Weather in Paris?")]
    first = await llm.ainvoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather"
    call = first.tool_calls[0]
    messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    second = await llm.ainvoke(messages)  # the tool's answer goes back; the model answers again
    assert second.content or second.tool_calls


async def test_litellm_acompletion_streamed_and_structured(base: str) -> None:
    import litellm

    stream = await litellm.acompletion(model="openai/sim", api_base=base, api_key="none", messages=ASK, stream=True, max_tokens=20)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text
    answer = await litellm.acompletion(
        model="openai/sim", api_base=base, api_key="none", messages=ASK, response_format=City, max_tokens=500
    )
    City.model_validate_json(answer.choices[0].message.content)


class Weather(BaseModel):
    city: str
    summary: str


WEATHER_SCRIPT = [
    '<think>\nA tool knows.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<think>\nIt said sunny.\n</think>\n\n{"city": "Paris", "summary": "sunny"}',
]
"""The model's two turns: a call, then the answer in the output type's schema."""


async def test_agents_sdk_default_agent_with_a_tool_and_an_output_type(qwen3_tokenizer_dir: Path) -> None:
    """The Agents SDK's default model is the Responses API: a run calls the tool, sends its
    output back and ends with a typed answer."""
    import openai
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    options = {"mode": "script", "script": WEATHER_SCRIPT}
    async with (
        engine_server(qwen3_tokenizer_dir, backend_options=options) as (engine_url, _),
        gateway_server(qwen3_tokenizer_dir, engine_url) as (base, _),
        openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as client,
    ):
        set_tracing_disabled(True)
        set_default_openai_client(client, use_for_tracing=False)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], output_type=Weather, model="sim")
        result = await Runner.run(agent, "Weather in Paris?")
    assert seen == ["Paris"]
    assert result.final_output == Weather(city="Paris", summary="sunny")


async def test_langchain_responses_api(base: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="sim", base_url=base, api_key=SecretStr("none"), max_retries=0, use_responses_api=True)
    answer = await llm.ainvoke("Say something.")
    assert answer.text
