"""`gateway.upstream.remote` against a stock vLLM 0.32 render + derender service (opt-in: needs vLLM's venv).

One vLLM server (`--enable-scale-out`, qwen3 reasoning + hermes tool parsers,
the tiny Qwen3 model) serves render, `/inference/v1/generate` and derender
for the whole module. What is checked:

- render parity: vLLM's `/v1/chat/completions/render` gives the token ids of
  the model folder's chat template (`apply_chat_template`), which is onehop's
  local render; `/v1/completions/render` gives the tokenizer's ids per prompt;
- the `tokens-remote` flow (render → generate tokens → one derender POST per
  chunk) assembles the same reasoning, content and tool calls as onehop's
  stateful `ChatDerender` fed the same token ids;
- non-streaming derender, completions, and errors carrying vLLM's status.

vLLM's derender differs from onehop (and from vLLM's own coupled server) in
ways asserted where they show, so a change on either side is noticed:

- chunk ids are the generate stream's request id, `generate-tokens-<render id>`;
- `model` must be a name the vLLM server serves (else 404);
- the EOS token's text (`<|im_end|>`) ends streamed `content` unless a tool
  call swallowed it, and non-streamed `content` when the output has no
  reasoning section;
- non-streaming: `finish_reason` stays `stop` after tool calls and tool-call
  ids are bare hex (streaming: `tool_calls` and `chatcmpl-tool-<hex>`);
- streamed completions number each prompt's choices from 0.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import json
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from derender.chat import ChatDerender, ChatOptions
from derender.completion import CompletionDerender, CompletionOptions
from derender.vocab import vocab_for
from wire.openai_schema import (
    CHAT_COMPLETION_CHUNK_DECODER,
    CHAT_COMPLETION_DECODER,
    CHAT_COMPLETION_REQUEST_DECODER,
    COMPLETION_CHUNK_DECODER,
    COMPLETION_DECODER,
    COMPLETION_REQUEST_DECODER,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Usage,
)
from wire.protocol import (
    GenerateRequest,
    GenerateTokensResponse,
    GenerateTokensStreamResponse,
    decode_generate_response,
    decode_generate_stream_chunk,
)
from gateway.upstream.remote import (
    InvalidChunk,
    RemoteChatDerender,
    RemoteCompletionDerender,
    RemoteServiceError,
    RemoteUnavailable,
    derender_completions,
    render_chat,
    render_completion,
)
from tests.support.ports import free_port
from tests.vllm.conftest import ROOT, server_env, servers, sse_payloads

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 2048
GENERATE = "/inference/v1/generate"
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0
EOS_TEXT = "<|im_end|>"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
# vLLM refuses n > 1 with greedy sampling; a seed makes the sampled choices repeatable.
SEEDED_N2: dict[str, Any] = {"temperature": 0.8, "seed": 1, "n": 2, "max_tokens": 12, "ignore_eos": True}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
WEATHER_TURN = [{"role": "user", "content": "What is the weather in Paris?"}]
RENDER_CASES: dict[str, dict[str, Any]] = {
    "system-multi-turn": {
        "messages": [
            {"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name three colours."},
        ]
    },
    "tools": {"messages": WEATHER_TURN, "tools": TOOLS},
    "tool-result": {
        "messages": [
            *WEATHER_TURN,
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
        ],
        "tools": TOOLS,
    },
    "earlier-reasoning": {
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello!", "reasoning": "A greeting; answer briefly."},
            {"role": "user", "content": "Bye."},
        ]
    },
    "thinking-on": {"messages": WEATHER_TURN, "chat_template_kwargs": {"enable_thinking": True}},
    "thinking-off": {"messages": WEATHER_TURN, "chat_template_kwargs": {"enable_thinking": False}},
}
STREAM_CASES: dict[str, dict[str, Any]] = {
    "thinking-on": {"messages": WEATHER_TURN, **GREEDY},
    "thinking-off": {"messages": WEATHER_TURN, "chat_template_kwargs": {"enable_thinking": False}, **GREEDY},
    "tools": {"messages": WEATHER_TURN, "tools": TOOLS, **GREEDY},
    "seeded-n2": {"messages": WEATHER_TURN, **SEEDED_N2},
}
TOOL_OUTPUT = (
    "<think>\nThe user wants the weather; call the tool.\n</think>\n\n"
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
SCRIPTED_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "reasoning-tool-call": ({"messages": WEATHER_TURN, "tools": TOOLS}, TOOL_OUTPUT),
    "reasoning-content": ({"messages": WEATHER_TURN}, "<think>\nEasy.\n</think>\n\nIt is sunny in Paris."),
    "no-thinking": (
        {"messages": WEATHER_TURN, "chat_template_kwargs": {"enable_thinking": False}},
        "It is sunny in Paris.",
    ),
}
COMPLETION_PROMPTS = ["Hello there, my name is", "The sky over Paris"]


# ------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def vllm_url(vllm_python: Path, tiny_model_dir: Path) -> Iterator[str]:
    """One stock vLLM server for the module (render, generate and derender on one port)."""
    port = free_port()
    argv = ["bash", str(ROOT / "scripts" / "vllm_serve.sh"), str(tiny_model_dir), str(port)]
    spec = ("stock vLLM (scale-out)", [*argv, "--max-model-len", str(MAX_MODEL_LEN)], port)
    with servers([spec], server_env(ONEHOP_VLLM_PYTHON=str(vllm_python))) as (server,):
        yield server.url


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    """The name vLLM serves the tiny model under (its folder)."""
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        yield client


# ------------------------------------------------------------ helpers


def chat_body(model: str, case: dict[str, Any], *, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, **case, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def template_ids(tokenizer: Any, case: dict[str, Any]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        case["messages"],
        tools=case.get("tools"),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **case.get("chat_template_kwargs", {}),
    )
    return list(ids)


def first_difference(tokenizer: Any, ours: Sequence[int], theirs: Sequence[int]) -> str:
    """Where two renders part, as text around the first differing token."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    lo = max(0, at - 8)
    return (
        f"first difference at token {at} (lengths {len(ours)} vs {len(theirs)}):\n"
        f"  template: {tokenizer.decode(list(ours[lo : at + 8]))!r}\n"
        f"  vLLM:     {tokenizer.decode(list(theirs[lo : at + 8]))!r}"
    )


