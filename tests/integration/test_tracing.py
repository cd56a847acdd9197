"""Traces end to end: openai SDK → gateway → engine, exported over OTLP/HTTP to a real receiver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from engine.config import EngineConfig
from plumbing.telemetry import TracingConfig
from onehop.serve import embedded
from tests.support.otlp import Receiver, ReceivedSpan, otlp_receiver

SECRET = "zebra-quartz-secret-prompt"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"Say hello. {SECRET}"}]
ENGINE_SPAN = "POST /inference/v1/generate"


async def _run(tokenizer: Path, receiver: Receiver, *, record_content: bool = False) -> list[Any]:
    tracing = TracingConfig(endpoint=receiver.url, record_content=record_content)
    engine = EngineConfig(backend="sim", model=str(tokenizer), served_model_name="sim", tracing=tracing)
    answers: list[Any] = []
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running:
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
        async with client:
            stream = await client.chat.completions.create(
                model="sim", messages=MESSAGES, max_tokens=12, temperature=0.5, top_p=0.9, stream=True,
                extra_headers={"onehop-route": "derender"},
            )
            answers.append([chunk async for chunk in stream])
            answers.append(
                await client.chat.completions.create(
                    model="sim", messages=MESSAGES, max_tokens=8, extra_headers={"onehop-route": "tokens"}
                )
            )
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="nope", messages=MESSAGES)
    # Leaving `embedded` shut both apps down, and with them their exporters: everything is flushed.
    return answers


def _server_spans(receiver: Receiver) -> list[ReceivedSpan]:
    return sorted(
        (s for s in receiver.spans if s.service == "onehop-gateway" and s.kind == "SERVER"), key=lambda s: s.start_ns
    )


async def test_span_tree_crosses_gateway_and_engine(qwen3_tokenizer_dir: Path) -> None:
    async with otlp_receiver() as receiver:
        answers = await _run(qwen3_tokenizer_dir, receiver)
    streamed, whole = answers
    servers = _server_spans(receiver)
    # Named by the model the request asks for (GenAI conventions), served or not.
    assert [s.name for s in servers] == ["chat sim", "chat sim", "chat nope"]
    relayed, derendered, missing = servers

    # The streaming request on the derender route: GenAI attributes and onehop's own.
    a = relayed.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "sim"
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.response.id"] == streamed[0].id
    finish = [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason]
    assert a["gen_ai.response.finish_reasons"] == finish
    assert a["gen_ai.usage.input_tokens"] > 0 and 0 < a["gen_ai.usage.output_tokens"] <= 12
    assert a["onehop.route"] == "derender" and a["onehop.policy.reason"] == "onehop-route header"
    assert a["onehop.engine.endpoint"].startswith("http://127.0.0.1:")
    assert a["onehop.time_to_first_token_s"] > 0
    assert a["http.response.status_code"] == 200 and relayed.status_code == 0

    children = {s.name: s for s in receiver.children(relayed)}
    assert set(children) == {"render", "policy", "engine.generate"}
    assert children["engine.generate"].kind == "CLIENT"
    assert children["render"].attributes["onehop.prompt_tokens"] == a["gen_ai.usage.input_tokens"]
    assert children["policy"].attributes["onehop.policy.rule"] == "header"

    # The engine continues the trace under the gateway's client span (traceparent).
    (engine,) = receiver.children(children["engine.generate"])
    assert engine.name == ENGINE_SPAN and engine.service == "onehop-engine" and engine.kind == "SERVER"
    e = engine.attributes
    assert e["onehop.output_mode"] == "derender"
    assert e["onehop.engine.queue_s"] == 0.0  # the simulator starts every request at once
    assert e["onehop.engine.time_to_first_token_s"] > 0 and e["onehop.engine.generation_s"] >= 0
    assert e["onehop.engine.output_cpu_s"] > 0
    assert e["gen_ai.usage.output_tokens"] == a["gen_ai.usage.output_tokens"]
    assert engine.start_ns >= children["engine.generate"].start_ns

    # The token route adds the gateway's derender span; the outcome is what the client saw.
    names = sorted(s.name for s in receiver.children(derendered))
    assert names == ["derender", "engine.generate", "policy", "render"]
    (derender,) = [s for s in receiver.children(derendered) if s.name == "derender"]
    assert derender.attributes["onehop.route"] == "tokens" and derender.attributes["onehop.derender.cpu_s"] > 0
    d = derendered.attributes
    assert d["gen_ai.response.finish_reasons"] == [whole.choices[0].finish_reason]
    assert d["gen_ai.usage.output_tokens"] == whole.usage.completion_tokens
    (engine_tokens,) = [s for s in receiver.spans if s.name == ENGINE_SPAN and s.attributes["onehop.output_mode"] == "tokens"]
    assert engine_tokens.trace_id == derendered.trace_id

    # A refused request: error.type on the server span, no engine work.
    assert missing.attributes["error.type"] == "ModelNotFound"
    assert missing.attributes["gen_ai.request.model"] == "nope"
    assert missing.attributes["http.response.status_code"] == 404
    assert receiver.children(missing) == []

    # Prompt and completion text never leave the process by default.
    assert not any(SECRET.encode() in body for body in receiver.bodies)
    assert not any(k.startswith("gen_ai.input") or k.startswith("gen_ai.output") for s in receiver.spans for k in s.attributes)


async def test_prompt_text_only_with_the_opt_in(qwen3_tokenizer_dir: Path) -> None:
    async with otlp_receiver() as receiver:
        await _run(qwen3_tokenizer_dir, receiver, record_content=True)
    served = [s for s in _server_spans(receiver) if s.attributes["http.response.status_code"] == 200]
    assert len(served) == 2
    assert all(SECRET in s.attributes["gen_ai.input.messages"] for s in served)


async def test_a_callers_traceparent_is_continued(qwen3_tokenizer_dir: Path) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with otlp_receiver() as receiver:
        engine = EngineConfig(
            backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim", tracing=TracingConfig(endpoint=receiver.url)
        )
        async with (
            embedded(engine, host="127.0.0.1", port=0, route="text") as running,
            openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client,
        ):
            await client.completions.create(
                model="sim", prompt="Once", max_tokens=4, extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}
            )
    (server,) = _server_spans(receiver)
    assert server.name == "text_completion sim"
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert (server.trace_id, server.parent_id) == (trace_id, parent_id)
    assert {s.trace_id for s in receiver.spans} == {trace_id}
    assert {s.service for s in receiver.spans} == {"onehop-gateway", "onehop-engine"}


async def _gateway_alone(tokenizer: Path, tracing: TracingConfig, engine_url: str) -> Any:
    from aiohttp import web

    from gateway.serving.app import create_app
    from gateway.config import EngineEndpoint, GatewayConfig

    config = GatewayConfig(
        model="sim", tokenizer=str(tokenizer), engines=[EngineEndpoint(url=engine_url)], tracing=tracing
    )
    runner = web.AppRunner(create_app(config), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner


async def test_an_engine_failure_marks_the_spans(qwen3_tokenizer_dir: Path, unused_tcp_port: int) -> None:
    async with otlp_receiver() as receiver:
        runner = await _gateway_alone(qwen3_tokenizer_dir, TracingConfig(endpoint=receiver.url), f"http://127.0.0.1:{unused_tcp_port}")
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
                with pytest.raises(openai.InternalServerError):
                    await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4)
        finally:
            await runner.cleanup()
    (server,) = _server_spans(receiver)
    assert server.attributes["error.type"] == "EngineUnavailable" and server.status_code == 2
    (policy,) = [s for s in receiver.children(server) if s.name == "policy"]
    assert policy.attributes["error.type"] == "EngineUnavailable" and policy.status_code == 2


async def test_sampling_ratio_zero_exports_nothing(qwen3_tokenizer_dir: Path, unused_tcp_port: int) -> None:
    async with otlp_receiver() as receiver:
        tracing = TracingConfig(endpoint=receiver.url, sample_ratio=0.0)
        runner = await _gateway_alone(qwen3_tokenizer_dir, tracing, f"http://127.0.0.1:{unused_tcp_port}")
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
                with pytest.raises(openai.NotFoundError):
                    await client.chat.completions.create(model="nope", messages=MESSAGES)
        finally:
            await runner.cleanup()
    assert receiver.spans == []
