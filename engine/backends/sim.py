"""A deterministic simulator backend: a real tokenizer, no model.

For load tests and benchmarks of everything above the backend (engine server,
derender, gateway): the simulator answers `/inference/v1/generate` at a
configured pace with output in the format of the engine's reasoning and tool
parser families (Qwen3 `<think>` and Hermes calls unless told otherwise),
without a GPU or model weights.

Configuration (`SimBackendConfig`, decoded strictly: unknown keys are errors)::

    tokenizer           a Hugging Face tokenizer folder (its tokenizer.json)
    served_model_name   reported in BackendInfo.model ("sim")
    ttft_ms, itl_ms     time to first token, then time between steps (0, 0)
    tokens_per_step     tokens per step and choice, like speculative decoding (1)
    mode                "auto", "echo", "script" or "agent" ("auto")
    script              texts for mode "script"
    agent_calls         mode "agent": tool name -> the arguments to call it with,
                        tried in order ({}; the mode needs at least one)
    seed                mixed into every choice's random stream (0)
    max_model_len       prompt + output limit (32768)
    reasoning           auto mode thinks when the prompt leaves thinking open (true)
    output_tokens       auto mode content length in tokens; null: 16-64 words
    reasoning_format    the reasoning family written ("qwen3"; the engine's parser;
                        null: none, as for tool formats without reasoning)
    tool_format         the tool-call family written ("hermes"; the engine's parser)

What each mode plans before the token rules below apply:

- ``echo``: the text of the last user turn of a ChatML prompt (between the
  last ``<|im_start|>user\\n`` and its ``<|im_end|>``; a turn of tool
  responses counts), or the whole prompt text when the prompt has no
  ``<|im_start|>``, re-encoded, then EOS.
- ``script``: the next text of ``script`` (the k-th request gets text
  ``k mod len(script)``; all choices of a request share it), encoded as is so
  it may carry ``<think>``/``<tool_call>`` markers, then EOS.
- ``agent``: one step of a coding agent's tool loop, for driving real agent
  clients (Codex CLI, Claude Code) through the gateway. Reasoning first when
  the prompt leaves thinking open (as in auto mode), then: when the last
  user turn holds tool results (``<tool_response>`` blocks, as the Qwen3
  template renders tool messages), the answer ``The command printed: `` and
  the results' text; else, when the ``<tools>`` block lists a tool named in
  ``agent_calls``, a call of the first such tool (in ``agent_calls``' order)
  with its configured arguments, in ``tool_format``'s format; else content as
  in auto mode. Answers and content are written as the tool format's family
  writes an answer (gpt-oss: a ``final`` channel message). Then EOS.
- ``auto``, in these parts, then EOS:

  1. Reasoning, when the prompt leaves thinking open (a ChatML prompt ending
     with ``<|im_start|>assistant\\n``; ``enable_thinking=false`` renders
     ``<think>\\n\\n</think>\\n\\n`` after it, which closes it):
     ``<think>\\n`` + 8-32 words + ``\\n</think>\\n\\n``. With
     ``reasoning=false`` the block is empty (``<think>\\n\\n</think>\\n\\n``),
     as Qwen3 writes it when told not to think, so parsers still see content.
  2. A tool call, when the system turn holds a ``<tools>`` block (one JSON
     tool per line, as the Qwen3 chat template renders them): one of the
     tools, chosen by the seed, called in ``tool_format``'s format (Hermes:
     ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``). The
     arguments follow the tool's JSON-schema ``parameters``: every required
     property and about half of the optional ones; ``const``/``enum`` give
     their (first) value, ``anyOf``/``oneOf`` their first option, strings
     are 1-3 words, integers and numbers seeded within
     ``minimum``/``maximum`` (0-100 otherwise), booleans seeded, arrays 1-2
     items of ``items``, objects recurse (four levels deep at most).
  A prompt that ends inside an opened ``<tool_call>`` (how the gateway
     forces ``tool_choice`` "required" or a named function) is continued
     instead: the rest of the call for the named tool (or one chosen by the
     seed), then EOS, with no reasoning. (Families whose calls open with
     another marker are not continued this way.)
  3. With ``structured_outputs`` (``SIM_CONSTRAINTS``): right after the reasoning
     block (its trailing whitespace dropped, as a grammar would refuse it), an
     instance of the ``json`` schema (every required property, ``$ref`` into
     ``$defs`` resolved, ``maxLength``/``maxItems`` kept, common string
     ``format``s), one of the ``choice`` strings, or a ``json_object``; no tool
     call. Other kinds are refused (the engine checks ``BackendInfo.constraints``).
  4. Otherwise content: sentences of plain words with a few multi-byte ones
     (``世界``, ``🫠``, ``𓀀``, ``café``) so detokenizers meet split
     characters; ``output_tokens`` tokens exactly, or 16-64 words.

Token rules, the same in every mode, as vLLM's scheduler applies them:

- Each output token is checked in order: an EOS id ends the choice with
  finish ``stop`` (the EOS id is the last token, ``stop_reason`` null); then
  an id in ``stop_token_ids`` ends it with ``stop`` and that id as
  ``stop_reason``; then reaching the limit ends it with ``length``. The limit
  is ``max_tokens`` (null: no limit) capped by ``max_model_len`` minus the
  prompt. EOS ids are the request's ``eos_token_ids`` or, when it has none,
  the backend's (``generation_config.json``, else the tokenizer's EOS); the
  one emitted is the backend's first EOS when allowed, else the smallest.
- ``min_tokens``: EOS and stop ids are masked (skipped) until that many
  tokens were produced; a shorter plan is padded with words before its EOS.
- ``ignore_eos``: no EOS is emitted; words follow the plan until the limit.
- Plain-text padding and the ``ignore_eos`` tail are ASCII words, so a
  ``length`` cut in them never splits a character.

Determinism: every choice draws from its own random stream, seeded with
``seed``, the request's ``sampling.seed``, the prompt ids and the choice
index, so the same request gives the same ids (for one Python version) and
``n`` choices differ from each other. Echo and script plans come from the
prompt or the script alone (the streams then only pick padding words), and
script mode also depends on how many requests came before. Sampling knobs
(temperature, top-p, penalties, ...) are accepted and ignored.

Logprobs (``sampling.logprobs = k``; -1 means 20, more than 20 is refused as
vLLM refuses it by default) are synthetic but well formed: per token the
sampled id with rank 1 and a logprob in [-0.55, -0.05], and
``top_logprobs`` = the sampled entry, then ``k`` other ids with ranks
2..k+1 and logprobs falling by 1.5 per rank. They depend only on the token
and its position.

Timing: the first step comes ``ttft_ms`` after ``generate`` starts
iterating, then one step every ``itl_ms``, on a fixed schedule (a late
consumer gets the next steps back to back, not a slower pace). Each step
yields one ``list[BackendOutput]`` with one entry per choice still running,
``tokens_per_step`` tokens each (fewer on the final one). Waits are timers
on the event loop, never busy loops.

Requests are refused with `BackendRequestError` before any output for an
empty prompt, a prompt of ``max_model_len`` tokens or more, an id outside
the vocabulary (the tokenizer's full size, added tokens included), too many
logprobs, or a request id that is already running. Closing the generator,
cancelling its consumer, or ``abort(id)`` stops a request at once; after an
abort, the generator yields a last batch with finish ``abort`` for each
unfinished choice. ``close()`` aborts everything; ``generate`` then raises
`BackendError` until ``start()`` is called again. The tokenizer is loaded by
the constructor, so ``start()`` has nothing else to do. Each choice's first
output reports ``num_cached_tokens=0``: there is no prefix cache.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import math
import random
import uuid
import zlib
from array import array
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from tokenizers import Tokenizer

from engine.backends.base import (
    BackendError,
    BackendInfo,
    BackendOutput,
    BackendRequest,
    BackendRequestError,
    FinishReason,
)
from engine.derender.parsers import REASONING_PARSERS, TOOL_PARSERS
from engine.derender.parsers.base import ToolCallText
from engine.protocol import GenerateLogProb, GenerateLogProbsContent, StructuredOutputs

__all__ = ["MAX_LOGPROBS", "SimBackend", "SimBackendConfig", "SimConfigError"]

MAX_LOGPROBS = 20
"""vLLM's default `max_logprobs`; also what `logprobs=-1` means here."""

