"""The Responses API as a chat completion: the request's translation and refusals, the bounded
store, and the answer and its events, checked against the `openai` SDK's own types."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pydantic
import pytest
from msgspec import UNSET
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent

from engine.openai_schema import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessageParam,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)
from gateway.errors import EngineFailed, EngineUnavailable, InvalidRequest
from gateway.response_store import ResponseStore
from gateway.responses import ResponsesPresenter, ResponsesRequest, decode_request, to_chat
from gateway.translate import Presented, Turn, turn

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
OWNER = "tenant:a"
META = Presented(response_id="resp_0123", model="sim", created=1_700_000_000, prompt_tokens=12)
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
USAGE = Usage(
    prompt_tokens=12,
    completion_tokens=20,
    total_tokens=32,
    prompt_tokens_details=PromptTokensDetails(cached_tokens=8),
    completion_tokens_details=CompletionTokensDetails(reasoning_tokens=4),
)
ALLOWED_EXTRAS = {"store", "name"}
"""Fields OpenAI sends that the SDK's models leave out: a Response's `store`, a done call's `name`."""


def request(**fields: Any) -> ResponsesRequest:
    return decode_request(json.dumps({"model": "sim", **fields}).encode()).request


def turn_of(history: list[ChatMessageParam] | None = None, **fields: Any) -> Turn[ResponsesRequest]:
    original = request(**fields)
    return turn(original, to_chat(original, history or []))


def refused(**fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        to_chat(decode_request(json.dumps({"model": "sim", **fields}).encode(), ignore_unknown=False).request, [])
    return caught.value


def extras(value: Any, path: str = "") -> list[str]:
    """Fields the SDK's models do not know, anywhere in `value` (a misspelt name lands here)."""
    if isinstance(value, pydantic.BaseModel):
        found = [f"{path}.{name}" for name in value.model_extra or {} if name not in ALLOWED_EXTRAS]
        for name in type(value).model_fields:
            found += extras(getattr(value, name), f"{path}.{name}")
        return found
    if isinstance(value, list):
        return [extra for i, item in enumerate(value) for extra in extras(item, f"{path}[{i}]")]
    return []


def sdk_response(response: Any) -> SDKResponse:
    parsed = SDKResponse.model_validate(json.loads(msgspec.json.encode(response)))
    assert extras(parsed) == []
    return parsed


# ------------------------------------------------------------ request → chat


def test_string_input_with_instructions_and_settings() -> None:
    chat = to_chat(
        request(
            input="Hi",
            instructions="Be brief.",
            max_output_tokens=64,
            temperature=0.5,
            top_p=0.9,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            stream=True,
            seed=7,
        ),
        [],
    )
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed, chat.n) == (64, 0.5, 0.9, 7, 1)
    assert chat.stream is True and chat.parallel_tool_calls is False
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    assert chat.tools[0].function.parameters == WEATHER["parameters"]
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "get_weather"
    assert chat.response_format is None and chat.chat_template_kwargs is None and chat.logprobs is False


def test_function_call_round_trip_items() -> None:
    chat = to_chat(
        request(
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}', "id": "fc_2"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
                {"role": "developer", "content": "Answer in French."},
                {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Summarise."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Soleil.", "annotations": []}]},
            ]
        ),
        [],
    )
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool", "tool", "system", "assistant"]
    user, calls, first, second, system, answer = chat.messages
    assert user.content == "Weather\nin Paris?"
    assert calls.reasoning == "Call the tool." and calls.content == ""
    assert calls.tool_calls == [
        ToolCall(id="call_1", function=FunctionCall("get_weather", '{"city":"Paris"}')),
        ToolCall(id="call_2", function=FunctionCall("get_weather", '{"city":"Lyon"}')),
    ]
    assert (first.tool_call_id, first.content, second.tool_call_id, second.content) == ("call_1", "sunny", "call_2", "rain")
    assert system.content == "Answer in French."
    assert answer.content == "Soleil." and answer.reasoning == "Summarise."


def test_calls_join_the_assistant_message_before_them_without_editing_history() -> None:
    history = [ChatMessageParam(role="user", content="Weather?"), ChatMessageParam(role="assistant", content="Checking.")]
    chat = to_chat(
        request(instructions="Be brief.", input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]),
        history,
    )
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Weather?"), ("assistant", "Checking.")]
    assert chat.messages[-1].tool_calls == [ToolCall(id="c", function=FunctionCall("f", "{}"))]
    assert history[-1].tool_calls is UNSET  # the stored conversation is untouched


