"""The Responses API as a chat completion: the request's translation and refusals, the bounded
store, and the answer and its events, checked against the `openai` SDK's own types."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pydantic
import pytest
from msgspec import UNSET
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SDKResponse
from openai.types.responses import (
    FunctionTool,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseStreamEvent,
)

from wire.openai_schema import (
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
from gateway.edge.errors import EngineFailed, EngineUnavailable, InvalidRequest
from derender.custom_input import CustomInputStream, custom_input
from gateway.apis.agent_tools import FREE_TEXT, ToolPolicy, hosted_types
from gateway.apis.response_store import InProcess, ResponseStore
from gateway.apis.responses import ResponsesPresenter, ResponsesRequest, decode_request, to_chat
from gateway.apis.translate import Presented, Turn, turn
from tests.support.narrow import of

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
def test_reasoning_effort_switches_thinking_and_is_forwarded(effort: str | None, thinking: bool | None) -> None:
    chat = to_chat(request(input="Hi", reasoning={"effort": effort, "summary": "auto"}), [])
    kwargs = None if thinking is None else {"enable_thinking": thinking, "reasoning_effort": effort}
    assert chat.chat_template_kwargs == kwargs and chat.reasoning_effort == effort


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


HOSTED = ["web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
          "image_generation", "mcp", "local_shell", "shell", "apply_patch"]


@pytest.mark.parametrize("tool", HOSTED)
def test_hosted_tools_are_dropped_by_default_and_refused_when_set(tool: str) -> None:
    asked = request(input="Hi", tools=[WEATHER, {"type": tool, "external_web_access": False}])
    chat = to_chat(asked, [])
    assert [t.function.name for t in chat.tools or ()] == ["get_weather"]
    assert hosted_types(asked.tools) == [tool]
    with pytest.raises(InvalidRequest) as caught:
        to_chat(asked, [], ToolPolicy(hosted="refuse"))
    assert tool in caught.value.message and caught.value.param == "tools[1].type"


def test_only_hosted_tools_leave_no_tools_and_a_forced_one_is_forced_no_more() -> None:
    chat = to_chat(request(input="Hi", tools=[{"type": "web_search"}], tool_choice={"type": "web_search"}), [])
    assert chat.tools is None and chat.tool_choice is UNSET
    chat = to_chat(request(input="Hi", tools=[WEATHER, {"type": "web_search"}], tool_choice={"type": "web_search"}), [])
    assert chat.tools is not None and chat.tool_choice is UNSET
    with pytest.raises(InvalidRequest) as caught:
        to_chat(request(input="Hi", tools=[WEATHER], tool_choice={"type": "web_search"}), [], ToolPolicy(hosted="refuse"))
    assert caught.value.param == "tool_choice.type"


AGENTS = {
    "type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Start one.", "parameters": {"type": "object", "properties": {}}},
        {"type": "custom", "name": "note", "description": "Free text."},
    ],
}
PATCH = {
    "type": "custom", "name": "apply_patch", "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}


def test_namespace_and_custom_tools_are_flattened_chat_functions() -> None:
    chat = to_chat(request(input="Hi", tools=[WEATHER, AGENTS, PATCH], tool_choice={"type": "custom", "name": "apply_patch"}), [])
    functions = {t.function.name: t.function for t in chat.tools or ()}
    assert list(functions) == ["get_weather", "multi_agent_v1__spawn_agent", "multi_agent_v1__note", "apply_patch"]
    spawn, note, patch = functions["multi_agent_v1__spawn_agent"], functions["multi_agent_v1__note"], functions["apply_patch"]
    assert spawn.description == "(multi_agent_v1: Sub-agents.)\n\nStart one." and spawn.parameters == {"type": "object", "properties": {}}
    assert note.parameters == patch.parameters == FREE_TEXT
    assert patch.description is not None and PATCH["format"]["definition"] in patch.description  # type: ignore[index]
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "apply_patch"
    named = to_chat(request(input="Hi", tools=[AGENTS], tool_choice={"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}), [])
    assert isinstance(named.tool_choice, NamedToolChoice) and named.tool_choice.function.name == "multi_agent_v1__spawn_agent"


@pytest.mark.parametrize(
    ("tools", "param", "named"),
    [
        ([{"type": "namespace", "name": "empty", "description": "x", "tools": []}], "tools[0].tools", "no tools"),
        ([{"type": "namespace", "name": "empty", "description": "x"}], "tools[0].tools", "no tools"),
        ([WEATHER, {**PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}],
         "tools[1].format.definition", "does not compile"),
        ([{**PATCH, "format": {"type": "grammar", "syntax": "regex", "definition": "a(b"}}], "tools[0].format.definition", "regex"),
        ([{**AGENTS, "tools": [{**PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "nope"}}]}],
         "tools[0].tools[0].format.definition", "lark"),
        ([{**AGENTS, "tools": [AGENTS]}], "tools[0].tools[0].type", "namespace"),
        ([WEATHER, WEATHER], "tools[1].name", "get_weather"),
        ([WEATHER, {"type": "hosted_frobnicator"}], "tools[1]", "hosted_frobnicator"),
    ],
)
def test_tools_that_cannot_be_served_are_refused_by_name(tools: list[Any], param: str, named: str) -> None:
    error = refused(input="Hi", tools=tools)
    assert error.param == param and named in error.message and error.status == 400


def test_a_grammar_past_the_limits_is_refused_before_it_is_compiled() -> None:
    deep = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(300)) + 'r300: "x"\n'
    asked = request(input="Hi", tools=[{**PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": deep}}])
    with pytest.raises(InvalidRequest) as caught:
        to_chat(asked, [])
    assert caught.value.param == "tools[0].format.definition" and "depth" in caught.value.message


def test_namespace_and_custom_calls_sent_back_are_flattened_again() -> None:
    chat = to_chat(
        request(
            tools=[AGENTS, PATCH],
            input=[
                {"role": "user", "content": "Go"},
                {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{}"},
                {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch\n\"x\""},
                {"type": "function_call_output", "call_id": "c1", "output": "agent 7"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done!"},
            ],
        ),
        [],
    )
    calls = chat.messages[1].tool_calls
    assert calls == [
        ToolCall(id="c1", function=FunctionCall("multi_agent_v1__spawn_agent", "{}")),
        ToolCall(id="c2", function=FunctionCall("apply_patch", json.dumps({"input": '*** Begin Patch\n"x"'}))),
    ]
    assert [(m.role, m.tool_call_id, m.content) for m in chat.messages[2:]] == [("tool", "c1", "agent 7"), ("tool", "c2", "Done!")]


def test_an_output_without_call_id_answers_the_latest_unanswered_call_of_its_tool() -> None:
    goal = {"type": "function", "name": "get_goal", "parameters": {"type": "object", "properties": {}}}
    history = [
        ChatMessageParam(role="user", content="Go"),
        ChatMessageParam(role="assistant", content="", tool_calls=[ToolCall(id="h1", function=FunctionCall("get_goal", "{}"))]),
    ]
    chat = to_chat(
        request(
            tools=[goal, AGENTS],
            input=[
                {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c2", "output": "second"},
                {"type": "function_call_output", "name": "spawn_agent", "namespace": "multi_agent_v1", "output": "first"},
                {"type": "function_call_output", "name": "get_goal", "output": "the goal"},
                {"type": "function_call_output", "name": "get_goal", "output": "unmatched"},
            ],
        ),
        history,
    )
    tools = [(m.tool_call_id, m.name, m.content) for m in chat.messages if m.role == "tool"]
    assert tools == [("c2", UNSET, "second"), ("c1", UNSET, "first"), ("h1", UNSET, "the goal"), (UNSET, "get_goal", "unmatched")]
    error = refused(input=[{"role": "user", "content": "Hi"}, {"type": "function_call_output", "output": "x"}])
    assert error.param == "input[1].call_id" and "call_id" in error.message


def test_an_image_in_a_tool_output_is_a_line_saying_so() -> None:
    output = [{"type": "input_text", "text": "Here:"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    chat = to_chat(request(input=[{"role": "user", "content": "Look"}, {"type": "function_call_output", "call_id": "c", "output": output}]), [])
    assert chat.messages[-1].content == "Here:\n[image left out: this model reads text only]"
    error = refused(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    assert error.param == "input[0].content[0]"  # a user's image is still refused: the model cannot see it


def test_leading_developer_and_system_messages_are_one_system_turn() -> None:
    items = [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": "Later."},
    ]
    chat = to_chat(request(input=items), [])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "You are Codex.\n\nSkills."), ("user", "Hi"), ("system", "Later.")]
    chat = to_chat(request(instructions="Be brief.", input=items), [])
    assert chat.messages[0].content == "Be brief.\n\nYou are Codex.\n\nSkills." and len(chat.messages) == 3


def test_codex_fields_are_real_fields() -> None:
    asked = request(
        input="Hi", client_metadata={"x-codex-turn-metadata": '{"session_id": "s"}'}, prompt_cache_key="s",
        include=["reasoning.encrypted_content", "web_search_call.action.sources"], reasoning={"summary": "auto"}, store=False,
    )
    assert asked.client_metadata == {"x-codex-turn-metadata": '{"session_id": "s"}'} and asked.store is False
    assert decode_request(json.dumps({"model": "sim", "input": "hi", "client_metadata": {}}).encode(), ignore_unknown=False).ignored == ()


def test_sampling_extras_reach_the_chat_request() -> None:
    extras = {
        "ignore_eos": True, "min_tokens": 4, "min_p": 0.1, "repetition_penalty": 1.1, "frequency_penalty": 0.2,
        "presence_penalty": 0.3, "stop_token_ids": [7], "skip_special_tokens": False, "stop": ["END"], "top_k": 5, "seed": 3,
    }
    chat = to_chat(request(input="Hi", **extras), [])
    assert {name: getattr(chat, name) for name in extras} == extras
    plain = to_chat(request(input="Hi"), [])
    assert (plain.ignore_eos, plain.min_tokens, plain.stop_token_ids, plain.skip_special_tokens) == (False, 0, [], True)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_call_leaves_the_format_for_a_later_text_answer(choice: Any) -> None:
    text = {"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}}}
    chat = to_chat(request(input="Hi", tools=[WEATHER], tool_choice=choice, text=text), [])
    assert chat.response_format is None and chat.tool_choice is not UNSET
    assert to_chat(request(input="Hi", tools=[WEATHER], text=text), []).response_format is not None


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"frobnicate": 1}, "frobnicate", "frobnicate"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]", "input_file"),
        ({"input": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1]", "item_reference"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]", "call_id"),
        ({"tool_choice": {"type": "hosted_frobnicator"}}, "tool_choice", "hosted_frobnicator"),
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
        decode_request(b'{"input": ')


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


ASKED: dict[str, Any] = {
    "input": "Weather in Paris?",
    "instructions": "Be brief.",
    "tools": [WEATHER],
    "tool_choice": "auto",
    "temperature": 0.2,
    "metadata": {"k": "v"},
    "reasoning": {"effort": "low"},
    "text": {"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": False}},
}


async def test_whole_answer_is_a_valid_response_and_is_stored() -> None:
    store = ResponseStore()
    asked = turn_of(**ASKED)
    response = sdk_response(await ResponsesPresenter(InProcess(store), OWNER).whole(asked, META, completion()))
    assert (response.id, response.object, response.status, response.model, response.created_at) == (
        "resp_0123", "response", "completed", "sim", META.created)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning = of(ResponseReasoningItem, response.output[0])
    message = of(ResponseOutputMessage, response.output[1])
    call = of(ResponseFunctionToolCall, response.output[2])
    text = of(ResponseOutputText, message.content[0])
    assert reasoning.id.startswith("rs_") and reasoning.content is not None and reasoning.content[0].text == "Let me think."
    assert message.id.startswith("msg_") and response.output_text == "Hello world"
    assert text.logprobs is not None and [lp.token for lp in text.logprobs] == ["Hello", " world"]
    assert text.logprobs[0].bytes == list(b"Hello") and text.logprobs[0].top_logprobs[1].bytes == [120]
    assert call.id is not None and call.id.startswith("fc_") and (call.call_id, call.name, call.arguments, call.status) == (
        "call_1", "get_weather", '{"city":"Paris"}', "completed")
    assert response.usage is not None and response.usage.model_dump() == {
        "input_tokens": 12, "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0, "cache_write_tokens_details": None},
        "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 32}
    assert response.instructions == "Be brief." and of(FunctionTool, response.tools[0]).name == "get_weather" and response.temperature == 0.2
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


async def test_a_stored_turn_continues_with_previous_response_id() -> None:
    store = ResponseStore()
    await ResponsesPresenter(InProcess(store), OWNER).whole(turn_of(**ASKED), META, completion())
    stored = store.get(OWNER, META.response_id)
    assert stored is not None
    following = request(
        previous_response_id=META.response_id, input=[{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    )
    chat = to_chat(following, stored.conversation)
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].tool_calls and chat.messages[2].tool_call_id == "call_1"


async def test_reasoning_content_spelling_and_an_answer_cut_by_the_limit() -> None:
    answer = completion("length", reasoning=UNSET, reasoning_content="Hmm.", tool_calls=UNSET)
    response = sdk_response(await ResponsesPresenter(None, OWNER).whole(turn_of(input="Hi"), META, answer))
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.completed_at is None
    reasoning, message = of(ResponseReasoningItem, response.output[0]), of(ResponseOutputMessage, response.output[1])
    assert [reasoning.status, message.status] == ["completed", "incomplete"]


async def test_store_false_and_empty_answers() -> None:
    store = ResponseStore()
    response = await ResponsesPresenter(InProcess(store), OWNER).whole(turn_of(input="Hi", store=False), META, completion("stop", content=None, reasoning=None, tool_calls=UNSET))
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


async def replay(chunks: list[ChatCompletionChunk]) -> AsyncGenerator[ChatCompletionChunk, None]:
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
    events = await streamed(ResponsesPresenter(InProcess(store), OWNER), asked, answer_chunks())
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

    whole = sdk_response(await ResponsesPresenter(None, OWNER).whole(turn_of(**ASKED), META, completion()))
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
    async def no_engine() -> ChatCompletionChunk:
        raise EngineUnavailable("no engine")

    async def failing() -> AsyncGenerator[ChatCompletionChunk, None]:
        yield await no_engine()  # reading the first chunk fails

    frames = ResponsesPresenter(None, OWNER).stream(turn_of(input="Hi", stream=True), META, failing())
    with pytest.raises(EngineUnavailable):
        await anext(frames)


async def test_closing_the_stream_closes_the_chunks() -> None:
    closed = []

    async def endless() -> AsyncGenerator[ChatCompletionChunk, None]:
        try:
            while True:
                yield chunk(content="x")
        finally:
            closed.append(True)

    frames = ResponsesPresenter(None, OWNER).stream(turn_of(input="Hi", stream=True), META, endless())
    await anext(frames)
    await frames.aclose()
    assert closed == [True]


# ------------------------------------------------------------ agents' tools in the answer

AGENT_ASKED: dict[str, Any] = {"input": "Go", "tools": [WEATHER, AGENTS, PATCH, {"type": "web_search"}]}
PATCH_TEXT = '*** Begin Patch\n+ "quoted"\n*** End Patch'
AGENT_CALLS = [
    ToolCall(id="call_1", function=FunctionCall("multi_agent_v1__spawn_agent", '{"task":"x"}')),
    ToolCall(id="call_2", function=FunctionCall("apply_patch", json.dumps({"input": PATCH_TEXT}))),
    ToolCall(id="call_3", function=FunctionCall("multi_agent_v1__note", "not an object")),
]


async def test_namespace_and_custom_calls_come_back_as_their_items() -> None:
    store = ResponseStore()
    presenter = ResponsesPresenter(InProcess(store), OWNER)
    response = sdk_response(await presenter.whole(turn_of(**AGENT_ASKED), META, completion(content=None, tool_calls=AGENT_CALLS)))
    spawn = of(ResponseFunctionToolCall, response.output[1])
    patch, note = of(ResponseCustomToolCall, response.output[2]), of(ResponseCustomToolCall, response.output[3])
    assert (spawn.type, spawn.call_id, spawn.name, spawn.namespace, spawn.arguments) == (
        "function_call", "call_1", "spawn_agent", "multi_agent_v1", '{"task":"x"}')
    assert (patch.type, patch.call_id, patch.name, patch.namespace, patch.input) == (
        "custom_tool_call", "call_2", "apply_patch", None, PATCH_TEXT)
    assert patch.id is not None and patch.id.startswith("ctc_") and patch.model_extra == {}
    assert (note.type, note.name, note.namespace, note.input) == ("custom_tool_call", "note", "multi_agent_v1", "not an object")
    assert [tool.type for tool in response.tools] == ["function", "namespace", "custom"]  # web_search was left out
    stored = store.get(OWNER, META.response_id)
    assert stored is not None and stored.conversation[-1].tool_calls == [*AGENT_CALLS[:2], ToolCall(id="call_3", function=FunctionCall("multi_agent_v1__note", json.dumps({"input": "not an object"})))]
    plain = sdk_response(await ResponsesPresenter(None, OWNER).whole(turn_of(**ASKED), META, completion()))
    assert "namespace" not in msgspec.json.decode(msgspec.json.encode(plain.output[2].model_dump(exclude_none=True)))


async def test_namespace_and_custom_calls_stream_their_own_events() -> None:
    chunks = [
        chunk(role="assistant", content=""),
        chunk(tool_calls=[call(0, "", "call_1", "multi_agent_v1__spawn_agent")]),
        chunk(tool_calls=[call(0, '{"task":"x"}')]),
        chunk(tool_calls=[call(1, '{"input": "*** Begin', "call_2", "apply_patch")]),
        chunk(tool_calls=[call(1, json.dumps({"input": PATCH_TEXT})[len('{"input": "*** Begin'):])]),
        chunk(tool_calls=[call(2, "not an object", "call_3", "multi_agent_v1__note")]),
        chunk("tool_calls"),
        ChatCompletionChunk(model="sim", choices=[], usage=USAGE),
    ]
    events = await streamed(ResponsesPresenter(None, OWNER), turn_of(stream=True, **AGENT_ASKED), chunks)
    kinds = [event.type for event in events]
    assert kinds[2:-1] == [
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.output_item.added", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [(item.type, item.name, item.namespace) for item in added] == [
        ("function_call", "spawn_agent", "multi_agent_v1"), ("custom_tool_call", "apply_patch", None),
        ("custom_tool_call", "note", "multi_agent_v1")]
    arguments_done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert arguments_done.model_extra == {"name": "spawn_agent"}
    deltas = [(event.item_id, event.delta) for event in events if event.type == "response.custom_tool_call_input.delta"]
    assert [delta for _, delta in deltas] == ["*** Begin", PATCH_TEXT.removeprefix("*** Begin"), "not an object"]
    done = [event.input for event in events if event.type == "response.custom_tool_call_input.done"]
    final = events[-1].response
    assert [(item.type, item.name, item.namespace) for item in final.output] == [
        ("function_call", "spawn_agent", "multi_agent_v1"), ("custom_tool_call", "apply_patch", None),
        ("custom_tool_call", "note", "multi_agent_v1")]
    assert done == [final.output[1].input, final.output[2].input] == [PATCH_TEXT, "not an object"]
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(event)


@pytest.mark.parametrize(
    "text", ['*** Begin Patch\n+ "quoted" \\ tab\t é 🫠 𓀀\n*** End Patch', "", "plain"]
)
def test_custom_input_streams_whatever_the_deltas_cut(text: str) -> None:
    spellings = [json.dumps({"input": text}), json.dumps({"input": text}, ensure_ascii=False), '{ "input" :\n "' + json.dumps(text)[1:-1] + '" }']
    for arguments in spellings:
        for cut in range(len(arguments) + 1):
            for end in range(cut, len(arguments) + 1):
                stream = CustomInputStream()
                shown = [stream.feed(arguments[:cut]), stream.feed(arguments[cut:end]), stream.feed(arguments[end:])]
                assert "".join(shown) == text == custom_input(arguments), (arguments, cut, end)


def test_custom_input_not_in_its_object_is_not_streamed() -> None:
    for arguments in ['{"path": "a", "input": "b"}', "free text", '{"input": 3}']:
        stream = CustomInputStream()
        assert stream.feed(arguments[:5]) + stream.feed(arguments[5:]) == ""
    assert custom_input('{"input": "line\nbreak"}') == "line\nbreak"  # a raw line break in the string is taken


# ------------------------------------------------------------ a forced custom tool's grammar

REGEX_TOOL = {"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}"}}
GRAMMARS = ToolPolicy(enforced=frozenset({"grammar", "regex"}))
FORCE_PATCH = {"type": "custom", "name": "apply_patch"}


def test_a_forced_grammar_tool_is_decoded_as_text_under_its_grammar_where_engines_enforce_it() -> None:
    chat = to_chat(request(input="Go", tools=[WEATHER, PATCH], tool_choice=FORCE_PATCH, text={"format": {"type": "json_object"}}), [], GRAMMARS)
    assert chat.tool_choice == "none" and [t.function.name for t in chat.tools or ()] == ["get_weather", "apply_patch"]
    assert chat.structured_outputs == {"grammar": PATCH["format"]["definition"]} and chat.response_format is None  # type: ignore[index]
    nested = {**AGENTS, "tools": [REGEX_TOOL]}
    chat = to_chat(request(input="Go", tools=[nested], tool_choice={"type": "custom", "name": "code", "namespace": "multi_agent_v1"}), [], GRAMMARS)
    assert chat.tool_choice == "none" and chat.structured_outputs == {"regex": "[0-9]{3}"}


@pytest.mark.parametrize(
    ("tools", "choice", "policy"),
    [
        ([PATCH], FORCE_PATCH, ToolPolicy()),  # the engines enforce no grammar
        ([REGEX_TOOL], {"type": "custom", "name": "code"}, ToolPolicy(enforced=frozenset({"grammar"}))),
        ([AGENTS], {"type": "custom", "name": "note", "namespace": "multi_agent_v1"}, GRAMMARS),  # no grammar
    ],
)
def test_otherwise_a_forced_custom_tool_is_a_forced_call(tools: list[Any], choice: dict[str, Any], policy: ToolPolicy) -> None:
    chat = to_chat(request(input="Go", tools=tools, tool_choice=choice), [], policy)
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.structured_outputs is None


def forced_turn(**fields: Any) -> Turn[ResponsesRequest]:
    original = request(input="Go", tools=[WEATHER, PATCH], tool_choice=FORCE_PATCH, **fields)
    return turn(original, to_chat(original, [], GRAMMARS))


async def test_the_text_of_a_grammar_forced_turn_is_the_call() -> None:
    store = ResponseStore()
    answer = completion("stop", content=PATCH_TEXT, tool_calls=None)
    response = sdk_response(await ResponsesPresenter(InProcess(store), OWNER).whole(forced_turn(), META, answer))
    assert [item.type for item in response.output] == ["reasoning", "custom_tool_call"]
    call = of(ResponseCustomToolCall, response.output[1])
    assert (call.name, call.input, call.namespace) == ("apply_patch", PATCH_TEXT, None) and call.call_id.startswith("call_")
    stored = store.get(OWNER, META.response_id)
    assert stored is not None and stored.conversation[-1].tool_calls == [
        ToolCall(id=call.call_id, function=FunctionCall("apply_patch", json.dumps({"input": PATCH_TEXT})))]
    assert stored.conversation[-1].content == ""


async def test_the_text_of_a_grammar_forced_turn_streams_as_the_calls_input() -> None:
    chunks = [chunk(role="assistant", content=""), chunk(reasoning="Patch."), chunk(content=PATCH_TEXT[:9]),
              chunk(content=PATCH_TEXT[9:]), chunk("stop"), ChatCompletionChunk(model="sim", choices=[], usage=USAGE)]
    events = await streamed(ResponsesPresenter(None, OWNER), forced_turn(stream=True), chunks)
    kinds = [event.type for event in events]
    assert kinds[-6:] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                          "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
                          "response.output_item.done", "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.custom_tool_call_input.delta"]
    final = events[-1].response.output[-1]
    assert deltas == [PATCH_TEXT[:9], PATCH_TEXT[9:]] and (final.type, final.name, final.input) == ("custom_tool_call", "apply_patch", PATCH_TEXT)