_CONTENT_WORDS = (16, 64)
_REASONING_WORDS = (8, 32)
_SENTENCE_WORDS = (5, 12)
_MAX_SCHEMA_DEPTH = 4
_MAX_INSTANCE_DEPTH = 16
SIM_CONSTRAINTS = frozenset({"json", "json_object", "choice"})
"""What auto mode writes to order: a schema instance, a JSON object, one of the choices."""
_RANK_STEP = 1.5
_TAIL_WINDOW = 8  # prompt tokens decoded to find the generation prompt (3 tokens in Qwen3)

_ASCII_WORDS = (
    "the", "a", "of", "to", "and", "in", "request", "token", "stream", "latency", "queue", "batch", "prefill",
    "decode", "cache", "model", "server", "client", "load", "test", "engine", "router", "shard", "replica", "budget",
    "window", "chunk", "step", "signal", "metric", "trace", "span", "sample", "output", "prompt", "context", "reply",
    "answer", "result", "value", "simple", "steady", "quick", "quiet", "bright", "plain", "river", "mountain",
    "harbor", "garden", "lantern", "copper", "marble", "amber", "violet", "meadow", "orbit", "pixel", "vector",
    "kernel", "packet", "socket", "buffer",
)
# Multi-byte words: split across byte-level tokens, they exercise UTF-8 reassembly.
_EXOTIC_WORDS = ("世界", "🫠", "𓀀", "café", "naïve", "Ωmega")
_ALL_WORDS = (*_ASCII_WORDS, *_EXOTIC_WORDS)

