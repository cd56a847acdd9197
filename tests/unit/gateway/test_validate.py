"""The gateway's refusals of request fields it does not honour and of requests over its limits.

Requests are decoded from JSON bodies, as a client sends them; each refusal is
checked for its status, the field it names (`param`), the code where OpenAI's
clients look for one, and the error body clients read.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from wire.openai_schema import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest
from gateway.config import Limits
from gateway.edge.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest, error_json
from gateway.edge.validate import (
    MAX_METADATA_PAIRS,
    check_buffered_answer,
    check_chat,
    check_chat_limits,
    check_completion,
    check_completion_limits,
    check_context,
    check_metadata,
    check_text_size,
    check_token_ids,
    prompt_count,
)

USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": USER, **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    body = {"model": "m", "prompt": "Hi", **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)


def refused(check: Any, *args: Any, **kwargs: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        check(*args, **kwargs)
    error = caught.value
    assert error.status == 400 and error.type == "invalid_request_error"
    body = msgspec.json.decode(error_json(error))["error"]
    assert body["param"] == error.param and body["message"] == error.message
    return error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"echo": True}, "echo"),
        ({"chat_template": "{{ x }}"}, "chat_template"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_chat_refuses_by_field(fields: dict[str, Any], param: str) -> None:
    error = refused(check_chat, chat(**fields))
    assert error.param == param and error.message


def test_chat_accepts_what_it_honours() -> None:
    check_chat(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    check_chat(chat(n=16, logprobs=True, top_logprobs=20, modalities=["text"], metadata={"k": "v"}))


def test_chat_refuses_json_nested_too_deep() -> None:
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = {"a": deep}
    error = refused(check_chat, chat(tools=TOOLS, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}))
    assert str(MAX_JSON_DEPTH) in error.message and error.param


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"), ({"use_beam_search": True}, "use_beam_search"), ({"logprobs": 21}, "top_logprobs")],
)
def test_completion_refuses_by_field(fields: dict[str, Any], param: str) -> None:
    assert refused(check_completion, completion(**fields)).param == param


def test_metadata_bounds_in_openai_words() -> None:
    check_metadata(None)
    check_metadata({f"k{i}": "v" for i in range(MAX_METADATA_PAIRS)})
    many = refused(check_metadata, {f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)})
    assert many.param == "metadata" and "too many properties" in many.message
    assert "key too long" in refused(check_metadata, {"k" * 65: "v"}).message
    long_value = refused(check_metadata, {"note": "v" * 513})
    assert long_value.message.startswith("Invalid 'metadata.note': string too long")


def test_chat_limits() -> None:
    limits = Limits(max_n=2, max_tokens=100, max_messages=2)
    check_chat_limits(chat(n=2, max_tokens=100), limits)
    assert refused(check_chat_limits, chat(n=3), limits).param == "n"
    assert refused(check_chat_limits, chat(max_tokens=101), limits).param == "max_tokens"
    assert refused(check_chat_limits, chat(max_completion_tokens=101), limits).param == "max_completion_tokens"
    assert refused(check_chat_limits, chat(messages=USER * 3), limits).param == "messages"


def test_completion_limits_count_prompts() -> None:
    assert prompt_count(completion(prompt="one")) == 1
    assert prompt_count(completion(prompt=[1, 2, 3])) == 1
    assert prompt_count(completion(prompt=["a", "b"])) == 2
    limits = Limits(max_prompts=1)
    check_completion_limits(completion(prompt=[1, 2]), limits)
    assert refused(check_completion_limits, completion(prompt=["a", "b"]), limits).param == "prompt"


def test_buffered_answer_bound() -> None:
    check_buffered_answer(n=2, max_tokens=10, top_logprobs=0, prompts=1, max_model_len=None, most=20)
    check_buffered_answer(n=None, max_tokens=None, top_logprobs=5, prompts=9, max_model_len=None, most=1)
    error = refused(check_buffered_answer, n=2, max_tokens=10, top_logprobs=1, prompts=2, max_model_len=None, most=79)
    assert error.param == "max_tokens" and "= 80 tokens" in error.message and "2 prompts" in error.message
    context = refused(check_buffered_answer, n=1, max_tokens=None, top_logprobs=0, prompts=1, max_model_len=64, most=63)
    assert "not given: the context, 64" in context.message


def test_token_ids_in_vocabulary() -> None:
    check_token_ids({"logit_bias": {0: 1, 9: -1}, "stop_token_ids": [9]}, vocab_size=10)
    for name, ids in (("logit_bias", {10: 1}), ("allowed_token_ids", [-1]), ("stop_token_ids", [3, 10])):
        error = refused(check_token_ids, {name: ids}, vocab_size=10)
        assert error.param == name and "(0..9)" in error.message


def test_context_refusals_carry_openai_code() -> None:
    check_context([[1] * 9], max_model_len=10)
    check_context([[1] * 100], max_model_len=None)
    error = refused(check_context, [[1] * 3, [1] * 10], max_model_len=10)
    assert error.code == CONTEXT_LENGTH_EXCEEDED and error.param == "messages"
    assert error.message.startswith("This model's maximum context length is 10 tokens")
    check_text_size(40, max_model_len=10, max_chars_per_token=4)
    text = refused(check_text_size, 41, max_model_len=10, max_chars_per_token=4)
    assert text.code == CONTEXT_LENGTH_EXCEEDED and "41 characters (more than 40" in text.message
