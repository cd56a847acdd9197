"""Each API request ends in exactly one outcome event, on every route and every way it can end,
and its tokens are what the client was told (usage as the SDKs read it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from engine.app import create_app as create_engine_app
from engine.backends.base import BackendError, BackendOutput, BackendRequest
from engine.backends.sim import SimBackend, SimBackendConfig
from engine.config import EngineConfig
from onehop.serve import Embedded, embedded
from gateway.config import Health
from gateway.observe.outcome import CLIENT_GONE, Outcome
from gateway.serving.state import GATEWAY, GatewayState
from tests.support.broken_engine import BrokenEngine, Fault, broken_engine
from tests.support.engine import AppServer, engine_server
from tests.support.gateway import gateway_server

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
    """By model, API and route: once per request, what its client was told."""
    running, seen = gateway
    told: dict[tuple[str, str], list[int]] = {}
    async with _chat(running) as client:
        for route in ROUTES:
            for _ in range(2):
                answer = await client.chat.completions.create(
                    model="sim", messages=[{"role": "user", "content": f"Say {route}."}], max_tokens=16,
                    extra_headers={"onehop-route": route},
                )
                assert answer.usage is not None
                add(told, ("chat", route), answer.usage.prompt_tokens, answer.usage.completion_tokens)
        answered = await client.responses.create(
            model="sim", input="Say something.", max_output_tokens=12, extra_headers={"onehop-route": "text"}
        )
        assert answered.usage is not None
        add(told, ("responses", "text"), answered.usage.input_tokens, answered.usage.output_tokens)
    async with anthropic.AsyncAnthropic(base_url=running.url, api_key="unused", max_retries=0) as claude:
        message = await claude.messages.create(
            model="sim", max_tokens=12, messages=[{"role": "user", "content": "Say something."}]
        )
        add(told, ("messages", "derender"), message.usage.input_tokens, message.usage.output_tokens)
    await seen.count(2 * len(ROUTES) + 2)
    counted: dict[tuple[str, str], list[int]] = {}
    for sample in _samples(running, "onehop_gateway_tokens_total"):
        assert sample.labels["model"] == "sim"
        kind = ("prompt", "completion").index(sample.labels["kind"]) if sample.labels["kind"] in ("prompt", "completion") else None
        if kind is not None:
            key = (sample.labels["endpoint"], sample.labels["route"])
            counted.setdefault(key, [0, 0])[kind] += int(sample.value)
    assert counted == told


def add(told: dict[tuple[str, str], list[int]], key: tuple[str, str], prompt: int, completion: int) -> None:
    total = told.setdefault(key, [0, 0])
    total[0] += prompt
    total[1] += completion


def _samples(running: Embedded, name: str) -> list[Sample]:
    text = running.gateway[GATEWAY].metrics.render().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name]


# ------------------------------------------------------------ streams that fail after their first byte


@pytest.fixture
async def dying(qwen3_tokenizer_dir: Path) -> AsyncIterator[tuple[str, BrokenEngine, GatewayState, Seen]]:
    """A gateway in front of a sim engine behind a proxy that can cut its answers (an engine that dies)."""
    async with (
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        broken_engine(engine_url) as (proxy_url, proxy),
        gateway_server(qwen3_tokenizer_dir, proxy_url, health=NEVER_OPENS) as (base, state),
    ):
        seen = Seen()
        state.outcomes.subscribe(seen)
        yield base, proxy, state, seen


NEVER_OPENS = Health(failure_threshold=1000, retries=0, interval_s=60)


def _count(state: GatewayState, name: str, **labels: str) -> float:
    return state.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("route", ROUTES)
async def test_a_stream_whose_engine_dies_after_its_first_byte_is_a_failure(
    dying: tuple[str, BrokenEngine, GatewayState, Seen], route: str
) -> None:
    """Its headers said 200; its answer ended in an error event. The one outcome says so, and the
    request is counted under the error's status and as a stream error, not as a 200 (issue #33)."""
    base, proxy, state, seen = dying
    proxy.fault = Fault("reset", at=2)
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "A story."}], max_tokens=24, stream=True,
            extra_headers={"onehop-route": route},
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
    (broken,) = await seen.count(1)
    assert (broken.status, broken.error, broken.stream_error, broken.client_gone) == (502, "EngineDied", True, False)
    labels = {"endpoint": "chat", "route": route, "model": "sim"}
    assert _count(state, "onehop_gateway_requests_total", **labels, status="502") == 1
    assert _count(state, "onehop_gateway_requests_total", **labels, status="200") == 0
    errors = {"endpoint": "chat", "route": route, "error": "EngineDied"}
    assert _count(state, "onehop_gateway_stream_errors_total", **errors) == 1


