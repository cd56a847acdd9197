"""The gateway and a sim engine started from tokenizer folders holding families' real
vocabularies (issue #27), the `openai` SDK as the client, on every route, streamed and not.

DeepSeek's real `tokenizer.json` made both fail at start (a raw marker string in
`model.vocab`); `--reasoning-parser mistral` on Tekken v3 (no `[THINK]`) failed every
request; and an output cut inside a character ended in U+FFFD. gpt-oss's o200k_harmony
runs here too. The sim writes the family's text (script mode) with the folder's
tokenizer, so the ids are the real ones.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from openai import Omit, omit
from openai.types.chat import ChatCompletionMessageParam
import pytest
from tokenizers import Tokenizer

from derender.parsers import harmony
from derender.parsers.base import ToolCallText
from tests.support.engine import engine_server
from tests.support.gateway import gateway_server
from tests.support.real_vocabularies import deepseek_dir, o200k_harmony_dir, tekken_v3_dir
from tests.support.tools import WEATHER_TOOLS
from tests.support.typed import function_calls, openai_tools

ROUTES = ["derender", "text", "tokens"]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Zürich?"}]
ARGUMENTS = {"city": "Zürich 世界 🫠", "days": 2}


@dataclass(frozen=True)
class Case:
    folder: Callable[[], Path]
    reasoning: str
    tool: str
    output: str
    reasoning_text: str | None
    content: str | None
    template_kwargs: dict[str, Any] | None = None


CASES = {
    "deepseek": Case(
        deepseek_dir,
        "deepseek_r1",
        "deepseek_v3",
        "<think>\nIt asks 天气 🧬.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        f"```json\n{json.dumps(ARGUMENTS, ensure_ascii=False)}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "\nIt asks 天气 🧬.\n",
        None,
        {"bare_turn": True},  # R1's template: the model opens `<think>` itself
    ),
    "gpt-oss": Case(
        o200k_harmony_dir,
        "openai_gptoss",
        "openai",
        harmony.format_reasoning("It asks 天气 🧬.") + harmony.format_calls([ToolCallText("get_weather", ARGUMENTS)]),
        "It asks 天气 🧬.",
        None,
    ),
    # Tekken v3 has no `[THINK]`: the mistral reasoning parser serves it without reasoning.
    "mistral-tekken-v3": Case(
        tekken_v3_dir,
        "mistral",
        "mistral",
        "Checking Zürich 🧬."
        + "[TOOL_CALLS]"
        + json.dumps([{"name": "get_weather", "arguments": ARGUMENTS}], ensure_ascii=False),
        None,
        "Checking Zürich 🧬.",
    ),
}


@dataclass
class Served:
    case: Case
    client: openai.AsyncOpenAI
    tokenizer: Tokenizer


@pytest.fixture(params=list(CASES))
async def served(request: Any) -> AsyncIterator[Served]:
    case = CASES[request.param]
    folder = case.folder()
    parsers = {"reasoning_parser": case.reasoning, "tool_parser": case.tool}
    options = {"mode": "script", "script": [case.output]}
    async with (
        engine_server(folder, backend_options=options, **parsers) as (engine_url, _),
        gateway_server(folder, engine_url, **parsers) as (base_url, _),
    ):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        try:
            yield Served(case, client, Tokenizer.from_file(str(folder / "tokenizer.json")))
        finally:
            await client.close()


TOOLS = openai_tools(WEATHER_TOOLS)


async def _answer(served: Served, route: str, *, stream: bool, max_tokens: int | Omit = omit) -> dict[str, Any]:
    create = served.client.chat.completions.create
    headers = {"onehop-route": route}
    template = {"chat_template_kwargs": served.case.template_kwargs} if served.case.template_kwargs else None
    if not stream:
        completion = await create(
            model="sim", messages=MESSAGES, tools=TOOLS, max_tokens=max_tokens, extra_headers=headers, extra_body=template
        )
        message = completion.choices[0].message
        return {
            "reasoning": getattr(message, "reasoning", None),
            "content": message.content,
            "calls": [(c.function.name, c.function.arguments) for c in function_calls(message.tool_calls)],
            "finish": completion.choices[0].finish_reason,
        }
    chunks = await create(
        model="sim", messages=MESSAGES, tools=TOOLS, stream=True, max_tokens=max_tokens, extra_headers=headers, extra_body=template
    )
    reasoning, content, finish = "", "", None
    calls: dict[int, list[str]] = {}
    async for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, ["", ""])
                slot[0] += (call.function.name or "") if call.function else ""
                slot[1] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [tuple(calls[i]) for i in sorted(calls)],
        "finish": finish,
    }


async def test_family_served_on_its_real_vocabulary(served: Served) -> None:
    for route in ROUTES:
        for stream in (False, True):
            answer = await _answer(served, route, stream=stream)
            assert (answer["reasoning"], answer["content"]) == (served.case.reasoning_text, served.case.content), route
            calls = [(name, json.loads(arguments)) for name, arguments in answer["calls"]]
            assert calls == [("get_weather", ARGUMENTS)], route
            assert answer["finish"] == "tool_calls"


async def test_max_tokens_inside_a_character_ends_cleanly(served: Served) -> None:
    """Cuts inside a character of the output (its first, in reasoning or content; one in the
    middle; its last, in the arguments): no U+FFFD, and no space left at the end by a
    character that did not complete, on every route, streamed and not."""
    ids = served.tokenizer.encode(served.case.output, add_special_tokens=False).ids
    cuts = [k for k in range(1, len(ids)) if served.tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert len(cuts) >= 3, "the output must hold characters split over tokens"
    for cut in sorted({cuts[0], cuts[len(cuts) // 2], cuts[-1]}):
        for route in ROUTES:
            for stream in (False, True):
                answer = await _answer(served, route, stream=stream, max_tokens=cut)
                assert answer["finish"] == "length"
                texts = [answer["reasoning"], answer["content"], *(arguments for _, arguments in answer["calls"])]
                assert all("\ufffd" not in (text or "") for text in texts), (cut, route, answer)
                assert all(not (text or "x").endswith(" ") for text in texts), (cut, route, answer)
