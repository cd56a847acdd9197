"""Structured outputs on the hf backend: a real (tiny, random) model whose decoding llguidance
constrains, behind `onehop serve`'s embedded gateway, with the `openai` SDK as the client.

A random model writes whatever the grammar lets it, so the schemas bound their strings and
numbers (`max_length`, `le`): the answer must then be a valid instance, every time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import openai
import pytest
from pydantic import BaseModel, Field

from engine.config import EngineConfig
from onehop.serve import embedded
from tests.support.engine import engine_server, post_json

# Each test loads the tiny model with torch: kept out of the default suite, run by CI's
# `-m slow` stage.
pytestmark = pytest.mark.slow

Short = Annotated[str, Field(max_length=12)]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


class Address(BaseModel):
    city: Short
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=150)
    role: Literal["admin", "user"]
    tags: list[Short] = Field(max_length=3)
    home: Address
    nickname: Short | None


async def test_serve_answers_parse_and_vllms_kinds_from_a_random_model(tiny_model_dir: Path) -> None:
    engine = EngineConfig(backend="hf", model=str(tiny_model_dir), backend_options={"threads": 1})
    async with (
        embedded(engine, host="127.0.0.1", port=0, route="derender") as running,
        openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client,
    ):
        model = (await client.models.list()).data[0].id
        for route in ("derender", "text", "tokens"):
            answer = await client.chat.completions.parse(
                model=model, messages=[{"role": "user", "content": "Who?"}], response_format=Person, max_tokens=400,
                extra_headers={"onehop-route": route},
                extra_body={**NO_THINKING, "structured_outputs": {"disable_any_whitespace": True}},
            )
            assert isinstance(answer.choices[0].message.parsed, Person), (route, answer.choices[0].message.content)
        kinds: list[tuple[dict[str, Any], str]] = [
            ({"choice": ["yes", "no"]}, r"yes|no"),
            ({"regex": "[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
            ({"grammar": 'start: "ab" | "cd"'}, r"ab|cd"),
            ({"json_object": True}, r"\{.*"),  # a random model's keys are unbounded: a JSON object's prefix
        ]
        for constraint, pattern in kinds:
            constrained = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}], max_tokens=60,
                extra_body={**NO_THINKING, "structured_outputs": {**constraint, "disable_any_whitespace": True}},
            )
            content = constrained.choices[0].message.content or ""
            assert re.fullmatch(pattern, content, re.S), (constraint, content)
        try:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}], extra_body={"structured_outputs": {"regex": "(a"}}
            )
            raise AssertionError("an invalid regex was accepted")
        except openai.BadRequestError as exc:
            assert "structured_outputs.regex" in exc.message


async def test_the_constraint_holds_after_reasoning_ends(qwen3_tokenizer: Any, tiny_model_dir: Path) -> None:
    """A prompt that leaves thinking open: the first token is free (a bias makes it `</think>`),
    and the grammar holds from the token after it. Without that gate the grammar would have
    refused `</think>` as the first token."""
    end = qwen3_tokenizer.convert_tokens_to_ids("</think>")
    prompt = list(qwen3_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, enable_thinking=True
    )["input_ids"])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    sampling = {"max_tokens": 40, "seed": 3, "logit_bias": {str(end): 100.0},
                "structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    async with (
        engine_server(tiny_model_dir, backend="hf", backend_options={"threads": 1}) as (base, _),
        aiohttp.ClientSession() as session,
    ):
        status, answer, _ = await post_json(session, base + "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sampling})
    assert status == 200, answer
    ids = answer["choices"][0]["token_ids"]
    assert ids[0] == end, ids
    text = qwen3_tokenizer.decode(ids[1:], skip_special_tokens=True)
    assert 0 <= json.loads(text)["n"] <= 9, (ids, text)


PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit a file.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch\\n" ("+" | "-") /[a-z]{1,6}/ "\\n*** End Patch"'},
}
PATCHED = r"\*\*\* Begin Patch\n[+-][a-z]{1,6}\n\*\*\* End Patch"


async def test_a_forced_custom_tools_grammar_holds_on_an_engine_that_enforces_it(tiny_model_dir: Path) -> None:
    """A random model forced to call a custom tool writes an input its Lark grammar takes, on
    every route, streamed and not: the gateway decodes the turn as text under the grammar."""
    engine = EngineConfig(backend="hf", model=str(tiny_model_dir), backend_options={"threads": 1})
    asked: dict[str, Any] = {
        "input": "Patch it.", "tools": [PATCH_TOOL], "tool_choice": {"type": "custom", "name": "apply_patch"},
        "reasoning": {"effort": "none"}, "max_output_tokens": 60,
    }
    async with (
        embedded(engine, host="127.0.0.1", port=0, route="derender") as running,
        openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client,
    ):
        model = (await client.models.list()).data[0].id
        for route in ("derender", "text", "tokens"):
            headers = {"onehop-route": route}
            answer = await client.responses.create(model=model, extra_headers=headers, **asked)
            call = answer.output[-1]
            assert answer.status == "completed" and call.type == "custom_tool_call", (route, answer.output)
            assert call.name == "apply_patch" and re.fullmatch(PATCHED, call.input), (route, call.input)
            events = [event async for event in await client.responses.create(model=model, stream=True, extra_headers=headers, **asked)]
            streamed = "".join(event.delta for event in events if event.type == "response.custom_tool_call_input.delta")
            final = events[-1].response.output[-1]
            assert final.type == "custom_tool_call" and streamed == final.input and re.fullmatch(PATCHED, streamed), (route, streamed)
