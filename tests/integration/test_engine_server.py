"""The engine server on loopback with the sim backend: modes, routes, aborts, bad input, metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam
import pytest
from prometheus_client.parser import text_string_to_metric_families

from derender.chat import ChatDerender, ChatOptions
from wire.openai_schema import ChatCompletionRequest, ChatLogprobToken
from engine.outputs import text_params
from wire.protocol import GenerateLogProbsContent, SamplingParams
from engine.qwen3.vocab import IM_END_ID
from tests.support.engine import engine_server, post_json, sse_payloads, stream_events
from tests.support.streams import fold_chunks

GENERATE = "/inference/v1/generate"
TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"],
            },
        },
    }
]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def render(tokenizer: Any, *, tools: bool = True, thinking: bool = True) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS if tools else None, add_generation_prompt=True, tokenize=True, enable_thinking=thinking
    )
    return list(rendered["input_ids"])


def generate_body(prompt: list[int], mode: str | None, *, stream: bool, **sampling: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": prompt, "sampling_params": {"max_tokens": 200, "seed": 7, **sampling}, "stream": stream}
    if mode is not None:
        body["output_mode"] = mode
    return body


def chat_request(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": "sim", "messages": MESSAGES, "tools": TOOLS, "stream": stream, **extra}


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession() as client:
        yield client


# -- modes -----------------------------------------------------------------------------


async def test_tokens_mode_is_the_default(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer)
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        status, body, headers = await post_json(session, base + GENERATE, generate_body(prompt, None, stream=False))
    assert status == 200, body
    assert body["output_mode"] == "tokens"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == IM_END_ID
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert int(headers["onehop-engine-cpu-us"]) >= 0


async def test_streams_one_choice_per_event_with_usage_and_done(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any
) -> None:
    prompt = render(qwen3_tokenizer)
    body = generate_body(prompt, "text", stream=True, n=2, max_tokens=30)
    body["stream_options"] = {"include_usage": True}
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        events, raw = await stream_events(session, base + GENERATE, body)
    assert raw[-2] == b"data: [DONE]"
    assert any(part.startswith(b": onehop-engine-cpu-us=") for part in raw)
    assert all(len(e["choices"]) == 1 for e in events[:-1])
    assert {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(
        len(e["choices"][0].get("token_ids", [])) for e in events[:-1]
    )
    texts = ["".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts[0] != texts[1]


async def test_stop_strings_are_enforced_at_the_engine(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any
) -> None:
    prompt = render(qwen3_tokenizer, tools=False)
    script = ["<think>\nplan\n</think>\n\nThe answer is 42. END and then more text"]
    async with engine_server(qwen3_tokenizer_dir, backend_options={"mode": "script", "script": script}) as (base, state):
        status, text_body, _ = await post_json(session, base + GENERATE, generate_body(prompt, "text", stream=False, stop=["END"]))
        _, tokens_body, _ = await post_json(session, base + GENERATE, generate_body(prompt, "tokens", stream=False, stop=["END"]))
        assert not state.backend.running()
    assert status == 200
    choice = text_body["choices"][0]
    assert choice["text"] == "<think>\nplan\n</think>\n\nThe answer is 42. "
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "END")
    assert qwen3_tokenizer.decode(choice["token_ids"]).endswith("END")  # ids keep the stop's tokens
    assert tokens_body["choices"][0]["token_ids"] == choice["token_ids"]
    assert tokens_body["choices"][0]["stop_reason"] == "END"


async def test_held_back_text_arrives_in_a_final_chunk(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer, tools=False, thinking=False)
    async with engine_server(qwen3_tokenizer_dir, backend_options={"mode": "script", "script": ["ends with EN"]}) as (base, _):
        events, _ = await stream_events(session, base + GENERATE, generate_body(prompt, "text", stream=True, stop=["END"]))
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["text"] == "EN"
    assert "".join(e["choices"][0]["text"] for e in events) == "ends with EN"


# -- the three routes give one answer ---------------------------------------------------------


async def _via_tokens(session: Any, base: str, prompt: list[int], chat: dict[str, Any], sampling: dict[str, Any], vocab: Any) -> Any:
    events, _ = await stream_events(session, base + GENERATE, generate_body(prompt, "tokens", stream=True, **sampling))
    derender = _gateway_derender(chat, sampling, vocab, prompt)
    chunks = derender.start()
    for event in events:
        for choice in event["choices"]:
            entries = choice.get("logprobs", {}) or {}
            logprobs = msgspec.convert(entries.get("content"), list[GenerateLogProbsContent]) if entries.get("content") else None
            chunk = derender.step(
                choice["index"],
                choice.get("token_ids", []),
                logprobs,
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"),
            )
            if chunk is not None:
                chunks.append(chunk)
    return fold_chunks(chunks)


async def _via_text(session: Any, base: str, prompt: list[int], chat: dict[str, Any], sampling: dict[str, Any], vocab: Any) -> Any:
    events, _ = await stream_events(session, base + GENERATE, generate_body(prompt, "text", stream=True, **sampling))
    derender = _gateway_derender(chat, sampling, vocab, prompt)
    chunks = derender.start()
    for event in events:
        for choice in event["choices"]:
            entries = (choice.get("logprobs") or {}).get("content")
            chunk = derender.step_text(
                choice["index"],
                choice["text"],
                choice.get("token_ids", []),
                msgspec.convert(entries, list[ChatLogprobToken]) if entries else None,
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"),
            )
            if chunk is not None:
                chunks.append(chunk)
    return fold_chunks(chunks)


async def _via_derender(session: Any, base: str, prompt: list[int], chat: dict[str, Any], sampling: dict[str, Any]) -> Any:
    body = generate_body(prompt, "derender", stream=True, **sampling)
    body["chat_request"] = chat
    events, _ = await stream_events(session, base + GENERATE, body)
    return fold_chunks([msgspec.convert(e, type=_CHUNK) for e in events])


def _gateway_derender(chat: dict[str, Any], sampling: dict[str, Any], vocab: Any, prompt: list[int]) -> ChatDerender:
    request = msgspec.convert(chat, ChatCompletionRequest)
    params = msgspec.convert({"max_tokens": 200, "seed": 7, **sampling}, SamplingParams)
    options = ChatOptions.from_request(request, reasoning_parser="qwen3", tool_parser="hermes", text=text_params(params))
    return ChatDerender(vocab, options, model="sim", prompt_token_ids=prompt)


from wire.openai_schema import ChatCompletionChunk as _CHUNK  # noqa: E402


def _without_ids(folded: Any) -> dict[str, Any]:
    view = folded.as_comparable()
    view["tool_calls"] = [{k: v for k, v in call.items() if k != "id"} for call in view["tool_calls"]]
    return view


@pytest.mark.parametrize(
    ("label", "tools", "thinking", "sampling", "script"),
    [
        ("reasoning+tool call", True, True, {"logprobs": 2}, None),
        ("thinking off", True, False, {}, None),
        ("stop string", False, True, {"stop": ["END"], "logprobs": 1}, ["<think>\nwhy 世界\n</think>\n\nAnswer: 42 🫠 END more"]),
        ("stop inside a tool call", True, True, {"stop": ["Par"]}, ['<think>x</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']),
    ],
)
async def test_tokens_text_and_derender_routes_agree(
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    qwen3_vocab: Any,
    session: Any,
    label: str,
    tools: bool,
    thinking: bool,
    sampling: dict[str, Any],
    script: list[str] | None,
) -> None:
    prompt = render(qwen3_tokenizer, tools=tools, thinking=thinking)
    extra: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": thinking}}
    if "logprobs" in sampling:
        extra.update(logprobs=True, top_logprobs=sampling["logprobs"])
    if "stop" in sampling:
        extra["stop"] = sampling["stop"]
    chat = chat_request(True, **extra)
    if not tools:
        chat.pop("tools")
    options = {"mode": "script", "script": script} if script else {}
    async with engine_server(qwen3_tokenizer_dir, backend_options=options) as (base, _):
        tokens = await _via_tokens(session, base, prompt, chat, sampling, qwen3_vocab)
        text = await _via_text(session, base, prompt, chat, sampling, qwen3_vocab)
        derender = await _via_derender(session, base, prompt, chat, sampling)
    assert _without_ids(tokens) == _without_ids(text) == _without_ids(derender), label
    assert tokens.usage == text.usage == derender.usage or derender.usage is None
    if label == "reasoning+tool call":
        assert derender.reasoning and [c["name"] for c in derender.tool_calls] == ["get_weather"]
        assert set(json.loads(derender.tool_calls[0]["arguments"])) >= {"city", "days"}
        assert derender.finish_reason == "tool_calls"
        assert len(derender.logprobs) > 0
    if label == "stop string":
        assert derender.content == "\n\nAnswer: 42 🫠 " and derender.stop_reason == "END"
    if label == "stop inside a tool call":
        assert derender.tool_calls[0]["arguments"] == '{"city": ""}'  # closed to valid JSON (issue #27)


async def test_derender_non_streaming_matches_streaming(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer)
    body = generate_body(prompt, "derender", stream=False)
    body["chat_request"] = chat_request(False)
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        status, completion, _ = await post_json(session, base + GENERATE, body)
        streamed = await _via_derender(session, base, prompt, chat_request(True), {})
    assert status == 200 and completion["object"] == "chat.completion"
    message = completion["choices"][0]["message"]
    assert message["reasoning"] == streamed.reasoning
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        (c["name"], c["arguments"]) for c in streamed.tool_calls
    ]
    assert completion["choices"][0]["finish_reason"] == "tool_calls"


async def test_completion_derender(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = qwen3_tokenizer.encode("Once upon a time")
    body = generate_body(prompt, "derender", stream=False, n=2, max_tokens=12)
    body["completion_request"] = {"model": "sim", "prompt": "Once upon a time", "n": 2, "max_tokens": 12}
    body["prompt_index"] = 1
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        status, completion, _ = await post_json(session, base + GENERATE, body)
    assert status == 200, completion
    assert completion["object"] == "text_completion"
    assert [c["index"] for c in completion["choices"]] == [2, 3]
    assert all(c["text"] for c in completion["choices"])


# -- aborts and disconnects end the backend request ---------------------------------------------


LONG = {"max_tokens": 5000, "ignore_eos": True}


async def _wait_idle(state: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while state.backend.running() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


async def test_abort_endpoint_ends_the_backend_request(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer)
    body = generate_body(prompt, "text", stream=True, **LONG)
    body["request_id"] = "req-abort-1"
    async with engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 5}) as (base, state):
        async with session.post(base + GENERATE, json=body) as resp:
            payloads = sse_payloads(resp)
            for _ in range(3):
                await payloads.__anext__()
            assert state.backend.running() == frozenset({"req-abort-1"})
            said = []
            for path in ("/inference/v1/abort_requests", "/abort_requests"):  # running, then ended
                async with session.post(base + path, json={"request_ids": ["req-abort-1", "unknown"]}) as aborted:
                    assert aborted.status == 200
                    said.append(await aborted.json())
            rest = [p async for p in payloads]
        await _wait_idle(state)
        assert not state.backend.running()
        assert not state.running
    finals = [json.loads(p)["choices"][0] for p in rest if p != b"[DONE]" and json.loads(p)["choices"]]
    assert finals[-1]["finish_reason"] == "abort"
    assert rest[-1] == b"[DONE]"
    # the abort's answer says what the request used once it stopped (the gateway settles a cut by it)
    assert said[0] == said[1] and list(said[0]["usage"]) == ["req-abort-1"]
    usage = said[0]["usage"]["req-abort-1"]
    assert usage["prompt_tokens"] == len(prompt) and usage["finish_reasons"] == ["abort"]
    assert usage["completion_tokens"] >= 3


async def test_client_disconnect_ends_the_backend_request(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> None:
    prompt = render(qwen3_tokenizer)
    async with engine_server(qwen3_tokenizer_dir, backend_options={"itl_ms": 5}) as (base, state):
        for mode, stream in (("derender", True), ("tokens", True), ("text", False)):
            body = generate_body(prompt, mode, stream=stream, **LONG)
            if mode == "derender":
                body["chat_request"] = chat_request(stream)
            async with aiohttp.ClientSession() as client:
                request = asyncio.ensure_future(client.post(base + GENERATE, json=body))
                while not state.backend.running():
                    await asyncio.sleep(0.01)
                if stream:
                    resp = await request
                    await resp.content.readany()
                    resp.close()
                else:
                    request.cancel()
            await _wait_idle(state)
            assert not state.backend.running(), mode
        metrics = (await _get(base + "/metrics")).decode()
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    disconnects = [s.value for s in families["onehop_engine_aborts"].samples if s.labels.get("reason") == "client_disconnect"]
    assert disconnects and disconnects[0] >= 3


async def _get(url: str) -> bytes:
    async with aiohttp.ClientSession() as client, client.get(url) as resp:
        return await resp.read()


# -- bad input gets a clear 4xx and the server keeps serving ---------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "invalid generate request"),
        (b'{"token_ids": [], "sampling_params": {}}', "token_ids"),
        (b'{"token_ids": [1, -2], "sampling_params": {}}', "token_ids"),
        (b'{"token_ids": [1, 999999], "sampling_params": {}}', "out of range"),
        (b'{"token_ids": [1], "output_mode": "text", "sampling_params": {"detokenize": false}}', "detokenize"),
        (b'{"token_ids": [1], "sampling_params": {"max_tokenz": 3}}', "max_tokenz"),
        (b'{"token_ids": [1], "sampling_params": {"temperature": -1}}', "temperature"),
        # vLLM 0.33's derender form, which an engine with parsers serves only with a parse_context
        (b'{"token_ids": [1], "output_mode": "derender", "sampling_params": {}}', "requires parse_context"),
        (b'{"token_ids": [1], "output_mode": "json", "sampling_params": {}}', "output_mode"),
    ],
)
async def test_bad_input_is_a_4xx_with_a_message(qwen3_tokenizer_dir: Path, session: Any, raw: bytes, message: str) -> None:
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        async with session.post(base + GENERATE, data=raw, headers={"Content-Type": "application/json"}) as resp:
            body = await resp.json()
            assert resp.status == 400, body
        assert message in body["error"]["message"]
        assert body["error"]["type"] == "BadRequestError"
        status, ok, _ = await post_json(session, base + GENERATE, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
        assert status == 200 and ok["choices"][0]["token_ids"]


async def test_unknown_model_and_route(qwen3_tokenizer_dir: Path, session: Any) -> None:
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        status, body, _ = await post_json(session, base + GENERATE, {"model": "gpt-9", "token_ids": [1], "sampling_params": {}})
        assert status == 404 and "gpt-9" in body["error"]["message"]
        async with session.get(base + "/nope") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["type"] == "NotFoundError"


async def test_tokens_only_refuses_text_work(qwen3_tokenizer_dir: Path, session: Any) -> None:
    async with engine_server(qwen3_tokenizer_dir, tokens_only=True) as (base, _):
        status, body, _ = await post_json(session, base + GENERATE, {"token_ids": [1], "output_mode": "text", "sampling_params": {}})
        assert status == 400 and "--tokens-only" in body["error"]["message"]
        status, body, _ = await post_json(session, base + GENERATE, {"token_ids": [1], "sampling_params": {"stop": ["x"]}})
        assert status == 400 and "stop strings" in body["error"]["message"]
        status, body, _ = await post_json(session, base + GENERATE, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
        assert status == 200 and len(body["choices"][0]["token_ids"]) <= 3
        async with session.get(base + "/inference/v1/capabilities") as resp:
            capabilities = await resp.json()
    assert capabilities["output_modes"] == ["tokens"] and capabilities["tokenizer"] is False


# -- small endpoints ------------------------------------------------------------------------------


async def test_health_models_capabilities_and_metrics(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer)
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        async with session.get(base + "/health") as resp:
            assert resp.status == 200
        async with session.get(base + "/v1/models") as resp:
            models = await resp.json()
        async with session.get(base + "/inference/v1/capabilities") as resp:
            capabilities = await resp.json()
        for mode in ("tokens", "text"):
            await post_json(session, base + GENERATE, generate_body(prompt, mode, stream=False))
        metrics = (await _get(base + "/metrics")).decode()
    assert models["data"][0]["id"] == "sim"
    assert capabilities["output_modes"] == ["tokens", "text", "derender"]
    assert (capabilities["reasoning_parser"], capabilities["tool_parser"]) == ("qwen3", "hermes")
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    requests = {(s.labels["mode"], s.labels["status"]): s.value for s in families["onehop_engine_requests"].samples if s.name.endswith("_total")}
    assert requests[("tokens", "200")] == 1 and requests[("text", "200")] == 1
    cpu = {s.labels["mode"]: s.value for s in families["onehop_engine_output_cpu_seconds"].samples if s.name.endswith("_total")}
    assert cpu["text"] > 0
    ttft = {s.labels["mode"]: s.value for s in families["onehop_engine_time_to_first_token_seconds"].samples if s.name.endswith("_count")}
    assert ttft == {"tokens": 1, "text": 1}
    queued = {s.labels["mode"]: s.value for s in families["onehop_engine_queue_seconds"].samples if s.name.endswith("_count")}
    assert queued == {"tokens": 1, "text": 1}  # the simulator reports its (zero) queue time
    gaps = {s.labels["mode"]: s.value for s in families["onehop_engine_inter_token_latency_seconds"].samples if s.name.endswith("_count")}
    assert gaps["tokens"] >= 1 and gaps["text"] >= 1


@pytest.mark.slow  # loads the tiny model with torch; CI's `-m slow` stage runs it
async def test_routes_agree_on_the_hf_backend(qwen3_tokenizer: Any, tiny_model_dir: Path, qwen3_vocab: Any, session: Any) -> None:
    """A real (tiny, random) model with seeded sampling: the three routes still give one answer."""
    prompt = render(qwen3_tokenizer)
    sampling = {"temperature": 0.8, "top_k": 50, "max_tokens": 40, "logprobs": 2, "stop": ["the"]}
    chat = chat_request(True, logprobs=True, top_logprobs=2, stop=["the"])
    async with engine_server(tiny_model_dir, backend="hf", backend_options={"threads": 1}) as (base, state):
        tokens = await _via_tokens(session, base, prompt, chat, sampling, qwen3_vocab)
        text = await _via_text(session, base, prompt, chat, sampling, qwen3_vocab)
        derender = await _via_derender(session, base, prompt, chat, sampling)
        assert not state.backend.running()
    assert _without_ids(tokens) == _without_ids(text) == _without_ids(derender)
    assert derender.reasoning or derender.content
    assert derender.logprobs and all(len(e["top_logprobs"]) == 2 for e in derender.logprobs)


async def test_continuous_usage_on_every_chunk(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    body = generate_body(render(qwen3_tokenizer), "tokens", stream=True, max_tokens=10)
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        events, _ = await stream_events(session, base + GENERATE, body)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 10 and len(counts) > 2