async def generate(session: aiohttp.ClientSession, url: str, body: bytes) -> bytes:
    async with session.post(url + GENERATE, data=body, headers={"Content-Type": "application/json"}) as response:
        data = await response.read()
        assert response.status == 200, data[:500]
        return data


def chat_options(body: bytes) -> ChatOptions:
    request = CHAT_COMPLETION_REQUEST_DECODER.decode(body)
    return ChatOptions.from_request(request, reasoning_parser="qwen3", tool_parser="hermes")


def onehop_chat(vocab: Any, body: bytes, prompt: list[int], model: str, n: int = 1) -> ChatDerender:
    return ChatDerender(vocab, chat_options(body), model=model, n=n, prompt_token_ids=prompt, include_usage=True)


def feed_chunk(derender: ChatDerender | CompletionDerender, payload: bytes) -> list[Any]:
    chunk = decode_generate_stream_chunk(payload, "tokens")
    assert isinstance(chunk, GenerateTokensStreamResponse)
    out = []
    for choice in chunk.choices:
        step = derender.step(
            choice.index, choice.token_ids or [], finish_reason=choice.finish_reason, stop_reason=choice.stop_reason
        )
        if step is not None:
            out.append(step)
    return out


@dataclass
class FoldedChoice:
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)
    finish_reason: str | None = None
    roles: int = 0


