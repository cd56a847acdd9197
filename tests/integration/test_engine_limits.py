"""The engine bounds every count a generate request carries (issue 14, item 4).

The engine is reachable directly, not only behind the gateway, so each count is
checked by the engine itself: over its limit is a 400 in the engine's error shape
naming the field and the limit, at its limit is served. A larger `max_tokens` than
the context leaves is capped, as vLLM 0.32's generate API does, not refused.
"""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import pytest_asyncio

from engine.config import ConfigError, EngineConfig, EngineLimits, engine_limits
from tests.support.engine import engine_server

GENERATE = "/inference/v1/generate"
MAX_MODEL_LEN = 64
"""Small, so the capped max_tokens cases generate a few dozen tokens at most."""
DEFAULTS = EngineLimits()


@dataclass(frozen=True)
class Ctx:
    vocab: int
    room: int
    """Tokens the prompt leaves of the context."""


Sampling = Callable[[Ctx], dict[str, Any]]


@dataclass(frozen=True)
class Bound:
    field: str
    over: Sampling
    at: Sampling
    """Sampling params at the limit: served (200)."""


def _ids(count: int) -> list[int]:
    return [7] * count


BOUNDS: dict[str, Bound] = {
    "n": Bound("n", lambda c: {"n": DEFAULTS.max_num_seqs + 1}, lambda c: {"n": DEFAULTS.max_num_seqs}),
    "n=10**9": Bound("n", lambda c: {"n": 10**9}, lambda c: {"n": DEFAULTS.max_num_seqs}),
    "logprobs": Bound("logprobs", lambda c: {"logprobs": 21}, lambda c: {"logprobs": 20}),
    "logprobs=-1": Bound("logprobs", lambda c: {"logprobs": -1}, lambda c: {"logprobs": 0}),
    "prompt_logprobs": Bound("prompt_logprobs", lambda c: {"prompt_logprobs": 21}, lambda c: {"prompt_logprobs": 20}),
    "prompt_logprobs=-1": Bound("prompt_logprobs", lambda c: {"prompt_logprobs": -1}, lambda c: {"prompt_logprobs": 0}),
    "logprob_token_ids": Bound(
        "logprob_token_ids",
        lambda c: {"logprob_token_ids": _ids(DEFAULTS.max_logprob_token_ids + 1)},
        lambda c: {"logprob_token_ids": _ids(DEFAULTS.max_logprob_token_ids)},
    ),
    "logprob_token_ids vocab": Bound(
        "logprob_token_ids", lambda c: {"logprob_token_ids": [c.vocab]}, lambda c: {"logprob_token_ids": [c.vocab - 1]}
    ),
    "prompt_logprob_token_ids width": Bound(
        "prompt_logprob_token_ids",
        lambda c: {"prompt_logprob_token_ids": [_ids(21)]},
        lambda c: {"prompt_logprob_token_ids": [_ids(20)]},
    ),
    "prompt_logprob_token_ids rows": Bound(
        "prompt_logprob_token_ids",
        lambda c: {"prompt_logprob_token_ids": [[1]] * MAX_MODEL_LEN},
        lambda c: {"prompt_logprob_token_ids": [[1]] * (MAX_MODEL_LEN - 1)},
    ),
    "prompt_logprob_token_ids vocab": Bound(
        "prompt_logprob_token_ids",
        lambda c: {"prompt_logprob_token_ids": [[-2]]},
        lambda c: {"prompt_logprob_token_ids": [[-1, c.vocab - 1]]},  # -1 pads a row
    ),
    "max_tokens 2**64": Bound("max_tokens", lambda c: {"max_tokens": 2**64}, lambda c: {"max_tokens": 2**64 - 1}),
    "max_tokens 10**30": Bound("max_tokens", lambda c: {"max_tokens": 10**30}, lambda c: {"max_tokens": 2**63}),
    "min_tokens": Bound(
        "min_tokens",  # with max_tokens unset (null), min_tokens must fit the room left, as in vLLM
        lambda c: {"max_tokens": None, "min_tokens": c.room + 1},
        lambda c: {"max_tokens": None, "min_tokens": c.room, "ignore_eos": True},
    ),
    "seed": Bound("seed", lambda c: {"seed": 2**64}, lambda c: {"seed": 2**64 - 1}),
    "thinking_token_budget": Bound(
        "thinking_token_budget", lambda c: {"thinking_token_budget": -(2**63) - 1}, lambda c: {"thinking_token_budget": 2**63}
    ),
    "stop count": Bound(
        "stop",
        lambda c: {"stop": [f"s{i}" for i in range(DEFAULTS.max_stop + 1)]},
        lambda c: {"stop": [f"s{i}" for i in range(DEFAULTS.max_stop)]},
    ),
    "stop huge": Bound("stop", lambda c: {"stop": ["x"] * 100_000}, lambda c: {"stop": "x"}),
    "stop length": Bound(
        "stop", lambda c: {"stop": "x" * (DEFAULTS.max_string_chars + 1)}, lambda c: {"stop": ["x" * DEFAULTS.max_string_chars]}
    ),
    "bad_words count": Bound(
        "bad_words",
        lambda c: {"bad_words": [f"w{i}" for i in range(DEFAULTS.max_bad_words + 1)]},
        lambda c: {"bad_words": [f"w{i}" for i in range(DEFAULTS.max_bad_words)]},
    ),
    "bad_words length": Bound(
        "bad_words",
        lambda c: {"bad_words": ["w" * (DEFAULTS.max_string_chars + 1)]},
        lambda c: {"bad_words": ["w" * DEFAULTS.max_string_chars]},
    ),
    "stop_token_ids count": Bound(
        "stop_token_ids", lambda c: {"stop_token_ids": _ids(c.vocab + 1)}, lambda c: {"stop_token_ids": _ids(c.vocab)}
    ),
    "stop_token_ids vocab": Bound(
        "stop_token_ids", lambda c: {"stop_token_ids": [1, c.vocab]}, lambda c: {"stop_token_ids": [0, c.vocab - 1]}
    ),
    "stop_token_ids negative": Bound("stop_token_ids", lambda c: {"stop_token_ids": [-1]}, lambda c: {"stop_token_ids": [0]}),
    "logit_bias huge": Bound(
        "logit_bias",
        lambda c: {"logit_bias": {str(i): 0.5 for i in range(c.vocab + 1)}},
        lambda c: {"logit_bias": {str(i): 0.5 for i in range(c.vocab)}},
    ),
    "logit_bias vocab": Bound(
        "logit_bias", lambda c: {"logit_bias": {str(c.vocab): 1.0}}, lambda c: {"logit_bias": {str(c.vocab - 1): 1.0}}
    ),
    "logit_bias negative": Bound("logit_bias", lambda c: {"logit_bias": {"-1": 1.0}}, lambda c: {"logit_bias": {"0": 1.0}}),
    "allowed_token_ids vocab": Bound(
        "allowed_token_ids", lambda c: {"allowed_token_ids": [c.vocab]}, lambda c: {"allowed_token_ids": list(range(c.vocab))}
    ),
    "allowed_token_ids negative": Bound(
        "allowed_token_ids", lambda c: {"allowed_token_ids": [5, -3]}, lambda c: {"allowed_token_ids": [5, 0]}
    ),
    "allowed_token_ids empty": Bound(
        "allowed_token_ids", lambda c: {"allowed_token_ids": []}, lambda c: {"allowed_token_ids": [5]}
    ),
    "allowed_token_ids count": Bound(
        "allowed_token_ids", lambda c: {"allowed_token_ids": _ids(c.vocab + 1)}, lambda c: {"allowed_token_ids": _ids(c.vocab)}
    ),
    "trace_decode_token_ids vocab": Bound(
        "trace_decode_token_ids",
        lambda c: {"trace_decode_token_ids": [c.vocab]},
        lambda c: {"trace_decode_token_ids": [c.vocab - 1]},
    ),
}