_CHATML_START = "<|im_start|>"
_CHATML_END = "<|im_end|>"
_GENERATION_PROMPT = "<|im_start|>assistant\n"
_USER_ROLE = "user\n"
_SYSTEM_ROLE = "system\n"
_TOOLS_OPEN = "<tools>\n"
_TOOL_CALL_START = "<tool_call>"
_TOOL_CALL_END = "</tool_call>"
_OPEN_CALL_WINDOW = 64
_SLOT = "\x00"  # stands for the reasoning text when a family's reasoning block is split in two
_TOOLS_CLOSE = "\n</tools>"
_TOOL_RESPONSE_OPEN = "<tool_response>\n"
_TOOL_RESPONSE_CLOSE = "\n</tool_response>"
AGENT_ANSWER = "The command printed: "
"""How agent mode's answer to tool results starts (the results' text follows)."""


class SimConfigError(ValueError):
    """The simulator's configuration or tokenizer folder cannot be used."""


class SimBackendConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokenizer: str
    """A Hugging Face tokenizer folder; its tokenizer.json is loaded."""
    served_model_name: str = "sim"
    ttft_ms: Annotated[float, Meta(ge=0)] = 0
    itl_ms: Annotated[float, Meta(ge=0)] = 0
    tokens_per_step: Annotated[int, Meta(ge=1)] = 1
    mode: Literal["auto", "echo", "script", "agent"] = "auto"
    script: list[str] = []
    agent_calls: dict[str, dict[str, Any]] = {}
    seed: int = 0
    max_model_len: Annotated[int, Meta(ge=1)] = 32768
    reasoning: bool = True
    output_tokens: Annotated[int, Meta(ge=0)] | None = None
    reasoning_format: str | None = "qwen3"
    tool_format: str = "hermes"

    def __post_init__(self) -> None:
        # Constructing directly skips the Meta checks; a zero step would never end one.
        if self.tokens_per_step < 1:
            raise SimConfigError(f"tokens_per_step must be at least 1, got {self.tokens_per_step}")
        if self.mode == "script" and not self.script:
            raise SimConfigError("mode 'script' needs at least one text in script")
        if self.mode == "agent" and not self.agent_calls:
            raise SimConfigError("mode 'agent' needs at least one tool in agent_calls")
        reasoning = REASONING_PARSERS.get(self.reasoning_format) if self.reasoning_format is not None else None
        if self.reasoning_format is not None and (reasoning is None or reasoning.format_reasoning is None):
            raise SimConfigError(f"the simulator cannot write reasoning as {self.reasoning_format!r}")
        tools = TOOL_PARSERS.get(self.tool_format)
        if tools is None or tools.format_calls is None:
            raise SimConfigError(f"the simulator cannot write tool calls as {self.tool_format!r}")


# ------------------------------------------------------------ tokenizer side


class _Words:
    """Word pieces encoded once, so prose is built from ids without encoding per request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        enc = _encoder(tokenizer)
        self.lower = [enc(" " + w) for w in _ALL_WORDS]
        self.capital = [enc(" " + w.capitalize()) for w in _ALL_WORDS]
        self.first = [enc(w.capitalize()) for w in _ALL_WORDS]
        self.ascii = self.lower[: len(_ASCII_WORDS)]
        self.period = enc(".")
        # One-token words top up an exact token count without splitting a word.
        self.singles = [piece for piece in self.ascii if len(piece) == 1]

    def sentences(self, rng: random.Random, words: int, *, start: bool) -> list[list[int]]:
        """`words` words as sentences, one piece (list of ids) per word or period."""
        pieces: list[list[int]] = []
        left = words
        while left > 0:
            length = min(left, rng.randint(*_SENTENCE_WORDS))
            head = self.first if start and not pieces else self.capital
            pieces.append(head[rng.randrange(len(head))])
            pieces.extend(self.lower[rng.randrange(len(self.lower))] for _ in range(length - 1))
            pieces.append(self.period)
            left -= length
        return pieces

    def exactly(self, rng: random.Random, tokens: int) -> list[int]:
        """Prose of exactly `tokens` ids, ending on whole words."""
        out: list[int] = []
        for piece in self.sentences(rng, tokens, start=True):
            if len(out) + len(piece) > tokens:
                break
            out.extend(piece)
        while len(out) < tokens and self.singles:
            out.extend(self.singles[rng.randrange(len(self.singles))])
        return out[:tokens]

    def padding(self, rng: random.Random) -> Iterator[int]:
        """An endless stream of ASCII word ids (any cut is valid UTF-8)."""
        while True:
            yield from self.ascii[rng.randrange(len(self.ascii))]


def _encoder(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def _load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
        raise SimConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc


def _vocab_size(tokenizer: Tokenizer) -> int:
    """The full size, added tokens included: one past the highest id."""
    added = tokenizer.get_added_tokens_decoder()
    return max(tokenizer.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)


def _eos_ids(folder: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    """EOS ids in preference order: generation_config.json, else the tokenizer's EOS."""
    generation = _read_json(folder / "generation_config.json")
    configured = generation.get("eos_token_id")
    if isinstance(configured, int):
        return (configured,)
    if isinstance(configured, list) and all(isinstance(i, int) for i in configured):
        return tuple(configured)
    token = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return () if token_id is None else (token_id,)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise SimConfigError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------ reading the prompt


