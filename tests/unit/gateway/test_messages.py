"""Anthropic's Messages API as a chat completion: requests translate to chat, answers come back in
Anthropic's shape, read by the `anthropic` SDK itself (its request encoding, SSE reader and
stream accumulator), over an in-process transport."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import anthropic
from anthropic.types import ToolParam
import httpx2
import msgspec
import pytest
from msgspec import UNSET

from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatDelta,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedFunction,
    NamedToolChoice,
    PromptTokensDetails,
    ToolCall,
    Usage,
)
from gateway.edge import errors
from gateway.edge.errors import GatewayError, InvalidRequest
from gateway.apis.messages import (
    MessagesPresenter,
    MessagesRequest,
    count_tokens_to_chat,
    decode_count_tokens_request,
    decode_request,
    error_body,
    to_chat,
)
from gateway.apis.translate import Presented, Turn, turn

_encode = msgspec.json.Encoder().encode
META = Presented(response_id="msg_0123", model="client-name", created=0, prompt_tokens=12)
WEATHER: ToolParam = {"name": "get_weather", "description": "Weather now", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat_of(**body: Any) -> ChatCompletionRequest:
    return to_chat(decode_request(_encode({"model": "m", "max_tokens": 64, **body})).request)


def refused(**body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        chat_of(**body)
    return info.value


def wire(chat: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The chat messages as the render step sends them."""
    return msgspec.to_builtins(chat.messages)


# ------------------------------------------------------------ request → chat


def test_system_blocks_and_plain_fields() -> None:
    chat = chat_of(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}],
        stop_sequences=["###"], temperature=0.2, top_p=0.9, top_k=5, stream=True,
        metadata={"user_id": "u1"}, service_tier="auto",
    )
    assert wire(chat) == [{"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": "hi"}]
    assert (chat.max_completion_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (64, ["###"], 0.2, 0.9, 5)
    assert chat.stream is True and chat.n == 1 and chat.max_tokens is None
    assert chat.tool_choice is UNSET and chat.chat_template_kwargs is None and not chat.continue_final_message


def test_tool_round_trip_history() -> None:
    chat = chat_of(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking "},
                {"type": "text", "text": "both.", "citations": None},
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {"city": "Rome"}, "caller": {"type": "direct"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "error: "}, {"type": "text", "text": "timeout"}], "is_error": True},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
    )
    assert wire(chat) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
            ],
            "reasoning": "Two cities.",
        },
        {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "error: \ntimeout", "tool_call_id": "call_2"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    (tool,) = chat.tools or []
    assert (tool.function.name, tool.function.description, tool.function.parameters) == ("get_weather", "Weather now", WEATHER["input_schema"])


def test_consecutive_turns_merge_and_a_final_assistant_turn_is_continued() -> None:
    chat = chat_of(messages=[
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "The answer is ("},
    ])
    assert wire(chat) == [{"role": "user", "content": "one\ntwo"}, {"role": "assistant", "content": "The answer is ("}]
    assert chat.continue_final_message and not chat.add_generation_prompt


@pytest.mark.parametrize(
    ("thinking", "kwargs", "include"),
    [
        ({"type": "enabled", "budget_tokens": 2048}, {"enable_thinking": True}, True),
        ({"type": "adaptive"}, {"enable_thinking": True}, True),
        ({"type": "adaptive", "display": "omitted"}, {"enable_thinking": True}, False),
        ({"type": "disabled"}, {"enable_thinking": False}, True),
    ],
)
def test_thinking(thinking: dict[str, Any], kwargs: dict[str, Any], include: bool) -> None:
    chat = chat_of(messages=[{"role": "user", "content": "hi"}], thinking=thinking)
    assert chat.chat_template_kwargs == kwargs and chat.include_reasoning is include
    assert chat.thinking_token_budget is None  # the gateway refuses vLLM's budget


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        ({"type": "tool", "name": "get_weather"}, NamedToolChoice(function=NamedFunction(name="get_weather")), True),
    ],
)
def test_tool_choice(choice: dict[str, Any], chat_choice: Any, parallel: bool) -> None:
    chat = chat_of(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice=choice)
    assert chat.tool_choice == chat_choice and chat.parallel_tool_calls is parallel