def _prompt(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode("Count to ten, slowly.", add_special_tokens=False))


def _body(prompt: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
    return {"token_ids": prompt, "sampling_params": {"max_tokens": 2, **sampling}}


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    # A file-like body: aiohttp warns about multi-megabyte bytes (the huge lists here).
    data = io.BytesIO(msgspec.json.encode(body))
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json()


def _assert_refused(status: int, body: Any, field: str) -> None:
    assert status == 400, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, field)
    assert field in error["message"]
    assert any(ch.isdigit() for ch in error["message"]), error["message"]  # the limit is stated


@dataclass(frozen=True)
class Served:
    base: str
    state: Any
    session: aiohttp.ClientSession
    prompt: list[int]

    @property
    def ctx(self) -> Ctx:
        info = self.state.backend.info
        return Ctx(vocab=info.vocab_size, room=info.max_model_len - len(self.prompt))

    async def post(self, body: Any) -> tuple[int, Any]:
        return await post_json(self.session, self.base + GENERATE, body)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> Any:
    """One engine (default limits, a 64-token context) for the module: starting one costs ~1 s."""
    options = {"max_model_len": MAX_MODEL_LEN}
    async with engine_server(qwen3_tokenizer_dir, backend_options=options) as (base, state), aiohttp.ClientSession() as session:
        yield Served(base, state, session, _prompt(qwen3_tokenizer))


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("bound", BOUNDS.values(), ids=BOUNDS.keys())
async def test_each_count_is_bounded(bound: Bound, served: Served) -> None:
    status, body = await served.post(_body(served.prompt, bound.over(served.ctx)))
    _assert_refused(status, body, bound.field)
    assert not served.state.running and not served.state.backend.running()
    status, body = await served.post(_body(served.prompt, bound.at(served.ctx)))
    assert status == 200, body
    assert body["choices"]