def fold_chat(chunks: Sequence[ChatCompletionChunk]) -> tuple[dict[int, FoldedChoice], Usage | None]:
    """Every choice's stream joined: what a client ends up with."""
    folded: dict[int, FoldedChoice] = {}
    usage: Usage | None = None
    for chunk in chunks:
        if isinstance(chunk.usage, Usage):
            usage = chunk.usage
        for choice in chunk.choices:
            acc = folded.setdefault(choice.index, FoldedChoice())
            delta = choice.delta
            acc.roles += delta.role == "assistant"
            acc.reasoning += delta.reasoning if isinstance(delta.reasoning, str) else ""
            acc.content += delta.content if isinstance(delta.content, str) else ""
            for call in delta.tool_calls or []:
                while len(acc.calls) <= call.index:
                    acc.calls.append({"id": "", "name": "", "arguments": ""})
                entry = acc.calls[call.index]
                if isinstance(call.id, str):
                    entry["id"] = call.id
                function = call.function
                if function and isinstance(function.name, str):
                    entry["name"] = function.name
                if function and isinstance(function.arguments, str):
                    entry["arguments"] += function.arguments
            if choice.finish_reason is not None:
                acc.finish_reason = choice.finish_reason
    return folded, usage


def without_ids(choice: FoldedChoice) -> FoldedChoice:
    calls = [{k: v for k, v in call.items() if k != "id"} for call in choice.calls]
    return FoldedChoice(choice.reasoning, choice.content, calls, choice.finish_reason, choice.roles)


def scripted_chunks(token_ids: Sequence[int], request_id: str) -> list[bytes]:
    """One tokens-mode generate chunk per token, the last one finishing with `stop`."""
    last = len(token_ids) - 1
    return [
        msgspec.json.encode(
            {
                "request_id": request_id,
                "output_mode": "tokens",
                "choices": [{"index": 0, "token_ids": [t], "finish_reason": "stop" if i == last else None}],
            }
        )
        for i, t in enumerate(token_ids)
    ]


async def remote_chunks(derender: RemoteChatDerender | RemoteCompletionDerender, payloads: Sequence[bytes]) -> list[bytes]:
    started = time.perf_counter()
    out = [chunk for payload in payloads if (chunk := await derender.chunk(payload)) is not None]
    elapsed_ms = (time.perf_counter() - started) * 1000
    print(
        f"\nremote derender: {derender.posts} POSTs, {derender.bytes_sent} bytes sent, "
        f"{elapsed_ms / max(1, derender.posts):.1f} ms per chunk",
        file=sys.stderr,
    )
    return out


# ------------------------------------------------------------ render


@pytest.mark.parametrize("case", list(RENDER_CASES))
async def test_render_chat_matches_chat_template(
    session: aiohttp.ClientSession, vllm_url: str, model: str, tokenizer: Any, case: str
) -> None:
    rendered = await render_chat(session, vllm_url, chat_body(model, RENDER_CASES[case], stream=False))
    expected = template_ids(tokenizer, RENDER_CASES[case])
    assert rendered.token_ids == expected, first_difference(tokenizer, expected, rendered.token_ids)
    assert rendered.request_id.startswith("chatcmpl-")
    # What vLLM hands the engine decodes under onehop's contract unchanged.
    generate_request = msgspec.json.decode(rendered.generate_request, type=GenerateRequest)
    assert generate_request.token_ids == rendered.token_ids
    assert generate_request.request_id == rendered.request_id
    assert msgspec.json.decode(rendered.sampling_params) == msgspec.json.decode(rendered.generate_request)["sampling_params"]


async def test_render_completion_one_per_prompt(
    session: aiohttp.ClientSession, vllm_url: str, model: str, tokenizer: Any
) -> None:
    body = json.dumps({"model": model, "prompt": COMPLETION_PROMPTS, "max_tokens": 5}).encode()
    rendered = await render_completion(session, vllm_url, body)
    assert [r.token_ids for r in rendered] == [tokenizer.encode(p, add_special_tokens=False) for p in COMPLETION_PROMPTS]
    assert rendered[0].request_id.endswith("-0") and rendered[1].request_id.endswith("-1")
    assert [msgspec.json.decode(r.sampling_params)["max_tokens"] for r in rendered] == [5, 5]


