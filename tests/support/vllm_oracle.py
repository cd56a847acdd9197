"""Parser parity against vLLM 0.32: run the oracle in vLLM's venv, onehop here, compare.

A case is one token stream plus the request around it (the schema is in
``scripts/vllm_parse_oracle.py``). ``run_oracle`` answers a whole batch of
cases at a time from one oracle process kept for the test session (vLLM's
import alone takes ~15 s); ``onehop_answer`` / ``onehop_full`` give onehop's answer for the same
case in the same dict shape; ``compare`` lists what differs, so a test reads
``assert not compare(ours, theirs)``.

Both sides see the same request body and the same token stream, cut the way
vLLM's scheduler cuts it (the first EOS or stop-token id ends the output; no
such id means ``length``). Stop strings are not applied here: each side
applies them itself, which is what is under test.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import random
import selectors
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from derender.chat import ChatDerender, ChatOptions
from derender.vocab import TokenVocab
from wire.openai_schema import ChatCompletionRequest
from tests.vllm.conftest import ROOT, server_env, vllm_python_path

ORACLE = ROOT / "scripts" / "vllm_parse_oracle.py"
# One vLLM import (~15 s here) plus well under a second per case and chunking, per batch.
ORACLE_TIMEOUT_S = 900.0
STDERR_TAIL_CHARS = 6000
MODEL_NAME = "onehop-oracle"
DEFAULT_MESSAGES = [{"role": "user", "content": "(oracle)"}]
FIXED_SIZES = (1, 2, 5)
RANDOM_SPLITS = 3
MOST_PER_CHUNK = 8
_INVALID = object()


class OracleError(RuntimeError):
    """The oracle subprocess failed as a whole (not one case: those come back as ``error``)."""


def vllm_python() -> str | None:
    """vLLM's venv python (``$ONEHOP_VLLM_PYTHON``, else the default venv), or None if absent."""
    path = vllm_python_path()
    return str(path) if os.access(path, os.X_OK) else None


def run_oracle(cases: list[dict[str, Any]], *, python: str | None = None) -> list[dict[str, Any]]:
    """vLLM's answers for ``cases``, one result per case, in order.

    Every call in a test session goes to one oracle process (``--serve``), so vLLM is
    imported once for all parity modules, not once per module.
    """
    interpreter = python or vllm_python()
    if interpreter is None:
        raise OracleError(f"no vLLM python at {vllm_python_path()}")
    results = _server(interpreter).ask(cases)
    if len(results) != len(cases):
        raise OracleError(f"oracle answered {len(results)} of {len(cases)} cases")
    return results