@pytest.mark.asyncio(loop_scope="module")
async def test_n_of_a_billion_is_refused_without_allocating(served: Served) -> None:
    """The OOM of issue 14: per-choice state was built for n before anything checked it."""
    body = {**_body(served.prompt, {"n": 10**9, "logprobs": 5}), "stream": True}
    tracemalloc.start()
    try:
        status, answer = await served.post(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _assert_refused(status, answer, "n")
    assert f"at most {DEFAULTS.max_num_seqs}" in answer["error"]["message"]
    assert peak < 8 * 1024 * 1024  # a list per choice would be gigabytes


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("max_tokens", [MAX_MODEL_LEN, 2**63 - 1, 2**63, 2**64 - 1])
async def test_max_tokens_past_the_context_is_capped_as_vllm_does(max_tokens: int, served: Served) -> None:
    """vLLM 0.32's generate API keeps such a max_tokens and ends the sequence at max_model_len."""
    sampling = {"max_tokens": max_tokens, "min_tokens": max_tokens, "n": 2}
    status, body = await served.post(_body(served.prompt, sampling))
    assert status == 200, body
    room = served.ctx.room
    assert [len(c["token_ids"]) for c in body["choices"]] == [room, room]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}


@pytest.mark.asyncio(loop_scope="module")
async def test_a_prompt_that_fills_the_context_is_refused(served: Served) -> None:
    status, body = await served.post(_body([1] * MAX_MODEL_LEN, {}))
    _assert_refused(status, body, "token_ids")
    assert "max_model_len" in body["error"]["message"]
    status, body = await served.post(_body([1] * (MAX_MODEL_LEN - 1), {"max_tokens": 5}))
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 1, body


def _nested(depth: int) -> str:
    """JSON text of an object nested `depth` levels deep (written out: encoders recurse)."""
    return '{"a":' * depth + "1" + "}" * depth