@dataclass(frozen=True, slots=True)
class _Prompt:
    ids: list[int]
    thinking_open: bool
    tools: tuple[dict[str, Any], ...]
    open_call: str | None = None
    """Text after a trailing `<tool_call>` the prompt leaves open (a forced tool choice)."""


class _PromptReader:
    """Reads ChatML structure from prompt ids, decoding only the few tokens it needs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # -1 never occurs in a checked prompt, so a tokenizer without ChatML matches nothing.
        self._start = _token_id(tokenizer, _CHATML_START)
        self._end = _token_id(tokenizer, _CHATML_END)
        self._call_start = _token_id(tokenizer, _TOOL_CALL_START)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def read(self, ids: list[int]) -> _Prompt:
        chatml = self._start in ids
        tail = self.decode(ids[-_TAIL_WINDOW:]) if chatml else ""
        return _Prompt(
            ids=ids,
            thinking_open=tail.endswith(_GENERATION_PROMPT),
            tools=self._tools(ids),
            open_call=self._open_call(ids),
        )

    def _open_call(self, ids: list[int]) -> str | None:
        """A prompt ending inside a tool call (the gateway forces `tool_choice` this way)."""
        window = ids[-_OPEN_CALL_WINDOW:]
        if self._call_start not in window:
            return None
        position = len(window) - 1 - window[::-1].index(self._call_start)
        text = self.decode(window[position + 1 :])
        return None if _TOOL_CALL_END in text or _CHATML_END in text else text

    def last_user_text(self, ids: list[int]) -> str:
        """The last user turn's text; the whole prompt's text when it is not ChatML."""
        for position in range(len(ids) - 1, -1, -1):
            if ids[position] == self._start:
                turn = self.decode(ids[position + 1 : self._turn_end(ids, position)])
                if turn.startswith(_USER_ROLE):
                    return turn[len(_USER_ROLE) :]
        return self.decode(ids) if self._start not in ids else ""

    def _turn_end(self, ids: list[int], start: int) -> int:
        try:
            return ids.index(self._end, start)
        except ValueError:
            return len(ids)

    def _tools(self, ids: list[int]) -> tuple[dict[str, Any], ...]:
        # The chat template puts the tool list in the system turn, which comes first.
        if not ids or ids[0] != self._start:
            return ()
        system = self.decode(ids[1 : self._turn_end(ids, 0)])
        if not system.startswith(_SYSTEM_ROLE):
            return ()
        return _parse_tools(system)


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    return -1 if token_id is None else token_id


@functools.lru_cache(maxsize=64)  # load tests resend one system prompt over and over
def _parse_tools(system: str) -> tuple[dict[str, Any], ...]:
    opened = system.find(_TOOLS_OPEN)
    closed = system.find(_TOOLS_CLOSE, opened)
    if opened < 0 or closed < 0:
        return ()
    tools: list[dict[str, Any]] = []
    for line in system[opened + len(_TOOLS_OPEN) : closed].splitlines():
        tool = _tool_of(line)
        if tool is not None:
            tools.append(tool)
    return tuple(tools)


def _tool_results(turn: str) -> list[str]:
    """The texts of a user turn's `<tool_response>` blocks (the Qwen3 template's tool messages)."""
    results: list[str] = []
    start = turn.find(_TOOL_RESPONSE_OPEN)
    while start >= 0:
        end = turn.find(_TOOL_RESPONSE_CLOSE, start)
        if end < 0:
            break
        results.append(turn[start + len(_TOOL_RESPONSE_OPEN) : end].strip())
        start = turn.find(_TOOL_RESPONSE_OPEN, end)
    return results


def _tool_of(line: str) -> dict[str, Any] | None:
    """A tool line as {"name", "parameters"}, from OpenAI's wrapped form or a bare function."""
    try:
        tool = json.loads(line)
    except ValueError:
        return None
    if not isinstance(tool, dict):
        return None
    function = tool.get("function") if tool.get("type") == "function" else tool
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    return function


# ------------------------------------------------------------ values from JSON schema


def _constrained_text(constraint: StructuredOutputs, rng: random.Random) -> str:
    """What auto mode writes for a structured-output constraint (`SIM_CONSTRAINTS`)."""
    if constraint.choice is not None:
        if not constraint.choice:
            raise BackendRequestError("structured_outputs.choice must not be empty")
        return constraint.choice[rng.randrange(len(constraint.choice))]
    if constraint.json is not None:
        schema = constraint.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise BackendRequestError(f"structured_outputs.json is not a JSON schema: {exc}") from exc
        if not isinstance(schema, dict):
            raise BackendRequestError("structured_outputs.json must be a JSON schema object")
        return json.dumps(_fake_instance(schema, rng), ensure_ascii=False)
    if constraint.json_object:
        return json.dumps({"answer": _phrase(rng)})
    raise BackendRequestError(f"the sim backend cannot write structured_outputs.{constraint.kind}")