class FailsMidAnswer(SimBackend):
    """The simulator, whose generation fails after its second step (as a backend that ran out of KV
    blocks would): the engine ends its stream with its own error event."""

    async def generate(self, request: BackendRequest) -> AsyncGenerator[list[BackendOutput], None]:
        async with aclosing(super().generate(request)) as outputs:
            steps = 0
            async for batch in outputs:
                yield batch
                steps += 1
                if steps == 2:
                    raise BackendError("out of KV cache blocks")


@pytest.mark.parametrize("route", ROUTES)
async def test_a_stream_the_engine_ends_with_its_own_error_event_is_a_failure(
    qwen3_tokenizer_dir: Path, route: str
) -> None:
    """On the derender route the gateway relays the engine's error event as it came: the engine's
    summary tells it the stream failed. The other routes see the event themselves."""
    backend = FailsMidAnswer(SimBackendConfig(tokenizer=str(qwen3_tokenizer_dir)))
    engine = AppServer(create_engine_app(EngineConfig(model=str(qwen3_tokenizer_dir), backend="sim"), backend=backend))
    await engine.start_server()
    try:
        engine_url = str(engine.make_url("")).rstrip("/")
        async with gateway_server(qwen3_tokenizer_dir, engine_url, health=NEVER_OPENS) as (base, state):
            seen = Seen()
            state.outcomes.subscribe(seen)
            async with aiohttp.ClientSession() as session:
                body = {"model": "sim", "messages": [{"role": "user", "content": "A story."}], "max_tokens": 24, "stream": True}
                async with session.post(base + "/chat/completions", json=body, headers={"onehop-route": route}) as response:
                    status, raw = response.status, await response.read()
            assert status == 200 and b'data: {"error"' in raw and raw.endswith(b"data: [DONE]\n\n")
            (failed,) = await seen.count(1)
            assert (failed.status, failed.error, failed.stream_error) == (502, "EngineFailed", True)
            errors = {"endpoint": "chat", "route": route, "error": "EngineFailed"}
            assert _count(state, "onehop_gateway_stream_errors_total", **errors) == 1
    finally:
        await engine.close()


async def test_a_client_that_leaves_mid_stream_is_no_stream_error(gateway: tuple[Embedded, Seen]) -> None:
    running, seen = gateway
    body = {
        "model": "sim", "messages": [{"role": "user", "content": "A long story."}], "stream": True,
        "max_tokens": 4000, "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as session:
        response = await session.post(running.url + "/v1/chat/completions", json=body)
        await response.content.readany()
        response.close()
    (gone,) = await seen.count(1)
    assert (gone.status, gone.stream_error, gone.error) == (CLIENT_GONE, False, None)
    assert _samples(running, "onehop_gateway_stream_errors_total") == []


async def test_onehop_serve_metrics_carry_the_engines_too(gateway: tuple[Embedded, Seen]) -> None:
    """`onehop serve` keeps its engine on a private port: the gateway's /metrics serves the
    engine's `onehop_engine_*` after its own, so one scrape target fills the whole dashboard."""
    running, seen = gateway
    async with _chat(running) as client:
        await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    await seen.count(1)
    async with aiohttp.ClientSession() as session, session.get(running.url + "/metrics") as response:
        text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    (counted,) = [s for s in families["onehop_engine_requests"].samples if s.name == "onehop_engine_requests_total"]
    assert (counted.labels, counted.value) == ({"mode": "derender", "status": "200"}, 1.0)
    assert "onehop_engine_output_tokens" in families and "onehop_gateway_requests" in families