_CHAT = '{"model": "sim", "messages": [{"role": "user", "content": "hi"}], %s}'
_DEEP_PLACES = {
    "chat_template_kwargs": ("chat_request.chat_template_kwargs", _CHAT % '"chat_template_kwargs": {"x": %s}'),
    "tool parameters": (
        "chat_request.tools[0].function.parameters",
        _CHAT % '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]',
    ),
    "extra_args": ("sampling_params.extra_args", None),
}


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("depth", [65, 985, 5000])
@pytest.mark.parametrize("place", _DEEP_PLACES, ids=_DEEP_PLACES.keys())
async def test_deeply_nested_json_is_a_400(place: str, depth: int, served: Served) -> None:
    """Issue 14 item 7 at the engine: 985 levels were a RecursionError and a 500."""
    field, chat = _DEEP_PLACES[place]
    deep = _nested(depth)
    ids = msgspec.json.encode(served.prompt).decode()
    if chat is None:
        body = f'{{"token_ids": {ids}, "sampling_params": {{"max_tokens": 2, "extra_args": {{"x": {deep}}}}}}}'
    else:
        body = f'{{"token_ids": {ids}, "sampling_params": {{"max_tokens": 2}}, "output_mode": "derender", "chat_request": {chat % deep}}}'
    status, answer = await served.post(msgspec.Raw(body.encode()))
    assert status == 400, answer
    message = answer["error"]["message"]
    assert (field in message and "64 levels" in message) if depth == 65 else "nested too deeply" in message, message
    shallow = body.replace(deep, _nested(8))
    status, answer = await served.post(msgspec.Raw(shallow.encode()))
    assert status == 200, answer


async def test_configured_limits_apply(qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path) -> None:
    """max_logprobs=-1 allows the whole vocabulary, as vLLM's flag does; lower limits refuse sooner."""
    prompt = _prompt(qwen3_tokenizer)
    limits = engine_limits(max_num_seqs=2, max_logprobs=-1, max_stop=1, max_string_chars=3)
    async with engine_server(qwen3_tokenizer_dir, limits=limits) as (base, _), aiohttp.ClientSession() as session:
        refused: list[tuple[dict[str, Any], str]] = [({"n": 3}, "n"), ({"stop": ["a", "b"]}, "stop"), ({"bad_words": ["abcd"]}, "bad_words")]
        for sampling, field in refused:
            status, body = await post_json(session, base + GENERATE, _body(prompt, sampling))
            _assert_refused(status, body, field)
        status, body = await post_json(session, base + GENERATE, _body(prompt, {"n": 2, "logprobs": -1, "stop": "abc"}))
    assert status == 200, body
    assert len(body["choices"]) == 2 and body["choices"][0]["logprobs"]["content"]


def test_limits_are_one_strict_struct() -> None:
    assert EngineConfig(model="m").limits == DEFAULTS
    assert (DEFAULTS.max_num_seqs, DEFAULTS.max_logprobs) == (256, 20)
    for bad in ({"max_num_seqs": 0}, {"max_logprobs": -2}, {"max_num_seq": 3}):
        with pytest.raises(ConfigError, match=r"max_num_seq|max_logprobs"):
            engine_limits(**bad)
    decoded = msgspec.json.decode(b'{"model": "m", "limits": {"max_stop": 4}}', type=EngineConfig)
    assert decoded.limits == EngineLimits(max_stop=4)
    with pytest.raises(msgspec.ValidationError, match="max_stops"):
        msgspec.json.decode(b'{"model": "m", "limits": {"max_stops": 4}}', type=EngineConfig)


def test_cli_flags_reach_the_engine_config(
    qwen3_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from onehop.cli import main

    seen: list[EngineConfig] = []
    monkeypatch.setattr("engine.app.run", seen.append)
    base = ["engine", "--backend", "sim", "--model", str(qwen3_tokenizer_dir), "--port", "0"]
    assert main(base) == 0
    assert main([*base, "--max-num-seqs", "8", "--max-logprobs", "-1"]) == 0
    assert [config.limits for config in seen] == [DEFAULTS, EngineLimits(max_num_seqs=8, max_logprobs=-1)]
    assert main([*base, "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert len(seen) == 2
