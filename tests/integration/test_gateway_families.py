"""Each parser family end to end: a sim engine writing the family's format, a separate
gateway parsing it, the `openai` SDK as the client, on every route, streamed and not."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam
import pytest

from derender.parsers import TOOL_PARSERS
from engine.qwen3.fixtures import cache_dir
from tests.support import glm_tokenizer, harmony_tokenizer, kimi_k2, llama3, minimax_m2, mistral
from tests.support.engine import engine_server
from tests.support.family_tokenizers import build_family_tokenizer
from tests.support.gateway import gateway_server
from tests.support.typed import function_calls

ROUTES = ["derender", "text", "tokens"]
TYPED_TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a table.",
            "parameters": {
                "type": "object",
                "properties": {
                    "restaurant": {"type": "string"},
                    "guests": {"type": "integer", "minimum": 1, "maximum": 12},
                    "budget": {"type": "number"},
                    "terrace": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["restaurant", "guests", "budget", "terrace", "tags"],
            },
        },
    }
]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "A table for four, please."}]
SCHEMA_TYPES: dict[str, type | tuple[type, ...]] = {"restaurant": str, "guests": int, "budget": (int, float), "terrace": bool, "tags": list}

# tool parser -> (reasoning parser or None, the family's marker tokens added to the Qwen3 tokenizer).
# The chat template stays Qwen3's, so the sim reads the prompt the same way for every family;
# only the output format changes, which is what the parsers see.
FAMILIES: dict[str, tuple[str | None, tuple[tuple[str, bool], ...]]] = {
    "hermes": ("qwen3", ()),
    "qwen3_coder": ("qwen3", ()),
    "glm47": ("glm45", glm_tokenizer.ADDED),
    "kimi_k2": ("kimi_k2", tuple((text, True) for text in kimi_k2.SPECIALS)),
    "openai": ("openai_gptoss", tuple((text, True) for text in harmony_tokenizer.MARKERS)),
    "minimax_m2": ("minimax_m2", minimax_m2.ADDED),
    "mistral": ("mistral", tuple((text, True) for text in mistral.SPECIALS)),
    # Llama's formats have no reasoning of their own.
    "llama3_json": (None, tuple((text, True) for text in llama3.SPECIALS)),
    "pythonic": (None, ()),
}


def _tokenizer_dir(tool_parser: str, qwen3_tokenizer_dir: Path) -> Path:
    added = FAMILIES[tool_parser][1]
    if not added:
        return qwen3_tokenizer_dir
    return build_family_tokenizer(cache_dir(), f"e2e-{tool_parser}", list(added))


@pytest.fixture(params=list(FAMILIES))
async def family_client(request: Any, qwen3_tokenizer_dir: Path) -> AsyncIterator[tuple[str, openai.AsyncOpenAI]]:
    tool_parser = request.param
    reasoning_parser = FAMILIES[tool_parser][0]
    if tool_parser not in TOOL_PARSERS:
        pytest.fail(f"tool parser {tool_parser} is not registered")
    folder = _tokenizer_dir(tool_parser, qwen3_tokenizer_dir)
    parsers = {"tool_parser": tool_parser, "reasoning_parser": reasoning_parser}
    async with engine_server(folder, backend_options={"seed": 11}, **parsers) as (engine_url, engine_state):
        assert engine_state.backend._config.tool_format == tool_parser  # type: ignore[attr-defined]
        async with gateway_server(folder, engine_url, **parsers) as (base_url, _):
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
            try:
                yield tool_parser, client
            finally:
                await client.close()


async def _full(client: openai.AsyncOpenAI, route: str) -> dict[str, Any]:
    completion = await client.chat.completions.create(
        model="sim", messages=MESSAGES, tools=TYPED_TOOLS, seed=4, extra_headers={"onehop-route": route}
    )
    message = completion.choices[0].message
    return {
        "content": message.content,
        "reasoning": getattr(message, "reasoning", None),
        "calls": [(c.function.name, json.loads(c.function.arguments)) for c in function_calls(message.tool_calls)],
        "finish": completion.choices[0].finish_reason,
    }


async def _streamed(client: openai.AsyncOpenAI, route: str) -> dict[str, Any]:
    stream = await client.chat.completions.create(
        model="sim", messages=MESSAGES, tools=TYPED_TOOLS, seed=4, stream=True, extra_headers={"onehop-route": route}
    )
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    headers: dict[int, int] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function and call.function.name:
                    slot["name"] = call.function.name
                    headers[call.index] = headers.get(call.index, 0) + 1
                slot["arguments"] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    assert all(count == 1 for count in headers.values()), headers
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
        "finish": finish,
    }


async def test_same_tool_calls_on_every_route_streamed_and_not(family_client: tuple[str, openai.AsyncOpenAI]) -> None:
    family, client = family_client
    answers = {}
    for route in ROUTES:
        answers[f"{route} full"] = await _full(client, route)
        answers[f"{route} stream"] = await _streamed(client, route)
    reference = answers["derender full"]
    for name, answer in answers.items():
        assert answer == reference, f"{family}: {name} differs from derender full"
    assert reference["finish"] == "tool_calls"
    assert bool(reference["reasoning"]) == (FAMILIES[family][0] is not None)
    assert reference["content"] is None
    [(name, arguments)] = reference["calls"]
    assert name == "book_table"
    for key, kind in SCHEMA_TYPES.items():
        assert isinstance(arguments[key], kind), f"{family}: {key}={arguments[key]!r} is not {kind}"
    assert not isinstance(arguments["guests"], bool)