def test_output_config_is_structured_output_and_effort() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = chat_of(messages=[{"role": "user", "content": "hi"}], output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    assert chat.reasoning_effort == "low"
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}  # what gpt-oss's template reads
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


COMPUTER = {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]}, "messages[0].content[1]"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": [IMAGE]}]}]}, "messages[0].content[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, COMPUTER]}, "tools[1].type"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"messages": [{"role": "user", "content": "hi"}], "container": "cntr_1"}, "container"),
        ({"messages": [{"role": "user", "content": "hi"}], "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "messages[0].content[0].type"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    error = refused(**body)
    assert error.param == param and error.status == 400
    assert param.split("[")[0].split(".")[0] in error.message


def test_media_and_unknown_blocks_are_named() -> None:
    assert refused(messages=[{"role": "user", "content": [IMAGE]}]).message == "messages[0].content[0]: image blocks are not supported: media is not served"
    assert refused(messages=[{"role": "user", "content": [{"type": "search_result"}]}]).message == (
        "messages[0].content[0].type: 'search_result' blocks are not supported"
    )


def test_unknown_field_and_missing_max_tokens_in_anthropics_words() -> None:
    with pytest.raises(InvalidRequest, match=r"^frobnicate: Extra inputs are not permitted$"):
        decode_request(_encode({"model": "m", "max_tokens": 1, "messages": [], "frobnicate": 1}), ignore_unknown=False)
    ignored = decode_request(_encode({"model": "m", "max_tokens": 1, "messages": [], "context_management_v2": {}}))
    assert ignored.ignored == ("context_management_v2",)
    with pytest.raises(InvalidRequest, match=r"^max_tokens: Field required$") as info:
        decode_request(_encode({"model": "m", "messages": []}))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        decode_request(b"{")


def test_count_tokens_renders_the_same_prompt_without_sampling() -> None:
    body = {"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "thinking": {"type": "enabled", "budget_tokens": 1024}}
    counted = count_tokens_to_chat(decode_count_tokens_request(_encode(body)).request)
    full = to_chat(decode_request(_encode({**body, "max_tokens": 9})).request)
    assert wire(counted) == wire(full) and counted.tools == full.tools
    assert counted.chat_template_kwargs == {"enable_thinking": True} and counted.max_completion_tokens is None
    with pytest.raises(InvalidRequest) as info:
        decode_count_tokens_request(_encode({**body, "max_tokens": 9}), ignore_unknown=False)
    assert info.value.param == "max_tokens"


# ------------------------------------------------------------ answers, read by the SDK


def completion(message: ChatCompletionMessage, finish: str, stop_reason: int | str | None = None, cached: int | None = None) -> ChatCompletion:
    details = PromptTokensDetails(cached_tokens=cached) if cached is not None else None
    return ChatCompletion(
        model="served-name",
        choices=[ChatCompletionChoice(index=0, message=message, finish_reason=finish, stop_reason=stop_reason)],
        usage=Usage(prompt_tokens=12, completion_tokens=30, total_tokens=42, prompt_tokens_details=details),
    )


def turn_of(**body: Any) -> Turn[MessagesRequest]:
    request = decode_request(_encode({"model": "client-name", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **body})).request
    return turn(request, to_chat(request))


async def test_whole_answer_with_reasoning_text_and_tool_calls() -> None:
    message = ChatCompletionMessage(
        content="Checking.",
        reasoning="Need the weather.",
        tool_calls=[
            ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')),
            ToolCall(id="call_2", function=FunctionCall(name="get_weather", arguments="not json")),
        ],
    )
    answer = await MessagesPresenter().whole(turn_of(), META, completion(message, "tool_calls", cached=4))
    parsed = anthropic.types.Message.model_validate_json(_encode(answer))  # the SDK's own validation
    assert parsed.id == "msg_0123" and parsed.model == "client-name" and parsed.role == "assistant"
    assert [block.to_dict() for block in parsed.content] == [
        {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {}},
    ]
    assert (parsed.stop_reason, parsed.stop_sequence) == ("tool_use", None)
    usage = parsed.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens, usage.output_tokens) == (8, 4, 0, 30)


@pytest.mark.parametrize(
    ("message", "finish", "stop_reason", "expected"),
    [
        (ChatCompletionMessage(content="a", reasoning=UNSET, reasoning_content="r"), "stop", "###", ("stop_sequence", "###")),
        (ChatCompletionMessage(content="a"), "stop", "zzz", ("end_turn", None)),
        (ChatCompletionMessage(content="a"), "stop", 151645, ("end_turn", None)),
        (ChatCompletionMessage(content="a"), "length", None, ("max_tokens", None)),
        (ChatCompletionMessage(content=None, tool_calls=[ToolCall(id="c", function=FunctionCall(name="f", arguments="{}"))]), "stop", None, ("tool_use", None)),
    ],
)
async def test_stop_reasons(message: ChatCompletionMessage, finish: str, stop_reason: Any, expected: tuple[str, str | None]) -> None:
    answer = await MessagesPresenter().whole(turn_of(stop_sequences=["###"]), META, completion(message, finish, stop_reason))
    assert (answer.stop_reason, answer.stop_sequence) == expected


def chunk(finish: str | None = None, stop_reason: Any = UNSET, **delta: Any) -> ChatCompletionChunk:
    choice = ChatCompletionChunkChoice(index=0, delta=ChatDelta(**delta), finish_reason=finish, stop_reason=stop_reason)
    return ChatCompletionChunk(model="served-name", choices=[choice])


def call(index: int, arguments: str, id: Any = UNSET, name: Any = UNSET) -> list[DeltaToolCall]:
    function = DeltaFunctionCall(name=name, arguments=arguments)
    return [DeltaToolCall(index=index, id=id, type="function" if id is not UNSET else UNSET, function=function)]


USAGE = ChatCompletionChunk(model="served-name", choices=[], usage=Usage(prompt_tokens=12, completion_tokens=30, total_tokens=42, prompt_tokens_details=PromptTokensDetails(cached_tokens=4)))
CHUNKS = [
    chunk(role="assistant", content=""),
    chunk(reasoning="Let me "),
    chunk(reasoning_content="think.", content="Sure"),  # several kinds in one delta
    chunk(content=", calling.", reasoning=None),
    chunk(tool_calls=call(0, '{"city": ', id="call_1", name="get_weather")),
    chunk(tool_calls=call(0, '"Paris"}'), content=None),
    chunk(tool_calls=call(1, "{}", id="call_2", name="now")),
    chunk(finish="tool_calls"),
    USAGE,
]
EVENTS = [
    "message_start",
    "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta", "content_block_stop",
    "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
    "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
    "content_block_start", "content_block_delta", "content_block_stop",
    "message_delta", "message_stop",
]


async def aiter_of(items: list[ChatCompletionChunk]) -> AsyncGenerator[ChatCompletionChunk, None]:
    for item in items:
        yield item


async def frames_of(chunks: list[ChatCompletionChunk], request: Turn[MessagesRequest] | None = None) -> bytes:
    return b"".join([frame async for frame in MessagesPresenter().stream(request or turn_of(stream=True), META, aiter_of(chunks))])


def events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in body.split(b"\n\n")[:-1]:
        event, data = frame.split(b"\n")
        assert event.startswith(b"event: ") and data.startswith(b"data: ")
        out.append((event[7:].decode(), msgspec.json.decode(data[6:])))
    return out


async def test_stream_event_sequence() -> None:
    body = await frames_of(CHUNKS)
    assert body.endswith(b"\n\n")
    seen = events(body)
    assert [name for name, _ in seen] == EVENTS
    assert all(name == data["type"] for name, data in seen)
    assert [data["index"] for name, data in seen if name == "content_block_start"] == [0, 1, 2, 3]
    assert seen[4][1]["delta"] == {"type": "signature_delta", "signature": ""}  # before the thinking block's stop
    assert seen[10][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert seen[0][1]["message"]["usage"]["input_tokens"] == 12 and seen[0][1]["message"]["stop_reason"] is None
    assert seen[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def sdk(handler: Callable[[dict[str, Any]], httpx2.Response]) -> anthropic.AsyncAnthropic:
    """The SDK talking to `handler`, which gets the request body as it was sent."""

    async def transport(request: httpx2.Request) -> httpx2.Response:
        return handler(msgspec.json.decode(request.content))

    http = httpx2.AsyncClient(transport=httpx2.MockTransport(transport))
    return anthropic.AsyncAnthropic(api_key="k", base_url="http://onehop.test", http_client=http, max_retries=0)


def sse(body: bytes) -> httpx2.Response:
    return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})


async def test_the_sdk_accumulates_the_stream() -> None:
    body = await frames_of(CHUNKS)
    sent: list[dict[str, Any]] = []

    def handler(request: dict[str, Any]) -> httpx2.Response:
        sent.append(request)
        return sse(body)

    client = sdk(handler)
    async with client.messages.stream(
        model="client-name", max_tokens=64, messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER], tool_choice={"type": "auto"}, thinking={"type": "adaptive"}, metadata={"user_id": "u"},
    ) as stream:
        final = await stream.get_final_message()
    await client.close()
    assert to_chat(decode_request(_encode(sent[0])).request).stream  # what the SDK sends decodes
    assert [block.to_dict() for block in final.content] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "Sure, calling."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "now", "input": {}},
    ]
    assert (final.id, final.model, final.stop_reason) == ("msg_0123", "client-name", "tool_use")
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (8, 4, 30)