def test_reasoning_with_no_assistant_turn_after_it_is_dropped() -> None:
    chat = to_chat(
        request(input=[{"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
                       {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]),
        [],
    )
    assert [m.reasoning for m in chat.messages] == [UNSET, UNSET]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ({"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}},
         {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}}),
        ({"format": {"type": "json_object"}}, {"type": "json_object"}),
        ({"format": {"type": "text"}, "verbosity": "low"}, None),
    ],
)
def test_text_format_is_the_chat_response_format(text: dict[str, Any], expected: dict[str, Any] | None) -> None:
    assert to_chat(request(input="Hi", text=text), []).response_format == expected


@pytest.mark.parametrize(("effort", "thinking"), [("none", False), ("minimal", True), ("high", True), (None, None)])
def test_reasoning_effort_switches_thinking(effort: str | None, thinking: bool | None) -> None:
    chat = to_chat(request(input="Hi", reasoning={"effort": effort, "summary": "auto"}), [])
    assert chat.chat_template_kwargs == (None if thinking is None else {"enable_thinking": thinking})


def test_logprobs_asked_by_top_logprobs_or_include() -> None:
    chat = to_chat(request(input="Hi", top_logprobs=3), [])
    assert (chat.logprobs, chat.top_logprobs) == (True, 3)
    chat = to_chat(request(input="Hi", include=["message.output_text.logprobs"]), [])
    assert (chat.logprobs, chat.top_logprobs) == (True, 0)


def test_inert_fields_are_accepted() -> None:
    request(
        input="Hi", include=["reasoning.encrypted_content"], truncation="auto", store=False, metadata={"k": "v"},
        service_tier="auto", safety_identifier="u", prompt_cache_key="k", prompt_cache_retention="24h", max_tool_calls=2,
        stream_options={"include_obfuscation": False}, background=False, user="u", top_k=20,
    )


@pytest.mark.parametrize(
    "tool",
    ["web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
     "image_generation", "mcp", "local_shell", "custom"],
)
def test_tools_other_than_functions_are_refused_by_name(tool: str) -> None:
    error = refused(input="Hi", tools=[WEATHER, {"type": tool}])
    assert tool in error.message and error.param == "tools[1]" and error.status == 400


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"frobnicate": 1}, "frobnicate", "frobnicate"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]", "input_file"),
        ({"input": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1]", "item_reference"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]", "call_id"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"background": True}, "background", "background"),
        ({"conversation": "conv_1"}, "conversation", "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
        ({"truncation": "sometimes"}, "truncation", "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"input": []}, "input", "input"),
    ],
)
def test_what_is_not_served_is_refused_by_name(fields: dict[str, Any], param: str, named: str) -> None:
    error = refused(**fields)
    assert error.param == param and named in error.message
    assert error.code == ("unknown_parameter" if named == "frobnicate" else None)


def test_unknown_fields_are_ignored_and_named_unless_refused() -> None:
    body = json.dumps({"model": "sim", "input": "hi", "client_metadata_v9": {"a": 1}, "frobnicate": 1}).encode()
    decoded = decode_request(body)
    assert decoded.ignored == ("client_metadata_v9", "frobnicate") and decoded.request.input == "hi"
    assert decode_request(json.dumps({"model": "sim", "input": "hi"}).encode()).ignored == ()
    with pytest.raises(InvalidRequest) as caught:  # a known field's bad value is refused either way
        decode_request(json.dumps({"model": "sim", "input": 3, "frobnicate": 1}).encode())
    assert caught.value.param == "input"


def test_malformed_json_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        decode_request(b'{"input": ').request


# ------------------------------------------------------------ the whole answer


def logprobs(*tokens: str) -> ChatLogprobs:
    return ChatLogprobs(content=[ChatLogprobToken(t, -0.5, None, [TopLogprob(t, -0.5), TopLogprob("x", -3.0, [120])]) for t in tokens])


def completion(finish: str = "tool_calls", **message: Any) -> ChatCompletion:
    fields: dict[str, Any] = {
        "content": "Hello world",
        "reasoning": "Let me think.",
        "tool_calls": [ToolCall(id="call_1", function=FunctionCall("get_weather", '{"city":"Paris"}'))],
        **message,
    }
    choice = ChatCompletionChoice(index=0, message=ChatCompletionMessage(**fields), logprobs=logprobs("Hello", " world"), finish_reason=finish)
    return ChatCompletion(model="sim", choices=[choice], usage=USAGE)


ASKED = {
    "input": "Weather in Paris?",
    "instructions": "Be brief.",
    "tools": [WEATHER],
    "tool_choice": "auto",
    "temperature": 0.2,
    "metadata": {"k": "v"},
    "reasoning": {"effort": "low"},
    "text": {"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": False}},
}