# ------------------------------------------------------------ tokens-remote: streaming chat


@pytest.mark.parametrize("case", list(STREAM_CASES))
async def test_stream_flow_matches_onehop_derender(
    session: aiohttp.ClientSession, vllm_url: str, model: str, tokenizer: Any, case: str
) -> None:
    spec = STREAM_CASES[case]
    body = chat_body(model, spec, stream=True)
    rendered = await render_chat(session, vllm_url, body)
    payloads = sse_payloads(await generate(session, vllm_url, bytes(rendered.generate_request)))

    remote = RemoteChatDerender(session, vllm_url, model=model, chat_request=body, prompt_token_ids=rendered.token_ids)
    theirs = [CHAT_COMPLETION_CHUNK_DECODER.decode(c) for c in await remote_chunks(remote, payloads)]
    n = spec.get("n", 1)
    ours_derender = onehop_chat(vocab_for(tokenizer), body, rendered.token_ids, model, n)
    ours = [chunk for payload in payloads for chunk in feed_chunk(ours_derender, payload)]

    assert remote.posts == len(payloads)
    assert {c.id for c in theirs} == {"generate-tokens-" + rendered.request_id}
    their_choices, their_usage = fold_chat(theirs)
    our_choices, _ = fold_chat([*ours_derender.start(), *ours])
    assert sorted(their_choices) == list(range(n))
    for index in range(n):
        assert their_choices[index].roles == 1
        assert their_choices[index].finish_reason == "length"
        assert their_choices[index].reasoning + their_choices[index].content, "no output to compare"
        assert without_ids(their_choices[index]) == without_ids(our_choices[index])
    assert their_usage is not None
    assert (their_usage.prompt_tokens, their_usage.completion_tokens) == (len(rendered.token_ids), n * spec["max_tokens"])


@pytest.mark.parametrize("case", list(SCRIPTED_CASES))
async def test_stream_scripted_output(
    session: aiohttp.ClientSession, vllm_url: str, model: str, tokenizer: Any, case: str
) -> None:
    """Known output ids (reasoning, a tool call, EOS) through both derenders, one token per chunk."""
    spec, text = SCRIPTED_CASES[case]
    body = chat_body(model, spec, stream=True)
    rendered = await render_chat(session, vllm_url, body)
    token_ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    payloads = scripted_chunks(token_ids, rendered.request_id)

    remote = RemoteChatDerender(session, vllm_url, model=model, chat_request=body, prompt_token_ids=rendered.token_ids)
    theirs = [CHAT_COMPLETION_CHUNK_DECODER.decode(c) for c in await remote_chunks(remote, payloads)]
    ours_derender = onehop_chat(vocab_for(tokenizer), body, rendered.token_ids, model)
    ours = [chunk for payload in payloads for chunk in feed_chunk(ours_derender, payload)]
    their, our = fold_chat(theirs)[0][0], fold_chat([*ours_derender.start(), *ours])[0][0]

    if "<think>" in text:
        # Marker tokens vLLM's parsers swallow come back as no chunk, not as empty deltas.
        assert len(theirs) < len(payloads)
    assert their.reasoning == our.reasoning
    assert [c["name"] for c in their.calls] == [c["name"] for c in our.calls]
    assert [json.loads(c["arguments"]) for c in their.calls] == [json.loads(c["arguments"]) for c in our.calls]
    if our.calls:
        assert their.finish_reason == our.finish_reason == "tool_calls"
        assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]+", c["id"]) for c in their.calls + our.calls)
        assert their.content == our.content
    else:
        assert their.finish_reason == our.finish_reason == "stop"
        assert EOS_TEXT not in our.content
        assert their.content == our.content + EOS_TEXT, "vLLM's EOS leak into streamed content changed"


# ------------------------------------------------------------ tokens-remote: non-streaming chat


