"""The simulator backend, with the real Qwen3 tokenizer and onehop's own derender as the judge."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import replace
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.backends.base import Backend, BackendError, BackendOutput, BackendRequest, BackendRequestError
from engine.backends.sim import SimBackend, SimBackendConfig, SimConfigError
from derender.chat import ChatDerender, ChatOptions
from derender.vocab import TokenVocab
from wire.openai_schema import ChatCompletion
from wire.protocol import SamplingParams
from engine.qwen3.fixtures import cache_dir
from engine.qwen3.vocab import ENDOFTEXT_ID, IM_END_ID, IM_START_ID
from tests.support.families import FAMILIES, family
from tests.support.family_tokenizers import build_family_tokenizer

Make = Callable[..., SimBackend]
Batches = list[list[BackendOutput]]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "detail": {
                    "type": "object",
                    "properties": {
                        "hourly": {"type": "boolean"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["hourly", "tags"],
                },
                "note": {"type": ["string", "null"]},
            },
            "required": ["city", "days", "unit", "detail"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "number", "maximum": 5}},
            "required": ["query", "limit"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
REQUIRED = {"get_weather": {"city", "days", "unit", "detail"}, "search": {"query", "limit"}}
HELLO = [{"role": "user", "content": "What is the weather in Paris?"}]
IDLE_TIMEOUT_S = 2.0


@pytest.fixture
def make(qwen3_tokenizer_dir: Path) -> Make:
    def build(**config: Any) -> SimBackend:
        return SimBackend(SimBackendConfig(tokenizer=str(qwen3_tokenizer_dir), **config))

    return build


@pytest.fixture(scope="module")
def sim(qwen3_tokenizer_dir: Path) -> SimBackend:
    """A default auto-mode backend, shared where the config does not matter."""
    return SimBackend(SimBackendConfig(tokenizer=str(qwen3_tokenizer_dir)))


@pytest.fixture(scope="module")
def slow(qwen3_tokenizer_dir: Path) -> SimBackend:
    """Ten seconds between steps: a stream that is still running whenever a test looks."""
    return SimBackend(SimBackendConfig(tokenizer=str(qwen3_tokenizer_dir), itl_ms=10_000))


@pytest.fixture
def render(qwen3_tokenizer: Any) -> Callable[..., list[int]]:
    def chat(messages: list[dict[str, Any]], *, tools: list[Any] | None = None, thinking: bool = True) -> list[int]:
        return list(
            qwen3_tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, enable_thinking=thinking
            )["input_ids"]
        )

    return chat


def request(prompt: Sequence[int], request_id: str = "r", **sampling: Any) -> BackendRequest:
    sampling.setdefault("max_tokens", None)
    return BackendRequest(request_id=request_id, prompt_token_ids=prompt, sampling=SamplingParams(**sampling))


async def collect(backend: SimBackend, req: BackendRequest) -> Batches:
    return [batch async for batch in backend.generate(req)]


def ids_of(batches: Batches, index: int = 0) -> list[int]:
    return [t for batch in batches for out in batch if out.index == index for t in out.token_ids]


def last_of(batches: Batches, index: int = 0) -> BackendOutput:
    return [out for batch in batches for out in batch if out.index == index][-1]


def derendered(vocab: TokenVocab, prompt: list[int], batches: Batches, *, thinking: bool = True) -> ChatCompletion:
    options = ChatOptions(
        reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=True, enable_thinking=thinking
    )
    derender = ChatDerender(vocab, options, model="sim", prompt_token_ids=prompt)
    for batch in batches:
        for out in batch:
            derender.step(
                out.index, out.token_ids, out.logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason
            )
    assert derender.finished
    return derender.response()


async def wait_idle(backend: SimBackend) -> None:
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        while backend.running():
            await asyncio.sleep(0.005)


# -- config and info ------------------------------------------------------------


def test_info_comes_from_the_tokenizer_folder(sim: SimBackend, qwen3_tokenizer: Any) -> None:
    assert isinstance(sim, Backend)
    info = sim.info
    assert (info.name, info.model, info.max_model_len) == ("sim", "sim", 32768)
    assert info.vocab_size == len(qwen3_tokenizer) == 151_669
    assert info.eos_token_ids == {IM_END_ID, ENDOFTEXT_ID}


def test_config_decodes_with_defaults() -> None:
    config = msgspec.json.decode(b'{"tokenizer": "t", "itl_ms": 5}', type=SimBackendConfig)
    assert (config.itl_ms, config.ttft_ms, config.mode, config.output_tokens) == (5, 0, "auto", None)
    with pytest.raises(SimConfigError):
        SimBackendConfig(tokenizer="t", tokens_per_step=0)


@pytest.mark.parametrize(
    "extra",
    ['"itl": 5', '"itl_ms": -1', '"mode": "script"', '"mode": "agent"'],
    ids=["unknown", "negative", "no-script", "no-agent-calls"],
)
def test_config_is_strict(extra: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(f'{{"tokenizer": "t", {extra}}}', type=SimBackendConfig)


def test_missing_tokenizer_folder(tmp_path: Path) -> None:
    with pytest.raises(SimConfigError):
        SimBackend(SimBackendConfig(tokenizer=str(tmp_path)))


# -- determinism ----------------------------------------------------------------


async def test_same_request_same_ids_and_seeds_change_them(make: Make, sim: SimBackend, render: Any) -> None:
    prompt = render(HELLO)
    first = ids_of(await collect(sim, request(prompt)))
    assert first == ids_of(await collect(sim, request(prompt)))
    assert first == ids_of(await collect(make(), request(prompt)))
    assert first != ids_of(await collect(sim, request(prompt, seed=7)))
    assert first != ids_of(await collect(make(seed=1), request(prompt)))
    assert first != ids_of(await collect(sim, request(render([{"role": "user", "content": "Other"}]))))


# -- auto mode ------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
async def test_auto_tool_call_parses(sim: SimBackend, render: Any, qwen3_vocab: TokenVocab, seed: int) -> None:
    prompt = render(HELLO, tools=TOOLS)
    batches = await collect(sim, request(prompt, seed=seed))
    assert (last_of(batches).finish_reason, ids_of(batches)[-1]) == ("stop", IM_END_ID)
    choice = derendered(qwen3_vocab, prompt, batches).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning  # thinking was left open
    assert choice.message.tool_calls is not msgspec.UNSET
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict)
    assert REQUIRED[call.function.name] <= arguments.keys()
    if call.function.name == "get_weather":
        assert 1 <= arguments["days"] <= 7 and arguments["unit"] == "celsius"
        assert isinstance(arguments["detail"]["hourly"], bool) and arguments["detail"]["tags"]


async def test_auto_calls_every_offered_tool_over_seeds(sim: SimBackend, render: Any, qwen3_tokenizer: Any) -> None:
    prompt = render(HELLO, tools=TOOLS, thinking=False)
    names = set()
    for seed in range(12):
        text = qwen3_tokenizer.decode(ids_of(await collect(sim, request(prompt, seed=seed))))
        names.add(json.loads(text.split("<tool_call>\n")[1].split("\n</tool_call>")[0])["name"])
    assert names == set(REQUIRED)


async def test_auto_thinks_only_when_the_prompt_allows(sim: SimBackend, render: Any, qwen3_vocab: TokenVocab) -> None:
    open_prompt = render(HELLO)
    thought = derendered(qwen3_vocab, open_prompt, await collect(sim, request(open_prompt))).choices[0]
    assert thought.message.reasoning and thought.message.content
    assert thought.finish_reason == "stop"
    closed = render(HELLO, thinking=False)
    plain = derendered(qwen3_vocab, closed, await collect(sim, request(closed)), thinking=False).choices[0]
    assert plain.message.reasoning is None and plain.message.content


async def test_reasoning_off_writes_an_empty_think_block(make: Make, render: Any, qwen3_vocab: TokenVocab) -> None:
    prompt = render(HELLO)
    choice = derendered(qwen3_vocab, prompt, await collect(make(reasoning=False), request(prompt))).choices[0]
    assert not (choice.message.reasoning or "").strip() and choice.message.content


async def test_auto_content_has_multibyte_words_and_exact_length(make: Make, qwen3_tokenizer: Any) -> None:
    prompt = qwen3_tokenizer.encode("Once upon a time")
    backend = make(output_tokens=300)
    ids = ids_of(await collect(backend, request(prompt)))
    assert len(ids) == 301 and ids[-1] == IM_END_ID
    text = qwen3_tokenizer.decode(ids[:-1])
    assert "\ufffd" not in text and "<think>" not in text
    assert any(ord(ch) > 0x7F for ch in text)


# -- echo and script ------------------------------------------------------------


async def test_echo_repeats_the_last_user_turn(make: Make, render: Any, qwen3_tokenizer: Any) -> None:
    backend = make(mode="echo")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "Second 世界 🫠\nline two"},
    ]
    ids = ids_of(await collect(backend, request(render(messages))))
    assert ids[-1] == IM_END_ID
    assert qwen3_tokenizer.decode(ids[:-1]) == "Second 世界 🫠\nline two"
    plain = qwen3_tokenizer.encode("not a chat prompt 𓀀")
    assert qwen3_tokenizer.decode(ids_of(await collect(backend, request(plain)))[:-1]) == "not a chat prompt 𓀀"


async def test_script_cycles_and_its_markers_parse(
    make: Make, render: Any, qwen3_vocab: TokenVocab, qwen3_tokenizer: Any
) -> None:
    thought = "<think>\nhmm\n</think>\n\nDone."
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 1}}\n</tool_call>'
    backend = make(mode="script", script=[thought, call])
    prompt = render(HELLO, tools=TOOLS)
    texts = [qwen3_tokenizer.decode(ids_of(await collect(backend, request(prompt)))) for _ in range(3)]
    assert texts == [thought + "<|im_end|>", call + "<|im_end|>", thought + "<|im_end|>"]
    choice = derendered(qwen3_vocab, prompt, await collect(backend, request(prompt))).choices[0]
    assert choice.message.tool_calls is not msgspec.UNSET
    assert choice.message.tool_calls[0].function.name == "search"


# -- agent mode -----------------------------------------------------------------

AGENT_CALLS: dict[str, dict[str, Any]] = {"exec_command": {"cmd": "echo hi"}, "search": {"query": "onehop", "limit": 3}, "get_weather": {}}
CALLED = [
    *HELLO,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "onehop", "limit": 3}}}],
    },
    {"role": "tool", "content": "onehop-agent-OK\n"},
]


async def test_agent_calls_the_first_configured_tool_offered(
    make: Make, render: Any, qwen3_vocab: TokenVocab
) -> None:
    backend = make(mode="agent", agent_calls=AGENT_CALLS)
    prompt = render(HELLO, tools=TOOLS)  # get_weather comes first in the prompt, search first in agent_calls
    choice = derendered(qwen3_vocab, prompt, await collect(backend, request(prompt))).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning  # thinking was left open
    assert choice.message.tool_calls is not msgspec.UNSET
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("search", AGENT_CALLS["search"])


async def test_agent_answers_tool_results_with_their_text(make: Make, render: Any, qwen3_vocab: TokenVocab) -> None:
    backend = make(mode="agent", agent_calls=AGENT_CALLS)
    prompt = render(CALLED, tools=TOOLS)
    choice = derendered(qwen3_vocab, prompt, await collect(backend, request(prompt))).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.reasoning
    assert choice.message.content is not None
    assert choice.message.content.strip() == "The command printed: onehop-agent-OK"  # after the blank line that closes </think>
    closed = render(CALLED, tools=TOOLS, thinking=False)
    plain = derendered(qwen3_vocab, closed, await collect(backend, request(closed)), thinking=False).choices[0]
    assert plain.message.reasoning is None and plain.message.content == "The command printed: onehop-agent-OK"


async def test_agent_without_a_configured_tool_writes_content(
    make: Make, render: Any, qwen3_vocab: TokenVocab
) -> None:
    backend = make(mode="agent", agent_calls={"exec_command": {"cmd": "echo hi"}})
    for tools in (TOOLS, None):
        prompt = render(HELLO, tools=tools)
        choice = derendered(qwen3_vocab, prompt, await collect(backend, request(prompt))).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content and not choice.message.content.startswith("The command printed")


@pytest.mark.parametrize("results", [True, False], ids=["answer", "call"])
async def test_agent_on_gpt_oss_answers_on_the_final_channel(qwen3_tokenizer_dir: Path, results: bool) -> None:
    """Harmony content is a `final` message: plain text after the analysis would be dropped."""
    harmony = family("openai", qwen3_tokenizer_dir)
    folder = build_family_tokenizer(cache_dir(), "e2e-openai", list(FAMILIES["openai"][1]))
    backend = SimBackend(
        SimBackendConfig(
            tokenizer=str(folder),
            mode="agent",
            agent_calls=AGENT_CALLS,
            tool_format="openai",
            reasoning_format="openai_gptoss",
        )
    )
    messages = CALLED if results else HELLO
    rendered = harmony.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    prompt = list(rendered["input_ids"])
    derender = ChatDerender(harmony.vocab, harmony.options(TOOLS), model="sim", prompt_token_ids=prompt)
    for batch in await collect(backend, request(prompt)):
        for out in batch:
            derender.step(
                out.index, out.token_ids, out.logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason
            )
    message = derender.response().choices[0].message
    assert message.reasoning
    if results:
        assert message.content == "The command printed: onehop-agent-OK" and not message.tool_calls
    else:
        assert message.tool_calls is not msgspec.UNSET
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("search", AGENT_CALLS["search"])


async def test_agent_writes_calls_in_the_tool_format(make: Make, render: Any, qwen3_tokenizer: Any) -> None:
    backend = make(mode="agent", agent_calls=AGENT_CALLS, tool_format="qwen3_coder")
    text = qwen3_tokenizer.decode(ids_of(await collect(backend, request(render(HELLO, tools=TOOLS, thinking=False)))))
    assert "<function=search>" in text and "<parameter=query>\nonehop\n</parameter>" in text


# -- token rules ----------------------------------------------------------------


async def test_max_tokens_cuts_with_length(sim: SimBackend, render: Any) -> None:
    batches = await collect(sim, request(render(HELLO), max_tokens=5))
    assert len(ids_of(batches)) == 5 and IM_END_ID not in ids_of(batches)
    assert last_of(batches).finish_reason == "length" and last_of(batches).stop_reason is None


async def test_default_max_tokens_is_sixteen(sim: SimBackend, render: Any) -> None:
    req = BackendRequest(request_id="d", prompt_token_ids=render(HELLO), sampling=SamplingParams())
    assert len(ids_of(await collect(sim, req))) == 16


async def test_eos_is_the_last_token(sim: SimBackend, render: Any) -> None:
    batches = await collect(sim, request(render(HELLO)))
    ids = ids_of(batches)
    assert ids[-1] == IM_END_ID and ids.count(IM_END_ID) == 1
    assert (last_of(batches).finish_reason, last_of(batches).stop_reason) == ("stop", None)


async def test_max_model_len_caps_the_output(make: Make, qwen3_tokenizer: Any) -> None:
    prompt = qwen3_tokenizer.encode("a b c d")
    batches = await collect(make(max_model_len=len(prompt) + 3, output_tokens=50), request(prompt))
    assert len(ids_of(batches)) == 3 and last_of(batches).finish_reason == "length"


async def test_ignore_eos_runs_to_max_tokens(sim: SimBackend, render: Any) -> None:
    batches = await collect(sim, request(render(HELLO), max_tokens=300, ignore_eos=True))
    ids = ids_of(batches)
    assert len(ids) == 300 and IM_END_ID not in ids and ENDOFTEXT_ID not in ids
    assert last_of(batches).finish_reason == "length"


async def test_min_tokens_pads_before_eos(make: Make, qwen3_tokenizer: Any) -> None:
    backend = make(output_tokens=3)
    prompt = qwen3_tokenizer.encode("Say three")
    assert len(ids_of(await collect(backend, request(prompt)))) == 4
    batches = await collect(backend, request(prompt, min_tokens=10))
    ids = ids_of(batches)
    assert len(ids) == 11 and ids[-1] == IM_END_ID and last_of(batches).finish_reason == "stop"


async def test_stop_token_ids(make: Make, qwen3_tokenizer: Any) -> None:
    backend = make(mode="script", script=["alpha beta gamma delta"])
    beta = qwen3_tokenizer.encode(" beta")[-1]
    prompt = qwen3_tokenizer.encode("go")
    batches = await collect(backend, request(prompt, stop_token_ids=[beta]))
    assert ids_of(batches)[-1] == beta
    assert (last_of(batches).finish_reason, last_of(batches).stop_reason) == ("stop", beta)
    assert qwen3_tokenizer.decode(ids_of(batches)) == "alpha beta"
    # Below min_tokens the stop id is masked, as vLLM masks it.
    masked = ids_of(await collect(backend, request(prompt, stop_token_ids=[beta], min_tokens=2)))
    assert beta not in masked and masked[-1] == IM_END_ID


async def test_n_choices_are_distinct_and_stable(sim: SimBackend, render: Any) -> None:
    prompt = render(HELLO)
    batches = await collect(sim, request(prompt, n=2))
    assert {out.index for batch in batches for out in batch} == {0, 1}
    assert all(last_of(batches, i).finish_reason == "stop" for i in (0, 1))
    assert ids_of(batches, 0) != ids_of(batches, 1)
    assert ids_of(batches, 0) == ids_of(await collect(sim, request(prompt)))  # each choice derives from its index
    assert ids_of(batches, 1) == ids_of(await collect(sim, request(prompt, n=2)), 1)


@pytest.mark.parametrize(("k", "width"), [(0, 1), (3, 4), (-1, 21)])
async def test_logprobs_shape(sim: SimBackend, render: Any, k: int, width: int) -> None:
    batches = await collect(sim, request(render(HELLO), logprobs=k))
    entries = [e for batch in batches for out in batch for e in out.logprobs or ()]
    assert [e.token_id for e in entries] == ids_of(batches)
    for entry in entries:
        top = entry.top_logprobs
        assert len(top) == width and (entry.rank, top[0].token_id, top[0].rank) == (1, entry.token_id, 1)
        assert [c.rank for c in top] == list(range(1, width + 1))
        assert all(a.logprob > b.logprob for a, b in itertools.pairwise(top)) and top[0].logprob < 0
        assert len({c.token_id for c in top}) == width
    assert ids_of(await collect(sim, request(render(HELLO)))) == ids_of(batches)  # logprobs change no ids


async def test_bad_requests_fail_before_output(make: Make) -> None:
    backend = make(max_model_len=8)
    for prompt in ([], [1] * 8, [IM_START_ID, 151_669], [-1]):  # empty, too long, past the vocab, negative
        with pytest.raises(BackendRequestError):
            await collect(backend, request(prompt))
    assert not backend.running()


async def test_too_many_logprobs_and_duplicate_ids_are_refused(slow: SimBackend, qwen3_tokenizer: Any) -> None:
    backend = slow
    prompt = qwen3_tokenizer.encode("hi")
    with pytest.raises(BackendRequestError):
        await collect(backend, request(prompt, logprobs=21))
    stream = backend.generate(request(prompt, "dup"))
    await anext(stream)
    with pytest.raises(BackendRequestError):
        await collect(backend, request(prompt, "dup"))
    await stream.aclose()


# -- cancellation ---------------------------------------------------------------


async def test_abort_wakes_a_waiting_stream(slow: SimBackend, render: Any) -> None:
    backend = slow
    seen: Batches = []

    async def consume() -> None:
        async for batch in backend.generate(request(render(HELLO), "a")):
            seen.append(batch)

    task = asyncio.create_task(consume())
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        while not seen:
            await asyncio.sleep(0.005)
    assert backend.running() == {"a"}
    await backend.abort("a")
    assert not backend.running()
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        await task
    assert [out.finish_reason for out in seen[-1]] == ["abort"] and len(seen) == 2
    await backend.abort("unknown")  # a no-op


async def test_aclose_ends_the_request(slow: SimBackend, render: Any) -> None:
    backend = slow
    stream = backend.generate(request(render(HELLO), "c"))
    await anext(stream)
    assert backend.running() == {"c"}
    await stream.aclose()
    await wait_idle(backend)


async def test_cancelled_consumer_ends_the_request(slow: SimBackend, render: Any) -> None:
    backend = slow

    async def consume() -> None:
        async for _ in backend.generate(request(render(HELLO), "x")):
            pass

    task = asyncio.create_task(consume())
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        while not backend.running():
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(backend)


async def test_close_aborts_everything(make: Make, render: Any) -> None:
    backend = make(itl_ms=10_000)
    streams = [backend.generate(request(render(HELLO), f"s{i}")) for i in range(3)]
    for stream in streams:
        await anext(stream)
    assert backend.running() == {"s0", "s1", "s2"}
    await backend.close()
    assert not backend.running()
    async with asyncio.timeout(IDLE_TIMEOUT_S):  # held streams must not sleep out their 10 s step
        for stream in streams:
            assert [out.finish_reason for batch in [b async for b in stream] for out in batch] == ["abort"]
    with pytest.raises(BackendError):
        await collect(backend, request(render(HELLO)))


# -- timing ---------------------------------------------------------------------


async def test_ttft_and_itl_sleep(make: Make, render: Any) -> None:
    loop = asyncio.get_running_loop()
    backend = make(ttft_ms=50, itl_ms=20)
    started = loop.time()
    arrivals = [loop.time() - started async for _ in backend.generate(request(render(HELLO), max_tokens=10))]
    assert len(arrivals) == 10
    slack = 0.002  # loop timers may fire up to one clock tick early
    assert arrivals[0] >= 0.050 - slack
    assert arrivals[-1] >= 0.050 + 9 * 0.020 - slack


async def test_a_remote_decode_skips_a_busy_prefill_lane(make: Make, render: Any) -> None:
    """A decode's KV arrives from the prefill engine: it does not queue behind local prefills."""
    prompt = render(HELLO)
    prefiller = make()
    prefill = replace(request(prompt, "p", max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    [handover] = [out.kv_transfer_params for batch in await collect(prefiller, prefill) for out in batch]
    assert handover is not None
    backend = make(prefill_us_per_token=1_000_000)  # a second a token: the lane stays busy
    busy = backend.generate(request(prompt, "busy"))
    first = asyncio.ensure_future(anext(busy))
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        while "busy" not in backend.running():
            await asyncio.sleep(0.005)
        batches = await collect(backend, replace(request(prompt, "d", max_tokens=3), kv_transfer_params=handover))
        assert len(ids_of(batches)) == 3 and backend.remote_decodes == 1
        await backend.close()
        assert [out.finish_reason for out in await first] == ["abort"]
    await busy.aclose()


async def test_close_aborts_prefills_queued_in_the_lane(make: Make, render: Any) -> None:
    backend = make(prefill_us_per_token=1_000_000)
    streams = [backend.generate(request(render(HELLO), f"q{i}")) for i in range(3)]
    firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        while len(backend.running()) < 3:
            await asyncio.sleep(0.005)
    await backend.close()
    async with asyncio.timeout(IDLE_TIMEOUT_S):  # none may sleep out its prefill
        assert [[out.finish_reason for out in await first] for first in firsts] == [["abort"]] * 3
    for stream in streams:
        await stream.aclose()


async def test_tokens_per_step_groups_tokens(make: Make, render: Any) -> None:
    batches = await collect(make(tokens_per_step=4), request(render(HELLO), max_tokens=10, n=2))
    assert [[len(out.token_ids) for out in batch] for batch in batches] == [[4, 4], [4, 4], [2, 2]]
