"""gateway/upstream/vllm_derender.py: which vLLM has the form, parse_context as vLLM's /render fills it, the answer."""

from __future__ import annotations

import json

import msgspec
import pytest

from wire import openai_schema as oa
from wire import protocol as p
from gateway.upstream import vllm_derender as vd
from gateway.edge.errors import EngineFailed
from gateway.routing.policy import RequestFeatures
from tests.support import vllm033

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("version", "serves"),
    [("0.33.0", True), ("0.33.1.dev12+gabc", True), ("0.34.0rc1", True), ("1.0.0", True), ("0.32.0", False), ("dev", False), ("", False)],
)
def test_which_vllm_has_the_form(version: str, serves: bool) -> None:
    assert vd.serves_derender(version) is serves


def test_only_non_streaming_chat_without_a_forced_tool() -> None:
    assert vd.serves(RequestFeatures(endpoint="chat"))
    assert not vd.serves(RequestFeatures(endpoint="chat", stream=True))
    assert not vd.serves(RequestFeatures(endpoint="completions"))
    assert not vd.serves(RequestFeatures(endpoint="chat", forced_tool=True))


def _chat(**fields: object) -> oa.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=oa.ChatCompletionRequest)


def test_parse_context_as_vllms_render_fills_it() -> None:
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 2},
        {"role": "tool", "tool_call_id": "a", "content": "ok"},
    ]
    request = _chat(messages=history, tools=[TOOL], chat_template_kwargs={"enable_thinking": False}, parallel_tool_calls=False)
    context = vd.parse_context(request)
    theirs = vllm033.PARSE_CONTEXT.decode(p.encode(context))  # what vLLM's model reads
    assert theirs.tool_choice == "auto"  # tools without a tool_choice: vLLM's default
    assert theirs.parallel_tool_calls is False and theirs.history_tool_call_cnt == 2
    assert theirs.chat_template_kwargs == {"enable_thinking": False, "add_generation_prompt": True, "continue_final_message": False}
    assert vd.parse_context(_chat()).tool_choice == "none"


def _raw(**message: object) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop", "token_ids": [1, 2]}
    return json.dumps({"request_id": "generate-tokens-x", "output_mode": "derender", "choices": [choice],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}).encode()


@pytest.mark.parametrize(
    ("field", "expected"),
    [("reasoning", {"reasoning": "why"}), ("reasoning_content", {"reasoning_content": "why"}), ("both", {"reasoning": "why", "reasoning_content": "why"})],
)
def test_answer_as_the_clients_chat_completion(field: str, expected: dict[str, str]) -> None:
    completion = vd.chat_completion(
        _raw(content="hi", reasoning="why", tool_calls=[]),
        response_id="chatcmpl-1", model="alias", created=9, reasoning_field=field, return_token_ids=False,  # type: ignore[arg-type]
    )
    raw = msgspec.json.encode(completion)
    oa.CHAT_COMPLETION_DECODER.decode(raw)
    body = json.loads(raw)
    assert (body["id"], body["model"], body["created"], body["object"]) == ("chatcmpl-1", "alias", 9, "chat.completion")
    message = body["choices"][0]["message"]
    assert {k: message[k] for k in ("reasoning", "reasoning_content") if k in message} == expected
    assert "tool_calls" not in message and body["choices"][0]["token_ids"] is None
    assert body["usage"]["total_tokens"] == 7


def test_broken_answers_are_the_engines_failure() -> None:
    with pytest.raises(EngineFailed, match="invalid derender answer"):
        vd.chat_completion(b'{"choices": "no"}', response_id="c", model="m", created=1, reasoning_field="reasoning", return_token_ids=False)
    with pytest.raises(EngineFailed, match="boom"):
        vd.chat_completion(b'{"error": {"message": "boom", "type": "x", "code": 500}}', response_id="c", model="m", created=1,
                           reasoning_field="reasoning", return_token_ids=False)