async def test_whole_matches_onehop_derender(
    session: aiohttp.ClientSession, vllm_url: str, model: str, tokenizer: Any
) -> None:
    body = chat_body(model, STREAM_CASES["thinking-on"], stream=False)
    rendered = await render_chat(session, vllm_url, body)
    answer = await generate(session, vllm_url, bytes(rendered.generate_request))
    remote = RemoteChatDerender(session, vllm_url, model=model, chat_request=body, prompt_token_ids=rendered.token_ids)
    theirs = CHAT_COMPLETION_DECODER.decode(await remote.whole(answer))
    ours = our_whole_chat(tokenizer, body, rendered.token_ids, model, answer)

    assert theirs.id == "generate-tokens-" + rendered.request_id
    assert_same_message(theirs, ours)
    assert theirs.choices[0].finish_reason == ours.choices[0].finish_reason == "length"
    assert (theirs.usage.prompt_tokens, theirs.usage.completion_tokens) == (len(rendered.token_ids), GREEDY["max_tokens"])


@pytest.mark.parametrize("case", list(SCRIPTED_CASES))
async def test_whole_scripted(
    session: aiohttp.ClientSession, vllm_url: str, model: str, tokenizer: Any, case: str
) -> None:
    spec, text = SCRIPTED_CASES[case]
    body = chat_body(model, spec, stream=False)
    rendered = await render_chat(session, vllm_url, body)
    token_ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    answer = msgspec.json.encode(
        {"request_id": rendered.request_id, "choices": [{"index": 0, "token_ids": token_ids, "finish_reason": "stop"}]}
    )
    remote = RemoteChatDerender(session, vllm_url, model=model, chat_request=body, prompt_token_ids=rendered.token_ids)
    theirs = CHAT_COMPLETION_DECODER.decode(await remote.whole(answer))
    ours = our_whole_chat(tokenizer, body, rendered.token_ids, model, answer)
    their_message, our_message = theirs.choices[0].message, ours.choices[0].message

    assert their_message.reasoning == our_message.reasoning
    if case == "no-thinking":
        # Without a reasoning section, the EOS text stays in non-streamed content too.
        assert their_message.content == (our_message.content or "") + EOS_TEXT
    else:
        assert their_message.content == our_message.content
    their_calls = their_message.tool_calls or []
    our_calls = our_message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in their_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in our_calls
    ]
    if our_calls:
        assert ours.choices[0].finish_reason == "tool_calls"
        assert theirs.choices[0].finish_reason == "stop", "vLLM's non-streaming finish_reason changed"
        assert all(re.fullmatch(r"[0-9a-f]+", c.id) for c in their_calls), "vLLM's tool-call ids changed"
        assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]+", c.id) for c in our_calls)


