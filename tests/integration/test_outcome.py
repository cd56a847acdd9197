"""Each API request ends in exactly one outcome event, on every route and every way it can end,
and its tokens are what the client was told (usage as the SDKs read it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from onehop.serve import Embedded, embedded
from gateway.observe.outcome import CLIENT_GONE, Outcome
from gateway.serving.state import GATEWAY

ROUTES = ("derender", "text", "tokens")
WAIT_S = 10.0


@dataclass
class Seen:
    """The outcomes emitted, and a way to wait for the next ones without sleeping."""

    outcomes: list[Outcome] = field(default_factory=list)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    def __call__(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.arrived:
            self.arrived.notify_all()

    async def count(self, n: int) -> list[Outcome]:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.outcomes) >= n), WAIT_S)
        return self.outcomes


@pytest.fixture
async def gateway(qwen3_tokenizer_dir: Path) -> AsyncIterator[tuple[Embedded, Seen]]:
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim")
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running:
        seen = Seen()
        running.gateway[GATEWAY].outcomes.subscribe(seen)
        yield running, seen


def _chat(running: Embedded) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("route", ROUTES)
async def test_whole_and_streamed_chat_each_end_in_one_outcome_with_the_clients_usage(
    gateway: tuple[Embedded, Seen], route: str
) -> None:
    running, seen = gateway
    async with _chat(running) as client:
        whole = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "Say something."}], max_tokens=24,
            extra_headers={"onehop-route": route},
        )
        stream = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "Say something else."}], max_tokens=24, stream=True,
            stream_options={"include_usage": True}, extra_headers={"onehop-route": route},
        )
        reasons, usage = [], None
        async for chunk in stream:
            reasons += [choice.finish_reason for choice in chunk.choices if choice.finish_reason]
            usage = chunk.usage or usage
    first, second = await seen.count(2)
    assert len(seen.outcomes) == 2
    assert whole.usage is not None and usage is not None
    for outcome, told, finish in ((first, whole.usage, [whole.choices[0].finish_reason]), (second, usage, reasons)):
        assert (outcome.endpoint, outcome.model, outcome.route, outcome.status, outcome.error) == (
            "chat", "sim", route, 200, None
        )
        assert outcome.tokens is not None
        assert (outcome.tokens.prompt, outcome.tokens.completion) == (told.prompt_tokens, told.completion_tokens)
        assert told.completion_tokens > 0
        assert list(outcome.finish_reasons) == finish
        assert outcome.request_id is not None and outcome.duration_s > 0
    assert first.request_id != second.request_id


async def test_responses_and_messages_end_in_one_outcome_each(gateway: tuple[Embedded, Seen]) -> None:
    running, seen = gateway
    async with _chat(running) as client:
        answer = await client.responses.create(model="sim", input="Say something.", max_output_tokens=20)
    async with anthropic.AsyncAnthropic(base_url=running.url, api_key="unused", max_retries=0) as claude:
        message = await claude.messages.create(
            model="sim", max_tokens=20, messages=[{"role": "user", "content": "Say something."}]
        )
    responses, messages = await seen.count(2)
    assert answer.usage is not None
    assert (responses.endpoint, responses.status) == ("responses", 200)
    assert responses.tokens is not None
    assert (responses.tokens.prompt, responses.tokens.completion) == (
        answer.usage.input_tokens, answer.usage.output_tokens
    )
    assert (messages.endpoint, messages.status) == ("messages", 200)
    assert messages.tokens is not None
    assert (messages.tokens.prompt, messages.tokens.completion) == (
        message.usage.input_tokens, message.usage.output_tokens
    )


async def test_a_refused_request_ends_in_one_outcome_with_its_error_and_no_tokens(
    gateway: tuple[Embedded, Seen],
) -> None:
    running, seen = gateway
    async with _chat(running) as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="sim", messages=[], max_tokens=4)
    missing, invalid = await seen.count(2)
    assert (missing.status, missing.model, missing.tokens, missing.route) == (404, None, None, "none")
    assert missing.error is not None
    assert (invalid.status, invalid.tokens) == (400, None)
    assert invalid.error is not None


@pytest.mark.parametrize("route", ROUTES)
async def test_a_client_that_leaves_mid_stream_ends_in_one_client_gone_outcome(
    gateway: tuple[Embedded, Seen], route: str
) -> None:
    running, seen = gateway
    body = {
        "model": "sim", "messages": [{"role": "user", "content": "A long story."}], "stream": True,
        "max_tokens": 4000, "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            running.url + "/v1/chat/completions", json=body, headers={"onehop-route": route}
        )
        assert response.status == 200
        await response.content.readany()
        response.close()
    (gone,) = await seen.count(1)
    assert (gone.status, gone.client_gone, gone.route, gone.endpoint) == (CLIENT_GONE, True, route, "chat")
    # No second event follows the first: an engine still streaming would only add to the count.
    async with _chat(running) as client:
        await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    outcomes = await seen.count(2)
    assert len(outcomes) == 2 and outcomes[1].status == 200


async def test_a_failing_subscriber_costs_neither_the_answer_nor_the_other_subscribers(
    gateway: tuple[Embedded, Seen],
) -> None:
    running, seen = gateway

    def broken(outcome: Outcome) -> None:
        raise RuntimeError("a broken consumer")

    running.gateway[GATEWAY].outcomes.subscribe(broken)
    after = Seen()
    running.gateway[GATEWAY].outcomes.subscribe(after)
    async with _chat(running) as client:
        answer = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
    assert answer.choices[0].message is not None
    assert len(await seen.count(1)) == 1
    assert len(await after.count(1)) == 1


async def test_the_token_metric_counts_what_the_outcomes_say(gateway: tuple[Embedded, Seen]) -> None:
    running, seen = gateway
    async with _chat(running) as client:
        for route in ROUTES:
            await client.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": f"Say {route}."}], max_tokens=16,
                extra_headers={"onehop-route": route},
            )
    outcomes = await seen.count(len(ROUTES))
    counted = {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(running.gateway[GATEWAY].metrics.render().decode())
        for sample in family.samples
        if sample.name == "onehop_gateway_tokens_total" and sample.labels["model"] == "sim"
    }
    assert counted["prompt"] == sum(o.tokens.prompt for o in outcomes if o.tokens is not None)
    assert counted["completion"] == sum(o.tokens.completion for o in outcomes if o.tokens is not None)
