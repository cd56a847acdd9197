"""Helpers to drive a derender with a chunking and fold its chunks back into one answer."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from derender.chat import ChatDerender, ChatOptions
from derender.vocab import TokenVocab
from wire.openai_schema import ChatCompletion, ChatCompletionChunk
from wire.protocol import GenerateLogProb, GenerateLogProbsContent
from engine.qwen3.fixtures import EOS_TOKEN_IDS


def counter_ids() -> Callable[[], str]:
    """Deterministic tool-call ids, so runs with different chunkings compare equal."""
    state = iter(range(10**9))
    return lambda: f"chatcmpl-tool-{next(state):032x}"


def fake_logprobs(token_ids: Sequence[int], top: int = 3) -> list[GenerateLogProbsContent]:
    """Logprob entries shaped like the generate wire (sampled first, then by rank)."""
    out = []
    for position, token_id in enumerate(token_ids):
        value = -0.01 * (position % 50)
        candidates = [GenerateLogProb(token_id=token_id, logprob=value, rank=1)]
        candidates += [GenerateLogProb(token_id=(token_id + k) % 151643, logprob=value - k, rank=k + 1) for k in range(1, top)]
        out.append(GenerateLogProbsContent(token_id=token_id, logprob=value, rank=1, top_logprobs=candidates))
    return out


def default_finish(output_ids: Sequence[int]) -> str:
    return "stop" if output_ids and output_ids[-1] in EOS_TOKEN_IDS else "length"


def fixed(size: int) -> Callable[[int], Iterator[int]]:
    def sizes(total: int) -> Iterator[int]:
        while True:
            yield size

    return sizes


ONE_BY_ONE = fixed(1)


def random_splits(seed: int, most: int = 8) -> Callable[[int], Iterator[int]]:
    def sizes(total: int) -> Iterator[int]:
        rng = random.Random(seed)
        while True:
            yield rng.randint(1, most)

    return sizes


@dataclass
class Folded:
    """A streamed answer joined back together."""

    role: str | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Any] = field(default_factory=list)
    usage: Any = None
    deltas: list[dict[str, Any]] = field(default_factory=list)

    def as_comparable(self) -> dict[str, Any]:
        return {
            "content": self.content or None,
            "reasoning": self.reasoning or None,
            "tool_calls": self.tool_calls,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "logprobs": self.logprobs,
        }


def fold_chunks(chunks: Sequence[ChatCompletionChunk]) -> Folded:
    folded = Folded()
    for chunk in chunks:
        if chunk.usage is not msgspec.UNSET and chunk.usage is not None:
            folded.usage = chunk.usage
        for choice in chunk.choices:
            delta = msgspec.to_builtins(choice.delta)
            folded.deltas.append(delta)
            if "role" in delta:
                folded.role = delta["role"]
            folded.content += delta.get("content") or ""
            folded.reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls", []):
                index = call["index"]
                if index == len(folded.tool_calls):
                    folded.tool_calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
                folded.tool_calls[index]["arguments"] += call.get("function", {}).get("arguments") or ""
            if choice.logprobs is not None and choice.logprobs.content:
                folded.logprobs += [msgspec.to_builtins(e) for e in choice.logprobs.content]
            if choice.finish_reason is not None:
                folded.finish_reason = choice.finish_reason
                assert choice.stop_reason is not msgspec.UNSET, "the finishing chunk carries stop_reason"
                folded.stop_reason = choice.stop_reason
    return folded


def comparable_response(response: ChatCompletion) -> dict[str, Any]:
    choice = response.choices[0]
    message = choice.message
    calls = message.tool_calls if message.tool_calls is not msgspec.UNSET else []
    return {
        "content": message.content,
        "reasoning": message.reasoning,
        "tool_calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls],
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "logprobs": [msgspec.to_builtins(e) for e in (choice.logprobs.content or [])] if choice.logprobs else [],
    }


@dataclass
class Run:
    chunks: list[ChatCompletionChunk]
    derender: ChatDerender

    @property
    def folded(self) -> Folded:
        return fold_chunks(self.chunks)


def stream(
    vocab: TokenVocab,
    options: ChatOptions,
    output_ids: Sequence[int],
    sizes: Callable[[int], Iterator[int]] = ONE_BY_ONE,
    *,
    prompt_ids: Sequence[int] = (),
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    with_logprobs: bool = False,
    final_empty_chunk: bool = False,
) -> Run:
    """Feed `output_ids` in chunks like an engine stream; the last chunk carries the finish.

    The finish defaults to what an engine would report: `stop` on a trailing EOS, else `length`.
    """
    finish_reason = finish_reason or default_finish(output_ids)
    derender = ChatDerender(
        vocab, options, model="m", prompt_token_ids=prompt_ids, include_usage=True, new_tool_call_id=counter_ids()
    )
    chunks = derender.start()
    logprobs = fake_logprobs(output_ids) if with_logprobs else None
    position = 0
    widths = sizes(len(output_ids))
    while position < len(output_ids) and not derender.finished:
        width = next(widths)
        end = min(position + width, len(output_ids))
        last = end == len(output_ids) and not final_empty_chunk
        chunk = derender.step(
            0,
            output_ids[position:end],
            logprobs[position:end] if logprobs else None,
            finish_reason=finish_reason if last else None,
            stop_reason=stop_reason if last else None,
        )
        if chunk is not None:
            chunks.append(chunk)
        position = end
    if not derender.finished:
        chunk = derender.step(0, [], [], finish_reason=finish_reason, stop_reason=stop_reason)
        if chunk is not None:
            chunks.append(chunk)
    usage = derender.usage_chunk()
    if usage is not None:
        chunks.append(usage)
    return Run(chunks=chunks, derender=derender)


def whole(
    vocab: TokenVocab,
    options: ChatOptions,
    output_ids: Sequence[int],
    *,
    prompt_ids: Sequence[int] = (),
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    with_logprobs: bool = False,
) -> ChatCompletion:
    """The non-streaming answer: every token in one step."""
    finish_reason = finish_reason or default_finish(output_ids)
    derender = ChatDerender(vocab, options, model="m", prompt_token_ids=prompt_ids, new_tool_call_id=counter_ids())
    logprobs = fake_logprobs(output_ids) if with_logprobs else None
    derender.step(0, list(output_ids), logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    return derender.response()


def parsed_arguments(folded: Folded) -> list[Any]:
    return [json.loads(call["arguments"]) for call in folded.tool_calls]


FAMILY_CHUNKINGS = [fixed(k) for k in (1, 2, 3, 5, 8)] + [random_splits(seed) for seed in range(3)]
"""The chunkings every parser-family vector is fed in: one token per chunk, fixed widths
that split markers and tags at different offsets, and seeded random splits."""


def chunked_answer(
    vocab: TokenVocab, options: ChatOptions, ids: Sequence[int], prompt: Sequence[int] = (), **finish: Any
) -> dict[str, Any]:
    """The non-streamed answer, after checking every `FAMILY_CHUNKINGS` chunking streams exactly it,
    with one tool-call header per call, in order."""
    reference = comparable_response(whole(vocab, options, ids, prompt_ids=prompt, **finish))
    for sizes in FAMILY_CHUNKINGS:
        folded = stream(vocab, options, ids, sizes, prompt_ids=prompt, **finish).folded
        assert folded.as_comparable() == reference
        headers = [c["index"] for d in folded.deltas for c in d.get("tool_calls", []) if c.get("id")]
        assert headers == list(range(len(reference["tool_calls"])))  # one header per call, in order
    return reference