def our_whole_chat(tokenizer: Any, body: bytes, prompt: list[int], model: str, answer: bytes) -> ChatCompletion:
    response = decode_generate_response(answer, "tokens")
    assert isinstance(response, GenerateTokensResponse)
    derender = onehop_chat(vocab_for(tokenizer), body, prompt, model)
    for choice in response.choices:
        derender.step(choice.index, choice.token_ids or [], finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
    return derender.response()


def assert_same_message(theirs: ChatCompletion, ours: ChatCompletion) -> None:
    their_message, our_message = theirs.choices[0].message, ours.choices[0].message
    assert (their_message.reasoning, their_message.content) == (our_message.reasoning, our_message.content)
    assert bool(their_message.reasoning or their_message.content), "no output to compare"


# ------------------------------------------------------------ completions


async def test_completions_render_and_derender(
    session: aiohttp.ClientSession, vllm_url: str, model: str, tokenizer: Any
) -> None:
    spec = {"model": model, "prompt": COMPLETION_PROMPTS, **GREEDY}
    stream_body = json.dumps({**spec, "stream": True, "stream_options": {"include_usage": True}}).encode()
    whole_body = json.dumps({**spec, "stream": False}).encode()
    vocab = vocab_for(tokenizer)
    options = CompletionOptions.from_request(COMPLETION_REQUEST_DECODER.decode(stream_body))

    streamed: list[str] = []
    for prompt_index, rendered in enumerate(await render_completion(session, vllm_url, stream_body)):
        payloads = sse_payloads(await generate(session, vllm_url, bytes(rendered.generate_request)))
        remote = RemoteCompletionDerender(
            session, vllm_url, model=model, completion_request=stream_body, prompt_token_ids=rendered.token_ids
        )
        theirs = [COMPLETION_CHUNK_DECODER.decode(c) for c in await remote_chunks(remote, payloads)]
        ours = CompletionDerender(vocab, options, model=model, first_index=prompt_index, prompt_token_ids=rendered.token_ids)
        our_chunks = [chunk for payload in payloads for chunk in feed_chunk(ours, payload)]
        # Each prompt's stream numbers its choices from 0; onehop numbers them prompt_index * n + i.
        assert {c.index for chunk in theirs for c in chunk.choices} == {0}
        assert {c.index for chunk in our_chunks for c in chunk.choices} == {prompt_index}
        text = completion_text(theirs)
        assert text and text == completion_text(our_chunks)
        assert theirs[-1].usage is not None and not theirs[-1].choices
        streamed.append(text)

    rendered_whole = await render_completion(session, vllm_url, whole_body)
    answers = [await generate(session, vllm_url, bytes(r.generate_request)) for r in rendered_whole]
    whole = COMPLETION_DECODER.decode(
        await derender_completions(
            session,
            vllm_url,
            model=model,
            completion_request=whole_body,
            prompt_token_ids=[r.token_ids for r in rendered_whole],
            generate_responses=answers,
        )
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == streamed
    assert [c.finish_reason for c in whole.choices] == ["length", "length"]
    assert whole.usage.prompt_tokens == sum(len(r.token_ids) for r in rendered_whole)
    assert whole.usage.completion_tokens == 2 * GREEDY["max_tokens"]

    one = RemoteCompletionDerender(
        session, vllm_url, model=model, completion_request=whole_body, prompt_token_ids=rendered_whole[1].token_ids
    )
    single: Completion = COMPLETION_DECODER.decode(await one.whole(answers[1]))
    assert [c.text for c in single.choices] == [streamed[1]]


def completion_text(chunks: Sequence[CompletionChunk]) -> str:
    return "".join(choice.text for chunk in chunks for choice in chunk.choices)


# ------------------------------------------------------------ errors


async def test_bad_derender_request_raises_with_vllm_status(
    session: aiohttp.ClientSession, vllm_url: str, model: str
) -> None:
    body = chat_body(model, {"messages": WEATHER_TURN}, stream=True)
    rendered = await render_chat(session, vllm_url, body)
    chunk = scripted_chunks([9707], rendered.request_id)[0]

    bad_request = RemoteChatDerender(
        session, vllm_url, model=model, chat_request=b'{"messages": 3}', prompt_token_ids=rendered.token_ids
    )
    with pytest.raises(RemoteServiceError) as bad:
        await bad_request.chunk(chunk)
    assert bad.value.status == 400 and bad.value.message

    unknown_model = RemoteChatDerender(
        session, vllm_url, model="no-such-model", chat_request=body, prompt_token_ids=rendered.token_ids
    )
    with pytest.raises(RemoteServiceError) as missing:
        await unknown_model.chunk(chunk)
    assert missing.value.status == 404 and "no-such-model" in missing.value.message

    with pytest.raises(RemoteServiceError) as empty:
        await render_chat(session, vllm_url, json.dumps({"model": model, "messages": []}).encode())
    assert empty.value.status == 400


async def test_unreachable_and_invalid_chunks(session: aiohttp.ClientSession) -> None:
    with pytest.raises(RemoteUnavailable) as unreachable:
        await render_chat(session, f"http://127.0.0.1:{free_port()}", b'{"messages": []}')
    assert unreachable.value.status == 503

    derender = RemoteChatDerender(session, "http://127.0.0.1:1", model="m", chat_request=b"{}", prompt_token_ids=[1])
    with pytest.raises(InvalidChunk):
        await derender.chunk(b'{"error": {"message": "boom", "type": "x"}}')
    two = b'{"request_id": "r", "choices": [{"index": 0}, {"index": 1}]}'
    with pytest.raises(InvalidChunk):
        await derender.chunk(two)
    assert derender.posts == 0


# ------------------------------------------------------------ the gateway in front of a stock vLLM


@asynccontextmanager
async def _gateway(vllm_url: str, model: str, tiny_model_dir: Path, render: str) -> AsyncIterator[Any]:
    import openai
    from aiohttp.test_utils import TestServer

    from gateway.serving.app import create_app
    from gateway.config import EngineEndpoint, GatewayConfig

    config = GatewayConfig(
        model=model,
        tokenizer=str(tiny_model_dir),
        engines=[EngineEndpoint(url=vllm_url)],
        remote_url=vllm_url,
        render=render,  # type: ignore[arg-type]
        route="tokens",
        route_header=True,
    )
    server = TestServer(create_app(config), handler_cancellation=True)
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await server.close()


async def _answer(client: Any, model: str, route: str, stream: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        "temperature": 0,
        "max_tokens": 16,
        "extra_body": {"ignore_eos": True},
        "extra_headers": {"onehop-route": route},
    }
    if not stream:
        completion = await client.chat.completions.create(**kwargs)
        message = completion.choices[0].message
        return {
            "content": message.content or "",
            "reasoning": getattr(message, "reasoning", None) or "",
            "finish": completion.choices[0].finish_reason,
            "tokens": completion.usage.completion_tokens,
        }
    content, reasoning, finish = "", "", None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "finish": finish, "tokens": 16}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_gateway_serves_chat_through_stock_vllm(vllm_url: str, model: str, tiny_model_dir: Path, stream: bool) -> None:
    """Stock vLLM as the engine: the token and text routes give one answer, and vLLM's own
    stateless derender (tokens-remote) agrees on this output; remote render changes nothing."""
    async with _gateway(vllm_url, model, tiny_model_dir, "local") as client:
        answers = {route: await _answer(client, model, route, stream) for route in ("tokens", "text", "tokens-remote")}
    async with _gateway(vllm_url, model, tiny_model_dir, "remote") as client:
        remote_render = await _answer(client, model, "tokens", stream)
    assert answers["tokens"] == answers["text"] == answers["tokens-remote"] == remote_render
    assert answers["tokens"]["finish"] == "length"
    assert answers["tokens"]["reasoning"] or answers["tokens"]["content"]


async def test_gateway_takes_stock_vllm_032_as_032(vllm_url: str, model: str, tiny_model_dir: Path) -> None:
    """vLLM 0.32 has no derender form (0.33's): its /version says so, and the gateway offers it
    the text and tokens routes only."""
    import aiohttp as http_client

    from gateway.upstream.engine_client import EngineClient
    from gateway.config import Balancing, Health, Timeouts
    from gateway.routing.datastore import EndpointStore
    from gateway.routing.picker import Picker

    async with http_client.ClientSession() as session, session.get(vllm_url + "/version") as response:
        assert (await response.json())["version"].startswith("0.32")
    engines = EngineClient(EndpointStore([], Health()), Picker(Balancing()), Timeouts(), Health())
    await engines.start()
    try:
        assert await engines.routes(vllm_url) == {"tokens", "text"}
        assert engines.derender_form(vllm_url) == "onehop"
    finally:
        await engines.close()
    import openai

    async with _gateway(vllm_url, model, tiny_model_dir, "local") as client:
        with pytest.raises(openai.BadRequestError, match="not available on this engine"):
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, extra_headers={"onehop-route": "derender"}
            )


