"""Traces end to end: openai SDK → gateway → engine, exported over OTLP/HTTP to a real receiver."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from engine.config import EngineConfig
from plumbing.telemetry import TracingConfig
from onehop.serve import embedded
from tests.support.broken_engine import Fault, broken_engine
from tests.support.engine import engine_server
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


def assert_one_llm_span_per_trace(receiver: Receiver, *, traces: int) -> None:
    by_trace: dict[str, list[ReceivedSpan]] = {}
    for span in receiver.spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert len(by_trace) == traces
    for spans in by_trace.values():
        (llm,) = [s for s in spans if s.attributes.get("openinference.span.kind") == "LLM"]
        assert llm.service == "onehop-gateway" and llm.kind == "SERVER"
        for other in spans:
            if other is not llm:
                assert not [k for k in other.attributes if k.startswith(("gen_ai.", "llm."))], other


def _server_spans(receiver: Receiver) -> list[ReceivedSpan]:
    return sorted(
        (s for s in receiver.spans if s.service == "onehop-gateway" and s.kind == "SERVER"), key=lambda s: s.start_ns
    )


async def test_span_tree_crosses_gateway_and_engine(qwen3_tokenizer_dir: Path) -> None:
    async with otlp_receiver() as receiver:
        answers = await _run(qwen3_tokenizer_dir, receiver)
    streamed, whole = answers
    servers = _server_spans(receiver)
    # Named by the served model (GenAI conventions); a name the client made up is not a span's name.
    assert [s.name for s in servers] == ["chat sim", "chat sim", "chat"]
    relayed, derendered, missing = servers

    # The streaming request on the derender route: GenAI attributes and onehop's own.
    a = relayed.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "onehop"
    assert a["gen_ai.request.model"] == "sim" and a["gen_ai.response.model"] == "sim"
    assert a["onehop.stream"] is True and a["gen_ai.request.stream"] is True
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.response.id"] == streamed[0].id
    finish = [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason]
    assert a["gen_ai.response.finish_reasons"] == finish
    assert a["gen_ai.usage.input_tokens"] > 0 and 0 < a["gen_ai.usage.output_tokens"] <= 12
    # The same in OpenInference's names, which LLM trace UIs (Phoenix) read and sum per project.
    assert a["openinference.span.kind"] == "LLM" and a["llm.provider"] == "onehop" and a["llm.model_name"] == "sim"
    assert (a["llm.token_count.prompt"], a["llm.token_count.completion"], a["llm.token_count.total"]) == (
        a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
        a["gen_ai.usage.input_tokens"] + a["gen_ai.usage.output_tokens"],
    )
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
    # A step of the gateway's LLM call, not a second one: its tokens under onehop's names only.
    assert e["openinference.span.kind"] == "CHAIN" and e["onehop.engine.model"] == "sim"
    assert e["onehop.engine.output_tokens"] == a["gen_ai.usage.output_tokens"]
    assert e["onehop.engine.input_tokens"] == a["gen_ai.usage.input_tokens"]
    assert engine.start_ns >= children["engine.generate"].start_ns

    # The token route's derender work is on the server span (it is spread over the answer);
    # the outcome is what the client saw.
    names = sorted(s.name for s in receiver.children(derendered))
    assert names == ["engine.generate", "policy", "render"]
    d = derendered.attributes
    assert d["onehop.route"] == "tokens" and d["onehop.derender.cpu_s"] > 0 and d["onehop.derender.chunks"] >= 1
    assert d["gen_ai.response.finish_reasons"] == [whole.choices[0].finish_reason]
    assert d["gen_ai.usage.output_tokens"] == whole.usage.completion_tokens
    (engine_tokens,) = [s for s in receiver.spans if s.name == ENGINE_SPAN and s.attributes["onehop.output_mode"] == "tokens"]
    assert engine_tokens.trace_id == derendered.trace_id

    # A refused request: error.type on the server span, no engine work.
    assert missing.attributes["error.type"] == "ModelNotFound"
    assert missing.attributes["gen_ai.request.model"] == "nope"
    assert missing.attributes["http.response.status_code"] == 404
    assert "gen_ai.response.model" not in missing.attributes
    assert receiver.children(missing) == []

    # One LLM call per trace (each request's tokens counted once): only the gateway's server span
    # is one, and no other span carries the GenAI names a trace UI would make another of.
    assert_one_llm_span_per_trace(receiver, traces=3)

    # Prompt and completion text never leave the process by default.
    assert not any(SECRET.encode() in body for body in receiver.bodies)
    assert not any(k.startswith("gen_ai.input") or k.startswith("gen_ai.output") for s in receiver.spans for k in s.attributes)


async def test_prompt_and_completion_text_only_with_the_opt_in(qwen3_tokenizer_dir: Path) -> None:
    async with otlp_receiver() as receiver:
        streamed, whole = await _run(qwen3_tokenizer_dir, receiver, record_content=True)
    served = [s for s in _server_spans(receiver) if s.attributes["http.response.status_code"] == 200]
    assert len(served) == 2
    assert all(SECRET in s.attributes["gen_ai.input.messages"] for s in served)
    # The completion as the client got it (GenAI's output messages: one per choice, in parts).
    deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
    told = [
        ("".join(getattr(d, "reasoning", None) or "" for d in deltas), "".join(d.content or "" for d in deltas)),
        (getattr(whole.choices[0].message, "reasoning", None) or "", whole.choices[0].message.content or ""),
    ]
    for span, (reasoning, text), finish in zip(
        served, told, [streamed[-1].choices[0].finish_reason, whole.choices[0].finish_reason], strict=True
    ):
        (message,) = json.loads(span.attributes["gen_ai.output.messages"])
        assert (message["role"], message["finish_reason"]) == ("assistant", finish)
        parts = {part["type"]: part["content"] for part in message["parts"]}
        assert (parts.get("reasoning", ""), parts.get("text", "")) == (reasoning, text)
        assert reasoning or text


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


TRACERESPONSE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


async def test_every_answer_names_its_trace(qwen3_tokenizer_dir: Path) -> None:
    """W3C `traceresponse` on every API answer, errors and streams included: the trace and
    server span of the request, so a client can find it in the trace UI."""
    sent: list[tuple[int, str]] = []
    async with otlp_receiver() as receiver:
        engine = EngineConfig(
            backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim",
            tracing=TracingConfig(endpoint=receiver.url),
        )
        async with (
            embedded(engine, host="127.0.0.1", port=0, route="text") as running,
            aiohttp.ClientSession(running.url) as session,
        ):
            chat = {"model": "sim", "messages": MESSAGES, "max_tokens": 4}
            for path, body in (
                ("/v1/chat/completions", chat),
                ("/v1/chat/completions", {**chat, "stream": True}),
                ("/v1/completions", {"model": "sim", "prompt": "Once", "max_tokens": 4}),
                ("/v1/messages", {"model": "sim", "max_tokens": 4, "messages": MESSAGES}),
                ("/v1/responses", {"model": "sim", "input": "hi", "max_output_tokens": 4, "stream": True}),
                ("/v1/chat/completions", {**chat, "model": "nope"}),  # 404
                ("/v1/chat/completions", {**chat, "messages": []}),  # 400
            ):
                async with session.post(path, json=body) as response:
                    await response.read()
                    sent.append((response.status, response.headers["traceresponse"]))
    assert [status for status, _ in sent] == [200, 200, 200, 200, 200, 404, 400]
    named = {(s.trace_id, s.span_id) for s in _server_spans(receiver)}
    for _, header in sent:
        match = TRACERESPONSE.fullmatch(header)
        assert match is not None, header
        assert (match[1], match[2]) in named
        assert int(match[3], 16) & 1  # sampled (Level 2 adds the random-trace-id bit, 2)
    assert len({header for _, header in sent}) == len(sent)


async def test_no_traceresponse_with_tracing_off(qwen3_tokenizer_dir: Path) -> None:
    engine = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim")
    async with (
        embedded(engine, host="127.0.0.1", port=0, route="text") as running,
        aiohttp.ClientSession(running.url) as session,
        session.post("/v1/chat/completions", json={"model": "sim", "messages": MESSAGES, "max_tokens": 2}) as response,
    ):
        assert response.status == 200 and "traceresponse" not in response.headers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_responses_and_messages_on_the_derender_route_carry_their_usage(
    qwen3_tokenizer_dir: Path, stream: bool
) -> None:
    """The engine assembles these APIs' answers itself on the derender route; the gateway's span
    still has the tokens and finish reasons the client was told."""
    async with otlp_receiver() as receiver:
        engine = EngineConfig(
            backend="sim", model=str(qwen3_tokenizer_dir), served_model_name="sim",
            tracing=TracingConfig(endpoint=receiver.url),
        )
        async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running:
            async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client:
                if stream:  # cut by max_output_tokens: it ends with response.incomplete
                    events = await client.responses.create(model="sim", input="Say hi.", max_output_tokens=10, stream=True)
                    (response,) = [e.response async for e in events if e.type == "response.incomplete"]
                else:
                    response = await client.responses.create(model="sim", input="Say hi.", max_output_tokens=10)
            async with anthropic.AsyncAnthropic(base_url=running.url, api_key="none", max_retries=0) as claude:
                asked: dict[str, Any] = {"model": "sim", "max_tokens": 10, "messages": MESSAGES}
                if stream:
                    async with claude.messages.stream(**asked) as streamed:
                        message = await streamed.get_final_message()
                else:
                    message = await claude.messages.create(**asked)
    responses, messages = _server_spans(receiver)
    assert response.usage is not None
    for span, told, endpoint in (
        (responses, (response.usage.input_tokens, response.usage.output_tokens), "/v1/responses"),
        (messages, (message.usage.input_tokens, message.usage.output_tokens), "/v1/messages"),
    ):
        a = span.attributes
        assert (a["url.path"], a["onehop.route"], span.name) == (endpoint, "derender", "chat sim")
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == told
        assert (a["llm.token_count.prompt"], a["llm.token_count.completion"]) == told
        assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert_one_llm_span_per_trace(receiver, traces=2)


async def test_a_stream_broken_after_its_first_byte_is_an_error_on_its_span(qwen3_tokenizer_dir: Path) -> None:
    """The engine dies mid-answer: the client got its 200 headers, then an error event; the
    request's span is a failure with the error's status, not a 200."""
    async with (
        otlp_receiver() as receiver,
        engine_server(qwen3_tokenizer_dir) as (engine_url, _),
        broken_engine(engine_url) as (proxy_url, proxy),
    ):
        runner = await _gateway_alone(qwen3_tokenizer_dir, TracingConfig(endpoint=receiver.url), proxy_url)
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            proxy.fault = Fault("reset", at=2)
            async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
                stream = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=12, stream=True)
                with pytest.raises(openai.APIError):
                    async for _ in stream:
                        pass
        finally:
            await runner.cleanup()
    (server,) = _server_spans(receiver)
    a = server.attributes
    assert (a["http.response.status_code"], a["error.type"], a["onehop.stream_error"]) == (502, "EngineDied", True)
    assert server.status_code == 2