def test_whole_answer_is_a_valid_response_and_is_stored() -> None:
    store = ResponseStore()
    asked = turn_of(**ASKED)
    response = sdk_response(ResponsesPresenter(store, OWNER).whole(asked, META, completion()))
    assert (response.id, response.object, response.status, response.model, response.created_at) == (
        "resp_0123", "response", "completed", "sim", META.created)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.id.startswith("rs_") and reasoning.content is not None and reasoning.content[0].text == "Let me think."
    assert message.id.startswith("msg_") and response.output_text == "Hello world"
    assert message.content[0].logprobs is not None and [lp.token for lp in message.content[0].logprobs] == ["Hello", " world"]
    assert message.content[0].logprobs[0].bytes == list(b"Hello") and message.content[0].logprobs[0].top_logprobs[1].bytes == [120]
    assert call.id.startswith("fc_") and (call.call_id, call.name, call.arguments, call.status) == (
        "call_1", "get_weather", '{"city":"Paris"}', "completed")
    assert response.usage is not None and response.usage.model_dump() == {
        "input_tokens": 12, "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0, "cache_write_tokens_details": None},
        "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 32}
    assert response.instructions == "Be brief." and response.tools[0].name == "get_weather" and response.temperature == 0.2
    assert response.text is not None and response.text.format is not None and response.text.format.type == "json_schema"
    assert response.text.format.schema_ == {"type": "object"}
    assert response.reasoning is not None and response.reasoning.effort == "low" and response.metadata == {"k": "v"}
    assert (response.tool_choice, response.parallel_tool_calls, response.truncation) == ("auto", True, "disabled")
    stored = store.get(OWNER, "resp_0123")
    assert stored is not None and stored.response is not None
    assert [m.role for m in stored.conversation] == ["user", "assistant"]  # the instructions are not carried
    assert stored.conversation[-1] == ChatMessageParam(
        role="assistant", content="Hello world", reasoning="Let me think.",
        tool_calls=[ToolCall(id="call_1", function=FunctionCall("get_weather", '{"city":"Paris"}'))])


def test_a_stored_turn_continues_with_previous_response_id() -> None:
    store = ResponseStore()
    ResponsesPresenter(store, OWNER).whole(turn_of(**ASKED), META, completion())
    stored = store.get(OWNER, META.response_id)
    assert stored is not None
    following = request(
        previous_response_id=META.response_id, input=[{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    )
    chat = to_chat(following, stored.conversation)
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].tool_calls and chat.messages[2].tool_call_id == "call_1"


def test_reasoning_content_spelling_and_an_answer_cut_by_the_limit() -> None:
    answer = completion("length", reasoning=UNSET, reasoning_content="Hmm.", tool_calls=UNSET)
    response = sdk_response(ResponsesPresenter(None, OWNER).whole(turn_of(input="Hi"), META, answer))
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.completed_at is None
    assert [item.status for item in response.output] == ["completed", "incomplete"]


def test_store_false_and_empty_answers() -> None:
    store = ResponseStore()
    response = ResponsesPresenter(store, OWNER).whole(turn_of(input="Hi", store=False), META, completion("stop", content=None, reasoning=None, tool_calls=UNSET))
    assert sdk_response(response).output == [] and store.get(OWNER, META.response_id) is None


# ------------------------------------------------------------ the stream


def chunk(finish: str | None = None, **delta: Any) -> ChatCompletionChunk:
    choice_logprobs = delta.pop("logprobs", None)
    choice = ChatCompletionChunkChoice(index=0, delta=ChatDelta(**delta), logprobs=choice_logprobs, finish_reason=finish)
    return ChatCompletionChunk(model="sim", choices=[choice])


def call(index: int, arguments: str, id: str | None = None, name: str | None = None) -> DeltaToolCall:
    if id is None:
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))
    return DeltaToolCall(index=index, id=id, type="function", function=DeltaFunctionCall(name=name, arguments=arguments))


def answer_chunks(finish: str = "tool_calls") -> list[ChatCompletionChunk]:
    return [
        chunk(role="assistant", content=""),
        chunk(reasoning="Let me "),
        chunk(reasoning_content="think.", content=None),
        chunk(content="Hello", logprobs=logprobs("Hello")),
        chunk(content=" world", reasoning=None, logprobs=logprobs(" world")),
        chunk(tool_calls=[call(0, "", "call_1", "get_weather")]),
        chunk(tool_calls=[call(0, '{"city":')], content=None),
        chunk(tool_calls=[call(0, '"Paris"}')]),
        chunk(tool_calls=[call(1, "{}", "call_2", "get_time")]),
        chunk(finish),
        ChatCompletionChunk(model="sim", choices=[], usage=USAGE),
    ]


async def replay(chunks: list[ChatCompletionChunk]) -> AsyncIterator[ChatCompletionChunk]:
    for item in chunks:
        yield item


