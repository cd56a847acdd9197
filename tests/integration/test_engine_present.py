"""The engine answering in another API's shape (`present`): Responses and Anthropic events
from its own chat derender, on loopback with the sim backend and the Qwen3 vocabulary.

The gateway sends `present` on the `derender` route for `/v1/responses` and `/v1/messages`
and relays the engine's bytes; here the engine is asked directly, as the gateway asks it,
and what it writes is read by the clients' own SDK types.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent, ToolUseBlock
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseStreamEvent
from pydantic import TypeAdapter

from engine.errors import EngineHTTPError
from engine.outputs import WriterContext, make_writer
from tests.integration.test_engine_server import GENERATE, chat_request, generate_body, render
from tests.support.engine import engine_server, post_json
from wire.protocol import GenerateRequest

SCRIPT = {"mode": "script", "script": [
    '<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
]}
STARTED = {
    "id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "model": "sim", "output": [],
    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
    "usage": None, "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
    "temperature": None, "top_p": None,
}
RESPONSE_EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ANTHROPIC_EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def presented(prompt: list[int], present: dict[str, Any], *, stream: bool, **chat: Any) -> dict[str, Any]:
    body = generate_body(prompt, "derender", stream=stream)
    body["chat_request"] = chat_request(stream, **chat)
    body["present"] = present
    return body


async def named_events(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[list[Any], bytes]:
    """Each `event:` / `data:` pair (its name checked against its type), and the raw stream."""
    async with session.post(url, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    events = []
    for frame in raw.split(b"\n\n"):
        if not frame.startswith(b"event: "):
            continue
        name, data = frame.split(b"\n", 1)
        assert data.startswith(b"data: ")
        event = msgspec.json.decode(data[6:])
        assert event["type"] == name[7:].decode()
        events.append(event)
    return events, raw


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_responses_events_numbered_with_the_items_the_whole_answer_has(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = render(qwen3_tokenizer)
    present = {"api": "responses", "response": STARTED}
    async with engine_server(qwen3_tokenizer_dir, backend_options=SCRIPT) as (base, _):
        events, raw = await named_events(session, base + GENERATE, presented(prompt, present, stream=True))
        status, whole, _ = await post_json(session, base + GENERATE, presented(prompt, present, stream=False))
    parsed = [RESPONSE_EVENTS.validate_python(event) for event in events]  # the SDK's own event types
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    assert parsed[0].type == "response.created" and parsed[-1].type == "response.completed"
    assert raw.endswith(b"data: [DONE]\n\n")  # the wire's end, which the gateway keeps from the client
    final = parsed[-1].response
    assert status == 200
    answer = Response.model_validate(whole)
    for response in (final, answer):
        kinds = [item.type for item in response.output]
        assert kinds == ["reasoning", "message", "function_call"], kinds
        call = response.output[2]
        assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
        assert msgspec.json.decode(call.arguments) == {"city": "Paris", "days": 3}
        assert response.id == "resp_1" and response.model == "sim" and response.status == "completed"
        assert response.usage is not None and response.usage.input_tokens == len(prompt)
    assert final.usage is not None and answer.usage is not None
    assert final.usage.output_tokens == answer.usage.output_tokens > 0
    deltas = "".join(event.delta for event in parsed if event.type == "response.output_text.delta")
    assert deltas.strip() == "Let me check."


async def test_messages_events_fold_into_the_whole_message(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = render(qwen3_tokenizer)
    present = {"api": "messages", "id": "msg_1", "model": "sim", "context_management": {"applied_edits": []}}
    async with engine_server(qwen3_tokenizer_dir, backend_options=SCRIPT) as (base, _):
        events, _ = await named_events(session, base + GENERATE, presented(prompt, present, stream=True))
        status, whole, _ = await post_json(session, base + GENERATE, presented(prompt, present, stream=False))
    parsed = [ANTHROPIC_EVENTS.validate_python(event) for event in events]
    assert [event.type for event in parsed[:2]] == ["message_start", "content_block_start"]
    assert [event.type for event in parsed[-2:]] == ["message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    for event in events:  # folded as Anthropic's SDK folds them
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            key = {"thinking_delta": "thinking", "text_delta": "text", "input_json_delta": "partial_json"}.get(delta["type"])
            if key is not None:
                blocks[event["index"]][key] = blocks[event["index"]].get(key, "") + delta[key]
    message = AnthropicMessage.model_validate(whole)
    assert status == 200 and message.stop_reason == "tool_use" and parsed[-2].delta.stop_reason == "tool_use"
    assert [block.type for block in message.content] == [block["type"] for block in blocks]
    assert [block["type"] for block in blocks] == ["thinking", "text", "tool_use"]
    tool = message.content[2]
    assert isinstance(tool, ToolUseBlock)
    assert msgspec.json.decode(blocks[2]["partial_json"]) == tool.input == {"city": "Paris", "days": 3}
    assert message.usage.input_tokens == len(prompt) and message.usage.output_tokens > 0
    assert whole["context_management"] == {"applied_edits": []}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda body: body.pop("chat_request"), "present needs output_mode='derender' and a chat_request"),
        (lambda body: body["sampling_params"].update(n=2), "present answers one choice"),
        (lambda body: body["present"].update(api="pictures"), "Invalid value 'pictures'"),
    ],
)
async def test_a_present_the_engine_cannot_keep_is_a_400(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession, change: Any, message: str
) -> None:
    body = presented(render(qwen3_tokenizer), {"api": "responses", "response": STARTED}, stream=False)
    change(body)
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        status, answer, _ = await post_json(session, base + GENERATE, body)
    assert status == 400 and message in answer["error"]["message"], answer



@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_failure_after_the_first_event_ends_the_stream_in_the_apis_own_error_event(
    qwen3_tokenizer: Any, qwen3_vocab: Any, api: str
) -> None:
    present = {"api": "responses", "response": STARTED} if api == "responses" else {"api": "messages", "id": "m", "model": "sim"}
    request = msgspec.convert(presented(render(qwen3_tokenizer), present, stream=True), GenerateRequest)
    writer = make_writer(request, WriterContext("sim", qwen3_vocab, "qwen3", "hermes"))
    opening = b"".join(writer.head())
    frame = writer.error_frame(EngineHTTPError("backend failed: out of blocks"))
    name, data = frame.removesuffix(b"\n\n").split(b"\n")
    error = msgspec.json.decode(data.removeprefix(b"data: "))
    assert name == b"event: error" and error["type"] == "error"
    if api == "responses":  # numbered after the opening events, with the gateway's code for it
        assert opening.count(b"event: ") == 2 and error["sequence_number"] == 2
        assert (error["code"], error["message"]) == ("engine_failed", "backend failed: out of blocks")
    else:  # Anthropic's error object
        assert error["error"] == {"type": "api_error", "message": "backend failed: out of blocks"}
