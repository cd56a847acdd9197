"""Fuzzing the OpenAI endpoints: whatever the body, never a 5xx, and every error in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from onehop.serve import embedded

# A long run (hundreds of generated bodies): kept out of the default suite, run by CI's
# `-m slow` stage.
pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("ONEHOP_FUZZ_EXAMPLES", "120"))

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=20)
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A value of the right kind, possibly out of range (`bodies` adds wrong kinds)."""
    return plausible


text = st.text(max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "assistant", "system", "tool", "bogus"])},
    optional={"content": field(text), "tool_call_id": st.text(max_size=8), "name": st.text(max_size=8)},
)
tool = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f", ""])}, optional={"parameters": json_values})}
)
CHAT_FIELDS = {
    "max_completion_tokens": field(st.integers(-2, 24)),
    "temperature": field(st.floats(-0.5, 2.5, allow_nan=False)),
    "top_p": field(st.floats(-0.1, 1.1, allow_nan=False)),
    "top_k": field(st.integers(-2, 100)),
    "n": field(st.integers(0, 4)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})),
    "stop": field(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5))),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(-1, 25)),
    "tools": field(st.lists(tool, max_size=2)),
    "tool_choice": field(st.sampled_from(["none", "auto", "required"]) | st.just({"type": "function", "function": {"name": "get_weather"}})),
    "parallel_tool_calls": field(st.booleans()),
    "seed": field(st.integers(-(2**64), 2**64)),
    "chat_template_kwargs": field(st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()})),
    "include_reasoning": field(st.booleans()),
    "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(-1, 8)),
    "stop_token_ids": field(st.lists(st.integers(-1, 160_000), max_size=3)),
    "user": field(st.text(max_size=8)),
}
CHAT_BASE = {
    "model": st.sampled_from(["sim"] * 9 + ["other"]),
    "messages": field(st.lists(message, min_size=1, max_size=3)),
    "max_tokens": field(st.integers(-2, 24)),
    "stream": st.booleans(),
}
COMPLETION_FIELDS = {
    "n": field(st.integers(0, 4)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "logprobs": field(st.integers(-1, 25)),
    "echo": field(st.booleans()),
    "stop": field(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5))),
    "temperature": field(st.floats(-0.5, 2.5, allow_nan=False)),
    "seed": field(st.integers(-(2**64), 2**64)),
    "suffix": field(st.text(max_size=5)),
    "ignore_eos": field(st.booleans()),
}
COMPLETION_BASE = {
    "model": st.sampled_from(["sim"] * 9 + ["other"]),
    "prompt": field(
        st.one_of(
            st.text(max_size=30),
            st.lists(st.text(max_size=10), min_size=1, max_size=3),
            st.lists(st.integers(-5, 160_000), max_size=6),
            st.lists(st.lists(st.integers(-5, 160_000), max_size=4), max_size=3),
        )
    ),
    "max_tokens": field(st.integers(-2, 24)),
    "stream": st.booleans(),
}


def bodies(base: dict[str, Any], fields: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Requests with the required fields and a few optional ones; some with one field of the
    wrong kind (or unknown), some missing required fields, some not requests at all."""
    names = sorted({**base, **fields})
    few = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys})
    )
    shaped = st.builds(lambda a, b: {**a, **b}, st.fixed_dictionaries(base), few)
    spoiled = st.builds(
        lambda body, name, value: {**body, name: value}, shaped, st.sampled_from([*names, "max_tokenz"]), json_values
    )
    partial = st.fixed_dictionaries({}, optional={**base, **fields})
    return st.one_of(shaped, shaped, shaped, shaped, spoiled, spoiled, partial, json_values)


def _server_side(error: dict[str, Any]) -> bool:
    """An in-band error that is the server's fault: the gateway's OpenAI `server_error`, or
    an engine's vLLM-shaped one relayed on the derender route (its status as `code`)."""
    code = error.get("code")
    return error.get("type") == "server_error" or (isinstance(code, int) and code >= 500)


def _check_answer(status: int, raw: bytes, stream: bool) -> None:
    assert status < 500, (status, raw[:500])
    if status != 200:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and (error["code"] is None or isinstance(error["code"], str)), error
        return
    if stream:
        events = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]", raw[-300:]
        for event in events[:-1]:
            payload = json.loads(event[6:])
            assert "error" not in payload or not _server_side(payload["error"]), payload
    else:
        assert json.loads(raw)["choices"] is not None


async def _fuzz(tokenizer: Path, path: str, strategy: st.SearchStrategy[Any]) -> None:
    engine = EngineConfig(backend="sim", model=str(tokenizer), served_model_name="sim")
    async with embedded(engine, host="127.0.0.1", port=0, route="derender") as running, aiohttp.ClientSession() as session:
        loop = asyncio.get_running_loop()
        url = running.url + path

        async def post(body: Any, route: str) -> None:
            data = json.dumps(body).encode()
            async with session.post(url, data=data, headers={"Content-Type": "application/json", "onehop-route": route}) as resp:
                raw = await asyncio.wait_for(resp.read(), timeout=30)
                stream = isinstance(body, dict) and body.get("stream") is True and resp.status == 200
                _check_answer(resp.status, raw, stream)

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(body=strategy, route=st.sampled_from(["derender", "text", "tokens"]))
        def run(body: Any, route: str) -> None:
            asyncio.run_coroutine_threadsafe(post(body, route), loop).result(timeout=60)

        await asyncio.to_thread(run)


async def test_chat_bodies_never_get_a_5xx(qwen3_tokenizer_dir: Path) -> None:
    await _fuzz(qwen3_tokenizer_dir, "/v1/chat/completions", bodies(CHAT_BASE, CHAT_FIELDS))


async def test_completion_bodies_never_get_a_5xx(qwen3_tokenizer_dir: Path) -> None:
    await _fuzz(qwen3_tokenizer_dir, "/v1/completions", bodies(COMPLETION_BASE, COMPLETION_FIELDS))