class _OracleServer:
    """The oracle subprocess in ``--serve`` mode: one JSON line of cases in, one line of results out."""

    def __init__(self, interpreter: str) -> None:
        # The child's stderr goes to a file (a pipe nobody reads could fill and stall it); this
        # process's handle closes once the child holds its own, and close() removes the file.
        fd, name = tempfile.mkstemp(prefix="onehop-oracle-", suffix=".stderr")
        self._stderr = Path(name)
        with os.fdopen(fd, "wb") as stderr:
            self._process = subprocess.Popen(
                [interpreter, str(ORACLE), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=server_env(),
                cwd=ROOT,
            )
        atexit.register(self.close)

    def ask(self, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps(cases, ensure_ascii=False).encode("utf-8") + b"\n")
            process.stdin.flush()
        except BrokenPipeError:
            raise OracleError(f"oracle exited with {process.wait()}:\n{self._tail()}") from None
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(ORACLE_TIMEOUT_S):
                tail = self._tail()  # before close(), which removes the file it reads
                self.close()
                raise OracleError(f"oracle ran past {ORACLE_TIMEOUT_S:.0f} s:\n{tail}")
        line = process.stdout.readline()
        if not line:
            raise OracleError(f"oracle exited with {process.wait()}:\n{self._tail()}")
        try:
            return list(json.loads(line))
        except json.JSONDecodeError as exc:
            raise OracleError(f"oracle printed no JSON ({exc}):\n{self._tail()}") from exc

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._stderr.unlink(missing_ok=True)

    def _tail(self) -> str:
        return _tail(self._stderr.read_bytes())


_SERVERS: dict[str, _OracleServer] = {}


def _server(interpreter: str) -> _OracleServer:
    server = _SERVERS.get(interpreter)
    if server is None or not server.alive():
        server = _SERVERS[interpreter] = _OracleServer(interpreter)
    return server


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return (text or "")[-STDERR_TAIL_CHARS:]


def chunkings(n_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chunk sizes covering ``n_tokens``: all ones, twos, fives, then three seeded random splits (1..8)."""
    fixed = [_fixed(n_tokens, size) for size in FIXED_SIZES]
    rng = random.Random(seed)
    return fixed + [_random_split(n_tokens, rng) for _ in range(RANDOM_SPLITS)]


def _fixed(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


def _random_split(total: int, rng: random.Random) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, MOST_PER_CHUNK), total - sum(sizes)))
    return sizes


# -- onehop's side -------------------------------------------------------------


def request_body(case: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    """The client's request for ``case``: the body the oracle builds, field for field."""
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": case.get("messages") or DEFAULT_MESSAGES}
    if case.get("tools"):
        body["tools"] = case["tools"]
    for key in ("tool_choice", "parallel_tool_calls", "chat_template_kwargs"):
        if case.get(key) is not None:
            body[key] = case[key]
    if case.get("stop"):
        body["stop"] = list(case["stop"])
    body.update(case.get("request") or {})
    return {**body, "stream": stream}


def chat_request(case: dict[str, Any], *, stream: bool) -> ChatCompletionRequest:
    return msgspec.convert(request_body(case, stream=stream), ChatCompletionRequest)


def new_derender(vocab: TokenVocab, case: dict[str, Any], *, stream: bool) -> ChatDerender:
    """onehop's derender for ``case``, built as the gateway builds it.

    ``onehop_reasoning_parser`` / ``onehop_tool_parser`` in the case override the
    vLLM names where onehop registers a parser under another name;
    ``enable_auto_tools: false`` (vLLM then has no tool parser) means none here too.
    """
    reasoning = case.get("onehop_reasoning_parser", case.get("reasoning_parser"))
    tool = case.get("onehop_tool_parser", case.get("tool_parser"))
    if not case.get("enable_auto_tools", True):
        tool = None
    options = ChatOptions.from_request(chat_request(case, stream=stream), reasoning_parser=reasoning, tool_parser=tool)
    return ChatDerender(vocab, options, model=MODEL_NAME, n=1, prompt_token_ids=list(case["prompt_token_ids"]))


@dataclass(frozen=True)
class BackendOutput:
    """What the engine reports: the ids up to the first stop id, and its finish."""

    token_ids: list[int]
    finish_reason: str
    stop_reason: int | None


def backend_output(case: dict[str, Any]) -> BackendOutput:
    """vLLM's scheduler ``check_stop`` on the case's ids, with its EOS rules.

    The tokenizer's EOS is the primary one (``stop_reason`` None); the other
    ``generation_config.json`` EOS ids and the request's ``stop_token_ids`` stop
    with their id as ``stop_reason``; ``ignore_eos`` drops the EOS ids.
    """
    extra = case.get("request") or {}
    primary, generation = eos_ids(case["tokenizer"])
    ignore_eos = bool(extra.get("ignore_eos", False))
    stop_ids = set(extra.get("stop_token_ids") or ())
    if not ignore_eos:
        stop_ids |= set(generation) - {primary}
    eos = None if ignore_eos else primary
    ids = list(case["output_token_ids"])
    for i, token_id in enumerate(ids):
        if token_id == eos:
            return BackendOutput(ids[: i + 1], "stop", None)
        if token_id in stop_ids:
            return BackendOutput(ids[: i + 1], "stop", token_id)
    return BackendOutput(ids, "length", None)


@functools.cache
def eos_ids(tokenizer_dir: str) -> tuple[int | None, tuple[int, ...]]:
    """(the tokenizer's EOS id, the generation config's EOS ids) of a tokenizer folder."""
    from tokenizers import Tokenizer

    folder = Path(tokenizer_dir)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    token = config.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    primary = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(token) if token else None
    generation_path = folder / "generation_config.json"
    generation = json.loads(generation_path.read_text(encoding="utf-8")) if generation_path.is_file() else {}
    listed = generation.get("eos_token_id")
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return primary, tuple(listed)


def split(ids: Sequence[int], sizes: Sequence[int]) -> Iterator[list[int]]:
    """Consecutive chunks of ``ids`` by ``sizes`` (as the oracle splits them)."""
    position, k = 0, 0
    while position < len(ids):
        width = max(1, int(sizes[k % len(sizes)])) if sizes else 1
        yield list(ids[position : position + width])
        position += width
        k += 1


def feed(derender: ChatDerender, output: BackendOutput, sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Step the derender chunk by chunk, the finish on the last; the chunk choices as the wire has them."""
    chunks = list(split(output.token_ids, sizes)) or [[]]
    choices: list[dict[str, Any]] = []
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        chunk = derender.step(
            0,
            ids,
            finish_reason=output.finish_reason if last else None,
            stop_reason=output.stop_reason if last else None,
        )
        if chunk is not None:
            choices.extend(msgspec.to_builtins(chunk.choices))
        if derender.finished:
            break
    return choices


@dataclass
class _Call:
    id: str | None = None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)
    header_deltas: int = 0


def fold(choices: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A client's fold of streamed chunk choices into the answer dict (the oracle's fold)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, _Call] = {}
    finish: tuple[str | None, Any] = (None, None)
    for choice in choices:
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            reasoning.append(delta["reasoning"])
        if delta.get("content"):
            content.append(delta["content"])
        for tc in delta.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], _Call())
            call.id = call.id or tc.get("id")
            fn = tc.get("function") or {}
            if fn.get("name") is not None:
                call.name = call.name or fn["name"]
                call.header_deltas += 1
            call.arguments.append(fn.get("arguments") or "")
        if choice.get("finish_reason") is not None:
            finish = (choice["finish_reason"], choice.get("stop_reason"))
    return {
        "reasoning": "".join(reasoning) or None,
        "content": "".join(content) or None,
        "tool_calls": [
            {"id": c.id, "name": c.name, "arguments": "".join(c.arguments), "header_deltas": c.header_deltas}
            for _, c in sorted(calls.items())
        ],
        "finish_reason": finish[0],
        "stop_reason": finish[1],
    }


def _reasoning_tokens(derender: ChatDerender) -> int | None:
    details = derender.usage().completion_tokens_details
    return None if details is None else details.reasoning_tokens


def onehop_answer(vocab: TokenVocab, case: dict[str, Any], chunking: Sequence[int]) -> dict[str, Any]:
    """onehop's streamed answer for ``case`` fed in ``chunking``, folded as the oracle folds vLLM's."""
    derender = new_derender(vocab, case, stream=True)
    answer = fold(feed(derender, backend_output(case), chunking))
    answer["reasoning_tokens"] = _reasoning_tokens(derender)
    return answer


def onehop_full(vocab: TokenVocab, case: dict[str, Any]) -> dict[str, Any]:
    """onehop's non-streaming answer: every token in one step, then ``response()``."""
    derender = new_derender(vocab, case, stream=False)
    output = backend_output(case)
    feed(derender, output, [max(1, len(output.token_ids))])
    choice = derender.response().choices[0]
    message = msgspec.to_builtins(choice.message)
    return {
        "reasoning": message.get("reasoning"),
        "content": message.get("content"),
        "tool_calls": [
            {"id": tc["id"], "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            for tc in message.get("tool_calls") or []
        ],
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "reasoning_tokens": _reasoning_tokens(derender),
    }


# -- comparing -------------------------------------------------------------------


def id_shape(call_id: str | None) -> str | None:
    """A tool-call id without its random tail: the part before the last ``-`` (else all of it)."""
    if call_id is None:
        return None
    head, dash, _ = call_id.rpartition("-")
    return head if dash else call_id


def compare(
    ours: dict[str, Any],
    theirs: dict[str, Any],
    *,
    id_prefix: bool = True,
    reasoning_tokens: bool = False,
    stop_reason: bool = False,
    json_arguments: bool = True,
    sides: tuple[str, str] = ("onehop", "vLLM"),
) -> list[str]:
    """What differs between onehop's answer and vLLM's, one readable line per difference.

    Text fields treat ``""`` and null alike (a client sees no text either way);
    arguments compare as parsed JSON and must parse on both sides; a stream's
    call must have exactly one header delta on both sides. ``reasoning_tokens``
    and ``stop_reason`` are compared only when asked for. With
    ``json_arguments=False`` (a call cut short) arguments compare as raw text.
    ``sides`` names the two answers in the lines (e.g. ``("vLLM stream", "vLLM full")``).
    """
    a, b = sides
    errors = [f"{side}: {answer['error']}" for side, answer in ((a, ours), (b, theirs)) if "error" in answer]
    if errors:
        return errors
    diffs: list[str] = []
    keys = ["reasoning", "content", "finish_reason"]
    keys += (["reasoning_tokens"] if reasoning_tokens else []) + (["stop_reason"] if stop_reason else [])
    for key in keys:
        mine, other = ours.get(key), theirs.get(key)
        if key in ("reasoning", "content"):
            mine, other = mine or None, other or None
        if mine != other:
            diffs.append(f"{key}: {a} {ours.get(key)!r} != {b} {theirs.get(key)!r}")
    calls = (ours.get("tool_calls") or [], theirs.get("tool_calls") or [])
    diffs += _compare_calls(*calls, id_prefix=id_prefix, json_arguments=json_arguments, sides=sides)
    return diffs


def _compare_calls(
    ours: list[dict[str, Any]],
    theirs: list[dict[str, Any]],
    *,
    id_prefix: bool,
    json_arguments: bool,
    sides: tuple[str, str],
) -> list[str]:
    a, b = sides
    diffs: list[str] = []
    if len(ours) != len(theirs):
        names = ([c.get("name") for c in ours], [c.get("name") for c in theirs])
        diffs.append(f"tool_calls: {a} has {len(ours)} {names[0]}, {b} has {len(theirs)} {names[1]}")
    for side, calls in ((a, ours), (b, theirs)):
        for i, call in enumerate(calls):
            if "header_deltas" in call and call["header_deltas"] != 1:
                diffs.append(f"tool_calls[{i}] {side}: {call['header_deltas']} header deltas, want 1")
            if json_arguments and _parsed(call.get("arguments")) is _INVALID:
                diffs.append(f"tool_calls[{i}] {side}: arguments are not JSON: {call.get('arguments')!r}")
    for i, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
        if mine.get("name") != other.get("name"):
            diffs.append(f"tool_calls[{i}].name: {a} {mine.get('name')!r} != {b} {other.get('name')!r}")
        raw = (mine.get("arguments"), other.get("arguments"))
        parsed = (_parsed(raw[0]), _parsed(raw[1])) if json_arguments else raw
        if _INVALID not in parsed and parsed[0] != parsed[1]:
            diffs.append(f"tool_calls[{i}].arguments: {a} {mine.get('arguments')!r} != {b} {other.get('arguments')!r}")
        if id_prefix and id_shape(mine.get("id")) != id_shape(other.get("id")):
            diffs.append(f"tool_calls[{i}].id: {a} {mine.get('id')!r} != {b} {other.get('id')!r} (shape)")
    return diffs


def _parsed(arguments: str | None) -> Any:
    try:
        return json.loads(arguments or "")
    except json.JSONDecodeError:
        return _INVALID