async def test_stream_stop_sequence_and_no_usage_chunk() -> None:
    body = await frames_of([chunk(content="a"), chunk(content="b", finish="stop", stop_reason="###")], turn_of(stream=True, stop_sequences=["###"]))
    client = sdk(lambda request: sse(body))
    async with client.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}], stop_sequences=["###"]) as stream:
        final = await stream.get_final_message()
    await client.close()
    assert [block.to_dict() for block in final.content] == [{"type": "text", "text": "ab"}]
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens, final.usage.input_tokens) == ("stop_sequence", "###", 0, 12)


async def test_empty_stream_still_starts_and_stops() -> None:
    assert [name for name, _ in events(await frames_of([USAGE]))] == ["message_start", "message_delta", "message_stop"]


async def test_nothing_is_written_before_the_first_chunk() -> None:
    """An engine that fails before answering gets an HTTP status, not a started stream."""

    async def failing() -> AsyncGenerator[ChatCompletionChunk, None]:
        for chunk in list[ChatCompletionChunk]():  # none: a generator that fails at its first read
            yield chunk
        raise errors.EngineUnavailable("no engine")

    with pytest.raises(errors.EngineUnavailable):
        await anext(MessagesPresenter().stream(turn_of(stream=True), META, failing()))


async def test_leaving_the_stream_closes_the_chunks() -> None:
    closed: list[bool] = []

    async def endless() -> AsyncGenerator[ChatCompletionChunk, None]:
        try:
            while True:
                yield chunk(content="x")
        finally:
            closed.append(True)

    frames = MessagesPresenter().stream(turn_of(stream=True), META, endless())
    await anext(frames)
    await frames.aclose()
    assert closed == [True]


