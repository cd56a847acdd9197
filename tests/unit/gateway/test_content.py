"""`gen_ai.output.messages` from an answer as its client got it (`gateway.observe.content`), for
each API, whole and streamed; finish reasons are the outcome's."""

from __future__ import annotations

import json
from typing import Any

from gateway.observe.content import output_messages


def sse(*events: dict[str, Any], named: bool = False) -> bytes:
    frames = [
        (f"event: {event['type']}\n" if named else "") + "data: " + json.dumps(event) + "\n\n" for event in events
    ]
    return "".join(frames).encode() + (b"" if named else b"data: [DONE]\n\n")


def messages_of(endpoint: str, sent: bytes, reasons: list[str | None]) -> list[dict[str, Any]]:
    decoded: list[dict[str, Any]] = json.loads(output_messages(endpoint, sent, reasons))
    return decoded


def test_a_streamed_chat_answer_per_choice_with_its_reasoning_and_tool_call() -> None:
    def chunk(index: int, **delta: Any) -> dict[str, Any]:
        return {"id": "c", "choices": [{"index": index, "delta": delta, "finish_reason": None}]}

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    sent = sse(
        chunk(0, role="assistant", reasoning="Think"),
        chunk(1, content="Hel"),
        chunk(0, reasoning="ing."),
        chunk(1, content="lo"),
        chunk(0, tool_calls=[call]),
        chunk(0, tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
        chunk(0, tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]),
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}},
    )
    first, second = messages_of("chat", sent, ["tool_calls", "length"])
    assert first == {
        "role": "assistant",
        "parts": [
            {"type": "reasoning", "content": "Thinking."},
            {"type": "tool_call", "id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}},
        ],
        "finish_reason": "tool_call",
    }
    assert second == {"role": "assistant", "parts": [{"type": "text", "content": "Hello"}], "finish_reason": "length"}


def test_a_whole_chat_answer_and_a_completion() -> None:
    whole = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop"}]}
    (chat,) = messages_of("chat", json.dumps(whole).encode(), ["stop"])
    assert chat["parts"] == [{"type": "text", "content": "Hi."}] and chat["finish_reason"] == "stop"
    streamed = sse({"choices": [{"index": 0, "text": "Once "}]}, {"choices": [{"index": 0, "text": "upon"}]})
    (text,) = messages_of("completions", streamed, ["length"])
    assert text["parts"] == [{"type": "text", "content": "Once upon"}]


def test_a_responses_stream_reads_its_last_response() -> None:
    final = {
        "id": "resp_1",
        "status": "incomplete",
        "output": [
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Hmm."}]},
            {"type": "message", "content": [{"type": "output_text", "text": "Hi"}, {"type": "output_text", "text": "!"}]},
            {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"},
        ],
    }
    sent = sse(
        {"type": "response.created", "response": {"id": "resp_1", "output": []}},
        {"type": "response.output_text.delta", "delta": "Hi"},
        {"type": "response.incomplete", "response": final},
        named=True,
    )
    (message,) = messages_of("responses", sent, ["length"])
    assert message["parts"] == [
        {"type": "reasoning", "content": "Hmm."},
        {"type": "text", "content": "Hi!"},
        {"type": "tool_call", "id": "call_2", "name": "f", "arguments": {}},
    ]
    assert message["finish_reason"] == "length"


def test_a_messages_stream_and_a_whole_message() -> None:
    sent = sse(
        {"type": "message_start", "message": {"id": "msg_1", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Mm."}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Yes"}},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "t1", "name": "g"}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"a":'}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": " 1}"}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        named=True,
    )
    expected = [
        {"type": "reasoning", "content": "Mm."},
        {"type": "text", "content": "Yes"},
        {"type": "tool_call", "id": "t1", "name": "g", "arguments": {"a": 1}},
    ]
    (streamed,) = messages_of("messages", sent, ["tool_calls"])
    assert streamed == {"role": "assistant", "parts": expected, "finish_reason": "tool_call"}
    whole = {
        "type": "message",
        "content": [
            {"type": "thinking", "thinking": "Mm."},
            {"type": "text", "text": "Yes"},
            {"type": "tool_use", "id": "t1", "name": "g", "input": {"a": 1}},
        ],
    }
    (answered,) = messages_of("messages", json.dumps(whole).encode(), ["tool_calls"])
    assert answered["parts"] == expected