async def streamed(presenter: ResponsesPresenter, asked: Turn[ResponsesRequest], chunks: list[ChatCompletionChunk]) -> list[Any]:
    frames = [frame async for frame in presenter.stream(asked, META, replay(chunks))]
    return parse(b"".join(frames))


def parse(body: bytes) -> list[Any]:
    """SSE frames as the SDK's events, each checked for its `event:` line and unknown fields."""
    events = []
    assert body.endswith(b"\n\n") and b"[DONE]" not in body
    for block in body.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = EVENTS.validate_json(data.removeprefix("data: "))
        assert event.type == name.removeprefix("event: ") and extras(event) == []
        events.append(event)
    return events


EXPECTED_KINDS = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
    "response.function_call_arguments.done", "response.output_item.done",
    "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


async def test_stream_events_are_valid_and_agree_with_the_whole_answer() -> None:
    store = ResponseStore()
    asked = turn_of(stream=True, **ASKED)
    events = await streamed(ResponsesPresenter(store, OWNER), asked, answer_chunks())
    assert [event.type for event in events] == EXPECTED_KINDS
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert {event.content_index for event in events if hasattr(event, "content_index")} == {0}
    text_deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert [d.delta for d in text_deltas] == ["Hello", " world"] and text_deltas[0].logprobs[0].token == "Hello"
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert [(d.arguments, d.model_extra) for d in done] == [('{"city":"Paris"}', {"name": "get_weather"}), ("{}", {"name": "get_time"})]
    added = [event.item for event in events if event.type == "response.output_item.added"]
    finished = [event.item for event in events if event.type == "response.output_item.done"]
    assert [item.id for item in added] == [item.id for item in finished]
    assert [event.output_index for event in events if event.type == "response.output_item.done"] == [0, 1, 2, 3]

    final = events[-1].response
    assert extras(final) == [] and final.status == "completed" and final.output == finished
    assert final.output_text == "Hello world" and final.output[0].content[0].text == "Let me think."
    assert [(item.call_id, item.name) for item in final.output[2:]] == [("call_1", "get_weather"), ("call_2", "get_time")]
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (12, 20, 32)

    whole = sdk_response(ResponsesPresenter(None, OWNER).whole(turn_of(**ASKED), META, completion()))
    shape = [(item.type, item.model_dump(exclude={"id"})) for item in whole.output[:2]]
    assert [(item.type, item.model_dump(exclude={"id"})) for item in final.output[:2]] == shape

    stored = store.get(OWNER, META.response_id)
    assert stored is not None and stored.conversation[-1].reasoning == "Let me think."
    assert stored.conversation[-1].tool_calls and len(stored.conversation[-1].tool_calls) == 2


async def test_the_sdk_stream_accumulator_takes_the_events() -> None:
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in await streamed(ResponsesPresenter(None, OWNER), turn_of(stream=True, **ASKED), answer_chunks()):
        shown = state.handle_event(event)
    assert shown[-1].type == "response.completed" and shown[-1].response.output_text == "Hello world"


async def test_a_stream_cut_by_the_limit_ends_incomplete() -> None:
    chunks = [chunk(role="assistant", content=""), chunk(content="Hel"), chunk("length", content="lo"), ChatCompletionChunk(model="sim", choices=[], usage=USAGE)]
    events = await streamed(ResponsesPresenter(None, OWNER), turn_of(input="Hi", stream=True), chunks)
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
    assert events[-1].response.output_text == "Hello"


async def test_an_error_continues_the_numbering() -> None:
    presenter = ResponsesPresenter(None, OWNER)
    events = await streamed(presenter, turn_of(input="Hi", stream=True), answer_chunks("stop"))
    error = parse(presenter.error_frame(EngineFailed("the engine went away")))
    assert [(e.type, e.sequence_number, e.code, e.message) for e in error] == [
        ("error", len(events), "engine_failed", "the engine went away")]


async def test_a_failure_before_the_first_chunk_sends_nothing() -> None:
    async def failing() -> AsyncIterator[ChatCompletionChunk]:
        raise EngineUnavailable("no engine")
        yield  # an async generator

    frames = ResponsesPresenter(None, OWNER).stream(turn_of(input="Hi", stream=True), META, failing())
    with pytest.raises(EngineUnavailable):
        await anext(frames)


async def test_closing_the_stream_closes_the_chunks() -> None:
    closed = []

    async def endless() -> AsyncIterator[ChatCompletionChunk]:
        try:
            while True:
                yield chunk(content="x")
        finally:
            closed.append(True)

    frames = ResponsesPresenter(None, OWNER).stream(turn_of(input="Hi", stream=True), META, endless())
    await anext(frames)
    await frames.aclose()  # type: ignore[attr-defined]
    assert closed == [True]
