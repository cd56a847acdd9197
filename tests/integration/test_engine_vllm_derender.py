"""A onehop engine answering vLLM 0.33's derender form (`parse_context` in, `GenerateDerenderResponse` out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from tests.integration.test_engine_server import GENERATE, TOOLS, chat_request, generate_body, render
from tests.support import vllm033
from tests.support.engine import engine_server, post_json


def parse_context(*, thinking: bool = True, **extra: Any) -> dict[str, Any]:
    """What vLLM 0.33's /render fills for the test chat (tools offered, tool_choice auto)."""
    kwargs = {"add_generation_prompt": True, "continue_final_message": False, "enable_thinking": thinking}
    return {"tools": TOOLS, "tool_choice": "auto", "chat_template_kwargs": kwargs, **extra}


def vllm_body(prompt: list[int], context: dict[str, Any] | None, **sampling: Any) -> dict[str, Any]:
    body = generate_body(prompt, "derender", stream=False, **sampling)
    if context is not None:
        body["parse_context"] = context
    return body


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession() as client:
        yield client


async def _answer(session: Any, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], vllm033.GenerateDerenderResponse]:
    async with session.post(url, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    vllm033.check_keys(json.loads(raw))
    return json.loads(raw), vllm033.RESPONSE.decode(raw)


async def test_reasoning_and_a_tool_call_in_vllms_shape(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer)
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        _, answer = await _answer(session, base + GENERATE, vllm_body(prompt, parse_context(), logprobs=1))
        # The same generation in onehop's own form, for the parse to agree with.
        onehop_body = generate_body(prompt, "derender", stream=False, logprobs=1)
        onehop_body["chat_request"] = chat_request(False, logprobs=True, top_logprobs=1)
        status, completion, _ = await post_json(session, base + GENERATE, onehop_body)
    assert status == 200
    (choice,) = answer.choices
    message = choice.message
    assert answer.output_mode == "derender" and answer.model == "sim"
    assert message.role == "assistant" and message.reasoning
    assert [call.function.name for call in message.tool_calls] == ["get_weather"]
    assert set(json.loads(message.tool_calls[0].function.arguments)) >= {"city", "days"}
    assert choice.finish_reason == "tool_calls"
    theirs = completion["choices"][0]
    assert message.reasoning == theirs["message"]["reasoning"]
    assert message.content == theirs["message"]["content"]
    assert [c.function.arguments for c in message.tool_calls] == [c["function"]["arguments"] for c in theirs["message"]["tool_calls"]]
    assert choice.token_ids is not None and len(choice.token_ids) == answer.usage.completion_tokens  # type: ignore[union-attr]
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == len(choice.token_ids)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)


async def test_parse_context_drives_the_parse(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer)
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        _, no_tools = await _answer(session, base + GENERATE, vllm_body(prompt, parse_context(tool_choice="none")))
        _, hidden = await _answer(session, base + GENERATE, vllm_body(prompt, parse_context(include_reasoning=False), logprobs=1))
        _, bare = await _answer(session, base + GENERATE, vllm_body(prompt, {}))
    # tool_choice "none": the call stays text in the content, no calls, a plain stop.
    assert not no_tools.choices[0].message.tool_calls and "<tool_call>" in (no_tools.choices[0].message.content or "")
    assert no_tools.choices[0].finish_reason == "stop"
    # include_reasoning false: no reasoning, and no per-token data that would reveal it (as vLLM).
    assert hidden.choices[0].message.reasoning is None and hidden.choices[0].message.tool_calls
    assert hidden.choices[0].token_ids is None and hidden.choices[0].logprobs is None
    # An empty parse_context is vLLM's defaults: no tools, tool_choice none.
    assert not bare.choices[0].message.tool_calls and bare.choices[0].message.reasoning


async def test_thinking_off_leaves_reasoning_empty(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any) -> None:
    prompt = render(qwen3_tokenizer, thinking=False)
    options = {"mode": "script", "script": ["Just the answer."]}
    async with engine_server(qwen3_tokenizer_dir, backend_options=options) as (base, _):
        _, answer = await _answer(session, base + GENERATE, vllm_body(prompt, parse_context(thinking=False)))
    assert answer.choices[0].message.reasoning is None
    assert answer.choices[0].message.content == "Just the answer."


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stream": True}, "does not support stream=true"),
        ({"parse_context": None}, "requires parse_context on a server with a tool or reasoning parser"),
        ({"parse_context": {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}}, "does not match any"),
        ({"parse_context": {"tool_choice": "required", "tools": TOOLS}}, "'required' or a named tool"),
        ({"parse_context": {"future_field": 1}}, "future_field"),
    ],
)
async def test_what_vllms_form_refuses(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: Any, change: dict[str, Any], message: str
) -> None:
    body = {**vllm_body(render(qwen3_tokenizer), parse_context()), **change}
    if body.get("parse_context") is None:
        body.pop("parse_context")
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        status, error, _ = await post_json(session, base + GENERATE, body)
    assert status == 400, error
    assert message in error["error"]["message"]


async def test_capabilities_name_the_derender_forms(qwen3_tokenizer_dir: Path, session: Any) -> None:
    async with (
        engine_server(qwen3_tokenizer_dir) as (base, _),
        session.get(base + "/inference/v1/capabilities") as resp,
    ):
        caps = await resp.json()
    assert caps["derender_forms"] == ["onehop", "vllm"]
