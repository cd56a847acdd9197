"""vLLM 0.33's derender form in wire/protocol.py: `parse_context` and `GenerateDerenderResponse`."""

from __future__ import annotations

import json

import msgspec
import pytest

from wire import openai_schema as oa
from wire import protocol as p
from tests.support import vllm033

# What vLLM 0.33's /render puts in a generate request for a chat with a tool and thinking on
# (its ParseContext as model_dump() writes it: every field).
PARSE_CONTEXT = {
    "tools": [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}},
        }
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "include_reasoning": True,
    "chat_template_kwargs": {"add_generation_prompt": True, "continue_final_message": False, "enable_thinking": True},
    "history_tool_call_cnt": 2,
}


def derender_request(**extra: object) -> bytes:
    body = {
        "request_id": "chatcmpl-1",
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 8},
        "output_mode": "derender",
        "parse_context": PARSE_CONTEXT,
        "stream": False,
        **extra,
    }
    return json.dumps(body).encode()


def test_parse_context_decodes_and_round_trips() -> None:
    request = p.decode_generate_request(derender_request())
    context = request.parse_context
    assert context is not None and request.vllm_derender
    assert context.tool_choice == "auto" and context.history_tool_call_cnt == 2
    assert context.tools is not None and context.tools[0].function.name == "get_weather"
    assert context.chat_template_kwargs["enable_thinking"] is True
    again = p.decode_generate_request(p.encode(request))
    assert again == request
    # What onehop writes is what vLLM's model reads, and back.
    mirrored = vllm033.PARSE_CONTEXT.decode(p.encode(context))
    assert mirrored == vllm033.PARSE_CONTEXT.decode(json.dumps(PARSE_CONTEXT))
    assert msgspec.json.decode(msgspec.json.encode(mirrored), type=p.ParseContext) == context


def test_parse_context_defaults_are_vllms() -> None:
    context = msgspec.json.decode(b"{}", type=p.ParseContext)
    assert (context.tools, context.tool_choice, context.parallel_tool_calls) == (None, "none", True)
    assert (context.include_reasoning, context.chat_template_kwargs, context.history_tool_call_cnt) == (True, {}, 0)
    assert p.encode(context) == b"{}"
    named = msgspec.json.decode(b'{"tool_choice": {"type": "function", "function": {"name": "f"}}}', type=p.ParseContext)
    assert isinstance(named.tool_choice, oa.NamedToolChoice) and named.tool_choice.function.name == "f"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (derender_request(parse_context={**PARSE_CONTEXT, "from_a_newer_render": 1}), "from_a_newer_render"),
        (derender_request(parse_context={"history_tool_call_cnt": -1}), "history_tool_call_cnt"),
        (derender_request(stream=True), "does not support stream=true"),
    ],
)
def test_invalid_parse_context_requests_are_refused(body: bytes, message: str) -> None:
    with pytest.raises(p.ProtocolError, match=message):
        p.decode_generate_request(body)


def test_parse_context_beside_onehops_chat_request_is_refused() -> None:
    with pytest.raises(p.ProtocolError, match="exclusive"):
        p.decode_generate_request(derender_request(chat_request={"messages": [], "stream": False}))


def test_parse_context_is_ignored_at_other_levels() -> None:
    request = p.decode_generate_request(derender_request(output_mode="tokens", stream=True))
    assert request.parse_context is not None and not request.vllm_derender


def test_derender_without_context_is_vllms_form() -> None:
    request = p.decode_generate_request(derender_request(parse_context=None))
    assert request.vllm_derender and request.parse_context is None


def _response() -> p.GenerateDerenderResponse:
    message = oa.ChatCompletionMessage(
        content=None,
        reasoning="think",
        tool_calls=[oa.ToolCall(id="chatcmpl-tool-1", function=oa.FunctionCall(name="f", arguments="{}"))],
    )
    return p.GenerateDerenderResponse(
        request_id="r",
        model="m",
        created=1,
        usage=oa.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        choices=[
            p.GenerateDerenderChoice(
                index=0,
                message=message,
                finish_reason="tool_calls",
                token_ids=[5, 6],
                logprobs=oa.ChatLogprobs(content=[oa.ChatLogprobToken(token="a", logprob=-0.5, bytes=[97])]),
            )
        ],
    )


def test_derender_response_is_vllms_shape() -> None:
    raw = p.encode(_response())
    body = json.loads(raw)
    vllm033.check_keys(body)
    theirs = vllm033.RESPONSE.decode(raw)
    assert theirs.output_mode == "derender"
    assert theirs.choices[0].message.tool_calls[0].function.name == "f"
    assert theirs.choices[0].message.reasoning == "think"
    assert p.decode_generate_response(raw) == _response()
    assert p.decode_generate_derender_response(raw) == _response()


def test_derender_response_without_calls_leaves_the_key_out() -> None:
    response = _response()
    response.choices[0].message = oa.ChatCompletionMessage(content="hi")
    body = json.loads(p.encode(response))
    vllm033.check_keys(body)
    assert "tool_calls" not in body["choices"][0]["message"]


def test_derender_response_error_body_raises_engine_error() -> None:
    with pytest.raises(p.EngineError, match="no"):
        p.decode_generate_derender_response(b'{"error": {"message": "no", "type": "BadRequestError", "code": 400}}')
    with pytest.raises(p.ProtocolError):
        p.decode_generate_derender_response(b'{"output_mode": "derender", "choices": [{"index": 0}]}')