def _fake_arguments(parameters: object, rng: random.Random) -> dict[str, Any]:
    """Arguments that satisfy the simple parts of a tool's `parameters` schema."""
    schema = parameters if isinstance(parameters, dict) else {"type": "object"}
    value = _SchemaFaker(schema, rng, _MAX_SCHEMA_DEPTH).value(schema, 0)
    return value if isinstance(value, dict) else {}


def _fake_instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """An instance of a structured-output schema: every required property at any depth
    (up to `_MAX_INSTANCE_DEPTH`), `$ref`s into `$defs` resolved, common string formats."""
    return _SchemaFaker(schema, rng, _MAX_INSTANCE_DEPTH).value(schema, 0)


_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
}


class _SchemaFaker:
    """Values for the parts of JSON schema that tools and structured outputs use: `const`,
    `enum` (first value), `anyOf`/`oneOf`/`allOf` (first option), `$ref` into the root's
    `$defs`/`definitions`, and the types (objects with their required properties and about
    half of the optional ones, 1-2 array items or `minItems`, seeded numbers within bounds)."""

    def __init__(self, root: dict[str, Any], rng: random.Random, max_depth: int) -> None:
        self._root = root
        self._rng = rng
        self._max_depth = max_depth

    def value(self, schema: object, depth: int) -> Any:
        if not isinstance(schema, dict):
            return _phrase(self._rng)
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.value(self._resolve(ref), depth + 1)  # a cycle of refs ends at max_depth
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return enum[0]
        for key in ("anyOf", "oneOf", "allOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                return self.value(options[0], depth)
        kind = _schema_type(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            low, high = _bounds(schema)
            return self._rng.randint(math.ceil(low), max(math.ceil(low), math.floor(high)))
        if kind == "number":
            low, high = _bounds(schema)
            return round(self._rng.uniform(low, max(low, high)), 2)
        if kind == "boolean":
            return self._rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    def _resolve(self, ref: str) -> object:
        """`#/$defs/Name` (or `#/definitions/Name`, or `#` itself) in the root schema."""
        node: object = self._root
        for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else ():
            node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
        return node

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        if depth >= self._max_depth:
            return {}
        declared = schema.get("properties")
        properties: dict[str, Any] = declared if isinstance(declared, dict) else {}
        listed = schema.get("required")
        required = [r for r in listed if isinstance(r, str)] if isinstance(listed, list) else []
        optional = [name for name in properties if name not in required and self._rng.random() < 0.5]
        return {name: self.value(properties.get(name, {}), depth + 1) for name in required + optional}

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        if depth >= self._max_depth:
            return []
        low, high = schema.get("minItems"), schema.get("maxItems")
        count = max(low if isinstance(low, int) else 0, self._rng.randint(1, 2))
        if isinstance(high, int):
            count = min(count, high)
        return [self.value(schema.get("items", {}), depth + 1) for _ in range(count)]

    def _string(self, schema: dict[str, Any]) -> str:
        known = schema.get("format")
        text = (_FORMATS.get(known) if isinstance(known, str) else None) or _phrase(self._rng)
        longest = schema.get("maxLength")
        return text[:longest] if isinstance(longest, int) and longest > 0 else text


def _schema_type(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else "string"


def _bounds(schema: dict[str, Any]) -> tuple[float, float]:
    """`minimum`/`maximum`, or a range of 100 on the side that is missing."""
    low, high = _number(schema.get("minimum")), _number(schema.get("maximum"))
    if low is None:
        low = 0 if high is None or high >= 0 else high - 100
    return low, (low + 100 if high is None else high)


def _number(value: object) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _phrase(rng: random.Random) -> str:
    return " ".join(rng.choice(_ALL_WORDS) for _ in range(rng.randint(1, 3)))



# ------------------------------------------------------------ one choice's token stream


@dataclass(frozen=True, slots=True)
class _Rules:
    """The token-level stop conditions of one request."""

    eos: frozenset[int]
    emitted_eos: int | None
    stops: frozenset[int]
    min_tokens: int
    limit: int
    logprobs: int | None


class _Choice:
    """One choice: its planned ids, then padding, under the request's stop rules."""

    __slots__ = ("_count", "_logprobs", "_rules", "_source", "_started", "finished", "index")

    def __init__(self, index: int, plan: list[int], padding: Iterator[int], rules: _Rules, logprobs: _Logprobs) -> None:
        self.index = index
        self.finished = False
        self._rules = rules
        self._count = 0
        self._logprobs = logprobs
        self._started = False
        if rules.emitted_eos is None:
            self._source: Iterator[int] = itertools.chain(plan, padding)
        else:
            self._source = itertools.chain(plan, self._pad_to_min(padding), (rules.emitted_eos,))

    def _pad_to_min(self, padding: Iterator[int]) -> Iterator[int]:
        # Lazy: masked ids in the plan leave the count short, so read it only now.
        while self._count < self._rules.min_tokens:
            yield next(padding)

    def take(self, width: int) -> BackendOutput:
        """The next step: up to `width` tokens, with a finish reason when the choice ends.

        Hot path (per token): set lookups only; ids were encoded before the first step.
        """
        rules = self._rules
        ids: list[int] = []
        finish: FinishReason | None = None
        stop_reason: int | None = None
        start = self._count
        for token in self._source:
            masked = token in rules.eos or token in rules.stops
            if masked and self._count < rules.min_tokens:
                continue  # vLLM masks EOS and stop ids until min_tokens
            ids.append(token)
            self._count += 1
            if token in rules.eos:
                finish = "stop"
            elif token in rules.stops:
                finish, stop_reason = "stop", token
            elif self._count >= rules.limit:
                finish = "length"
            if finish is not None or len(ids) == width:
                break
        else:
            finish = "length"  # unreachable: the source ends only in an EOS, which stops above
        self.finished = finish is not None
        output = BackendOutput(index=self.index, token_ids=ids, finish_reason=finish, stop_reason=stop_reason)
        if rules.logprobs is not None:
            output.logprobs = [self._logprobs.entry(t, start + i) for i, t in enumerate(ids)]
        if not self._started:
            output.num_cached_tokens = 0  # no prefix cache in the simulator
            output.queued_s = 0.0  # and no batch limit: every request starts at once
            self._started = True
        return output

    def aborted(self) -> BackendOutput:
        logprobs: list[GenerateLogProbsContent] | None = [] if self._rules.logprobs is not None else None
        self.finished = True
        return BackendOutput(index=self.index, token_ids=[], logprobs=logprobs, finish_reason="abort")


class _Logprobs:
    """Synthetic logprobs: the sampled id ranks first, k distinct other ids follow."""

    __slots__ = ("_k", "_stride", "_vocab_size")

    def __init__(self, k: int, vocab_size: int) -> None:
        self._k = min(k, vocab_size - 1)
        self._vocab_size = vocab_size
        # A stride coprime with the vocabulary size visits k distinct ids before repeating.
        stride = 7919
        while math.gcd(stride, vocab_size) != 1:
            stride += 1
        self._stride = stride

    def entry(self, token: int, position: int) -> GenerateLogProbsContent:
        logprob = -0.05 - ((token * 31 + position * 17) % 101) / 200
        top = [GenerateLogProb(token_id=token, logprob=logprob, rank=1)]
        for rank in range(2, self._k + 2):
            other = (token + (rank - 1) * self._stride) % self._vocab_size
            top.append(GenerateLogProb(token_id=other, logprob=logprob - _RANK_STEP * (rank - 1), rank=rank))
        return GenerateLogProbsContent(token_id=token, logprob=logprob, rank=1, top_logprobs=top)


# ------------------------------------------------------------ the backend


class _Live:
    """A running request: the abort flag and the timer future it may be waiting on."""

    __slots__ = ("aborted", "request_id", "waiter")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.aborted = False
        self.waiter: asyncio.Future[None] | None = None

    def abort(self) -> None:
        self.aborted = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SimBackend:
    """The `Backend` protocol, simulated; see the module docstring for the output."""

    def __init__(self, config: SimBackendConfig) -> None:
        folder = Path(config.tokenizer)
        tokenizer = _load_tokenizer(folder)
        self._config = config
        self._encode = _encoder(tokenizer)
        self._reader = _PromptReader(tokenizer)
        self._words = _Words(tokenizer)
        self._eos = _eos_ids(folder, tokenizer)
        self._info = BackendInfo(
            name="sim",
            model=config.served_model_name,
            max_model_len=config.max_model_len,
            vocab_size=_vocab_size(tokenizer),
            eos_token_ids=frozenset(self._eos),
            constraints=SIM_CONSTRAINTS,
        )
        self._think_open: list[int] | None = None
        if config.reasoning_format is not None:
            write_reasoning = REASONING_PARSERS[config.reasoning_format].format_reasoning
            assert write_reasoning is not None  # checked by the config
            think_open, _, think_close = write_reasoning(_SLOT).partition(_SLOT)
            self._think_open = self._encode(think_open)
            self._think_close = self._encode(think_close)
            self._empty_reasoning = self._encode(write_reasoning(""))
        write_calls = TOOL_PARSERS[config.tool_format].format_calls
        assert write_calls is not None
        self._write_calls = write_calls
        self._write_content = TOOL_PARSERS[config.tool_format].format_content or str
        self._script = [self._encode(text) for text in config.script]
        self._script_turn = 0
        self._live: dict[str, _Live] = {}
        self._closed = False
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.prefills = 0
        """Prefill requests served (`do_remote_decode`): one token, then the KV handed over."""
        self.remote_decodes = 0
        """Decode requests that started from another engine's prefill (`do_remote_prefill`)."""

    @property
    def info(self) -> BackendInfo:
        return self._info

    async def start(self) -> None:
        """Nothing to load beyond the tokenizer, which the constructor read."""
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        for live in self._live.values():
            live.abort()
        self._live.clear()

    async def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            live.abort()

    def running(self) -> frozenset[str]:
        return frozenset(self._live)

    async def prepare(self, request: BackendRequest) -> BackendRequest:
        return request  # a constraint is read when its answer is written: nothing compiles

    async def generate(self, request: BackendRequest) -> AsyncGenerator[list[BackendOutput], None]:
        if self._closed:
            raise BackendError("the sim backend is closed")
        prompt = self._check(request)
        role = self._kv_role(request)
        choices = self._choices(request, prompt)
        live = self._register(request.request_id)
        loop = asyncio.get_running_loop()
        # A decode whose prefill ran elsewhere starts with the KV cache in place.
        deadline = loop.time() + (0 if role == "decode" else self._config.ttft_ms / 1000)
        handover = self._handover(request) if role == "prefill" else None
        try:
            while True:
                await self._wait(live, loop, deadline)
                if live.aborted:
                    yield [choice.aborted() for choice in choices if not choice.finished]
                    return
                width = self._config.tokens_per_step
                step = [choice.take(width) for choice in choices if not choice.finished]
                if handover is not None:
                    for output in step:
                        if output.finish_reason is not None:
                            output.kv_transfer_params = handover
                yield step
                if all(choice.finished for choice in choices):
                    return
                deadline += self._config.itl_ms / 1000
        finally:
            # Cancellation and aclose() land here too; CancelledError propagates after.
            if self._live.get(live.request_id) is live:
                del self._live[live.request_id]

    # -- per request --------------------------------------------------------

    def _check(self, request: BackendRequest) -> _Prompt:
        ids = list(request.prompt_token_ids)
        if not ids:
            raise BackendRequestError("the prompt is empty")
        if len(ids) >= self._info.max_model_len:
            raise BackendRequestError(
                f"the prompt ({len(ids)} tokens) leaves no room for output"
                f" within max_model_len={self._info.max_model_len}"
            )
        bad = next((i for i in (min(ids), max(ids)) if not 0 <= i < self._info.vocab_size), None)
        if bad is not None:
            raise BackendRequestError(f"token id {bad} is outside the vocabulary of {self._info.vocab_size}")
        k = request.sampling.logprobs
        if k is not None and k > MAX_LOGPROBS:
            raise BackendRequestError(f"logprobs={k} is more than the maximum of {MAX_LOGPROBS}")
        if request.request_id in self._live:
            raise BackendRequestError(f"request {request.request_id!r} is already running")
        return self._reader.read(ids)

    def _kv_role(self, request: BackendRequest) -> str | None:
        """Check a disaggregated-serving handshake the way a KV connector would see it.

        Prefill (`do_remote_decode`): exactly one output token, one choice.
        Decode (`do_remote_prefill`): the params must be a prefill engine's
        answer for this very prompt (its block ids are derived from the tokens).
        """
        params = request.kv_transfer_params
        if not params:
            return None
        if params.get("do_remote_decode"):
            if request.sampling.max_tokens != 1 or request.sampling.n != 1:
                raise BackendRequestError("a prefill request (do_remote_decode) must ask for max_tokens=1 and n=1")
            self.prefills += 1
            return "prefill"
        if params.get("do_remote_prefill"):
            engine = params.get("remote_engine_id")
            if not isinstance(engine, str) or not engine.startswith("sim-"):
                raise BackendRequestError(f"kv_transfer_params name no prefill engine (remote_engine_id={engine!r})")
            if params.get("remote_block_ids") != _kv_blocks(request.prompt_token_ids):
                raise BackendRequestError("kv_transfer_params describe another prompt's KV blocks (remote_block_ids)")
            self.remote_decodes += 1
            return "decode"
        return None

    def _handover(self, request: BackendRequest) -> dict[str, object]:
        """What a prefill engine's connector returns for the decode engine to pull the KV cache."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": _kv_blocks(request.prompt_token_ids),
            "remote_host": "127.0.0.1",
            "remote_port": 0,
            "tp_size": 1,
        }

    def _register(self, request_id: str) -> _Live:
        live = _Live(request_id)
        self._live[request_id] = live
        return live

    def _rules(self, request: BackendRequest, prompt_len: int) -> _Rules:
        sampling = request.sampling
        eos = request.eos_token_ids or frozenset(self._eos)
        preferred = next((i for i in self._eos if i in eos), min(eos, default=None))
        room = self._info.max_model_len - prompt_len
        limit = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        k = sampling.logprobs
        return _Rules(
            eos=frozenset() if sampling.ignore_eos else eos,
            emitted_eos=None if sampling.ignore_eos else preferred,
            stops=frozenset(sampling.stop_token_ids or ()),
            min_tokens=sampling.min_tokens,
            limit=limit,
            logprobs=None if k is None else (MAX_LOGPROBS if k < 0 else k),
        )

    def _choices(self, request: BackendRequest, prompt: _Prompt) -> list[_Choice]:
        rules = self._rules(request, len(prompt.ids))
        logprobs = _Logprobs(rules.logprobs or 0, self._info.vocab_size)
        digest = hashlib.blake2b(array("I", prompt.ids).tobytes(), digest_size=16).digest()
        shared = self._shared_plan(prompt)
        choices: list[_Choice] = []
        for index in range(request.sampling.n):
            rng = random.Random(self._seed(request.sampling.seed, digest, index))
            if shared is not None:
                plan = shared
            elif self._config.mode == "agent":
                plan = self._agent_plan(prompt, rng)
            else:
                plan = self._auto_plan(prompt, rng, request.sampling.structured_outputs)
            choices.append(_Choice(index, plan, self._words.padding(rng), rules, logprobs))
        return choices

    def _seed(self, request_seed: int | None, digest: bytes, index: int) -> int:
        key = f"{self._config.seed}:{request_seed}:{index}:".encode() + digest
        return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "big")

    # -- plans (ids before the token rules) ----------------------------------

    def _shared_plan(self, prompt: _Prompt) -> list[int] | None:
        """The plan every choice shares in echo and script mode; None in auto mode."""
        if self._config.mode == "echo":
            return self._encode(self._reader.last_user_text(prompt.ids))
        if self._config.mode == "script":
            plan = self._script[self._script_turn % len(self._script)]
            self._script_turn += 1
            return plan
        return None

    def _auto_plan(self, prompt: _Prompt, rng: random.Random, constraint: StructuredOutputs | None) -> list[int]:
        if prompt.open_call is not None and prompt.tools:
            return self._finish_call(prompt.open_call, prompt.tools, rng)
        plan: list[int] = []
        if prompt.thinking_open and self._think_open is not None:
            plan += self._reasoning(rng)  # a constraint holds after reasoning ends, as in vLLM
        if constraint is not None:
            # Constrained output starts right where reasoning ends: no whitespace a grammar would refuse.
            while plan and self._reader.decode(plan[-1:]).isspace():
                plan.pop()
            plan += self._encode(_constrained_text(constraint, rng))
        elif prompt.tools:
            plan += self._tool_call(prompt.tools, rng)
        else:
            plan += self._content(rng)
        return plan

    def _agent_plan(self, prompt: _Prompt, rng: random.Random) -> list[int]:
        plan = self._reasoning(rng) if prompt.thinking_open and self._think_open is not None else []
        results = _tool_results(self._reader.last_user_text(prompt.ids))
        if results:
            return plan + self._encode(self._write_content(AGENT_ANSWER + "\n".join(results)))
        offered = {tool["name"] for tool in prompt.tools}
        name = next((name for name in self._config.agent_calls if name in offered), None)
        if name is None:
            return plan + self._encode(self._write_content(self._reader.decode(self._content(rng))))
        return plan + self._encode(self._write_calls([ToolCallText(name, self._config.agent_calls[name])]))

    def _reasoning(self, rng: random.Random) -> list[int]:
        assert self._think_open is not None
        if not self._config.reasoning:
            return self._empty_reasoning
        words = self._words.sentences(rng, rng.randint(*_REASONING_WORDS), start=True)
        return self._think_open + [i for piece in words for i in piece] + self._think_close

    def _tool_call(self, tools: tuple[dict[str, Any], ...], rng: random.Random) -> list[int]:
        tool = tools[rng.randrange(len(tools))]
        return self._encode(self._write_calls([self._fake_call(tool, rng)]))

    def _finish_call(self, opened: str, tools: tuple[dict[str, Any], ...], rng: random.Random) -> list[int]:
        """Continue a call the prompt opened: the named tool if only it fits the opening, else one of them."""
        opening = _TOOL_CALL_START + opened
        calls = [self._write_calls([self._fake_call(tool, rng)]) for tool in tools]
        fitting = [text for text in calls if text.startswith(opening)]
        if len(fitting) != 1:
            fitting = [calls[rng.randrange(len(calls))]]
        return self._encode(fitting[0].removeprefix(opening))

    @staticmethod
    def _fake_call(tool: dict[str, Any], rng: random.Random) -> ToolCallText:
        return ToolCallText(tool["name"], _fake_arguments(tool.get("parameters"), rng))

    def _content(self, rng: random.Random) -> list[int]:
        if self._config.output_tokens is not None:
            return self._words.exactly(rng, self._config.output_tokens)
        words = self._words.sentences(rng, rng.randint(*_CONTENT_WORDS), start=True)
        return [i for piece in words for i in piece]

    async def _wait(self, live: _Live, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Sleep until `deadline` on a loop timer; an abort wakes it early."""
        if live.aborted:
            return  # aborted while the consumer held the stream between steps
        if deadline <= loop.time():
            await asyncio.sleep(0)  # still yield, so aborts and other requests run between steps
            return
        waiter: asyncio.Future[None] = loop.create_future()
        handle = loop.call_at(deadline, _wake, waiter)
        live.waiter = waiter
        try:
            await waiter
        finally:
            handle.cancel()
            live.waiter = None


KV_BLOCK_TOKENS = 16


def _kv_blocks(ids: Sequence[int]) -> list[int]:
    """Stand-in KV block ids: one per 16 prompt tokens, derived from the tokens they hold."""
    data = array("I", ids).tobytes()
    step = KV_BLOCK_TOKENS * 4
    return [zlib.crc32(data[i : i + step]) for i in range(0, len(data), step)]