async def _completion(client: Any, model: str, route: str, stream: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": model,
        "prompt": "Hello there, general",
        "temperature": 0,
        "max_tokens": 16,
        "extra_body": {"ignore_eos": True},
        "extra_headers": {"onehop-route": route},
    }
    if not stream:
        completion = await client.completions.create(**kwargs)
        return {"text": completion.choices[0].text, "finish": completion.choices[0].finish_reason, "tokens": completion.usage.completion_tokens}
    text, finish = "", None
    async for chunk in await client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return {"text": text, "finish": finish, "tokens": 16}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_gateway_serves_completions_through_stock_vllm(vllm_url: str, model: str, tiny_model_dir: Path, stream: bool) -> None:
    """Completions take the same pipeline: vLLM's own stateless completion derender
    (tokens-remote) and its /v1/completions/render agree with onehop's on this output."""
    async with _gateway(vllm_url, model, tiny_model_dir, "local") as client:
        answers = {route: await _completion(client, model, route, stream) for route in ("tokens", "text", "tokens-remote")}
    async with _gateway(vllm_url, model, tiny_model_dir, "remote") as client:
        remote_render = await _completion(client, model, "tokens", stream)
    assert answers["tokens"] == answers["text"] == answers["tokens-remote"] == remote_render
    assert answers["tokens"]["finish"] == "length" and answers["tokens"]["text"]