# ------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InvalidRequest("bad"), "invalid_request_error"),
        (errors.Unauthorized("who"), "authentication_error"),
        (GatewayError("no", status=403), "permission_error"),
        (errors.ModelNotFound("which"), "not_found_error"),
        (errors.PayloadTooLarge("big"), "request_too_large"),
        (errors.Unprocessable("odd"), "invalid_request_error"),
        (errors.RateLimited("slow"), "rate_limit_error"),
        (GatewayError("oops"), "api_error"),
        (errors.EngineFailed("broke"), "api_error"),
        (errors.EngineUnavailable("busy"), "overloaded_error"),
        (errors.EngineTimeout("late"), "timeout_error"),
    ],
)
def test_error_body(error: GatewayError, kind: str) -> None:
    assert msgspec.json.decode(error_body(error)) == {"type": "error", "error": {"type": kind, "message": error.message}}


async def test_the_sdk_reads_error_bodies_and_events() -> None:
    client = sdk(lambda request: httpx2.Response(400, content=error_body(InvalidRequest("max_tokens: Field required"))))
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    await client.close()
    body = await frames_of([chunk(content="partial")])
    body = body[: body.index(b"event: message_delta")] + MessagesPresenter().error_frame(errors.EngineTimeout("the engine stream stalled"))
    client = sdk(lambda request: sse(body))
    with pytest.raises(anthropic.APIStatusError, match="timeout_error"):
        async with client.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]) as stream:
            await stream.get_final_message()
    await client.close()