# ------------------------------------------------------------ structured outputs

BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
"""A schema a random model cannot run away in: every value is bounded."""
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "bounded", "schema": BOUNDED_SCHEMA, "strict": True}}
STRUCTURED_CASES: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": SCHEMA_FORMAT},
    "json_object": {"response_format": {"type": "json_object"}},
    "choice": {"structured_outputs": {"choice": ["yes", "no"]}},
    "regex": {"structured_outputs": {"regex": "[0-9]{3}"}},
}


@pytest.mark.parametrize("case", list(STRUCTURED_CASES))
async def test_render_carries_the_structured_outputs_onehop_sends(
    session: aiohttp.ClientSession, vllm_url: str, model: str, case: str
) -> None:
    """vLLM's /render and onehop's gateway put the same constraint in `sampling_params`."""
    from wire.protocol import StructuredOutputs
    from gateway.upstream.engine_request import structured_outputs

    body = json.dumps({"model": model, "messages": WEATHER_TURN, **STRUCTURED_CASES[case]}).encode()
    rendered = await render_chat(session, vllm_url, body)
    vllm_constraint = msgspec.json.decode(rendered.sampling_params)["structured_outputs"]
    request = CHAT_COMPLETION_REQUEST_DECODER.decode(body)
    ours = structured_outputs(request.structured_outputs, request.response_format)
    assert msgspec.convert(vllm_constraint, StructuredOutputs) == msgspec.convert(ours, StructuredOutputs), vllm_constraint


@pytest.mark.parametrize("route", ["tokens", "text"])
async def test_gateway_gets_schema_valid_json_from_stock_vllm(vllm_url: str, model: str, tiny_model_dir: Path, route: str) -> None:
    async with _gateway(vllm_url, model, tiny_model_dir, "local") as client:
        for extra in ({"response_format": SCHEMA_FORMAT}, {"structured_outputs": {"choice": ["yes", "no"]}}):
            answer = await client.chat.completions.create(
                model=model, messages=WEATHER_TURN, max_tokens=128, seed=0, extra_headers={"onehop-route": route},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}, **extra},
            )
            content = answer.choices[0].message.content or ""
            if "response_format" in extra and answer.choices[0].finish_reason == "length":
                # The random model may spend every token in the whitespace JSON allows: what it
                # wrote is still where the grammar let it go.
                assert content.startswith("{") and not content[1:].strip(" \t\n\r").startswith(("}", "]")), content
            elif "response_format" in extra:
                value = json.loads(content)
                assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 9 and isinstance(value["ok"], bool), content
            else:
                assert content in ("yes", "no"), content
