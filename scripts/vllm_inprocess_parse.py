"""Measure vLLM 0.32's own in-process detokenize + parse cost on a token stream.

Run it with the vLLM venv's python (``scripts/setup_vllm.sh`` prints it), never
the project's::

    "$VLLM_PY" scripts/vllm_inprocess_parse.py INPUT.json > result.json

INPUT.json::

    {"tokenizer": "<dir>", "prompt_token_ids": [...], "output_token_ids": [...],
     "tools": [<OpenAI tool dicts>], "enable_thinking": true, "repeats": 3,
     "messages": [...]?,          # optional, only carried in the request
     "events_path": "<file>"?}    # optional: write tier (iii)'s SSE events there

The stream is fed one token per chunk, as the coupled ``/v1/chat/completions``
server sees it with ``--reasoning-parser qwen3 --tool-call-parser hermes
--enable-auto-tool-choice``. Every object below is vLLM's own; nothing is
reimplemented except the few lines of ``chat_completion_stream_generator``
that glue them together (mirrored in ``ServingStream``):

- tokenizer: ``vllm.tokenizers.get_tokenizer(dir)`` (a cached HF
  ``TokenizersBackend``), as the server loads it.
- request: ``ChatCompletionRequest(stream=True, tools=..., tool_choice="auto",
  chat_template_kwargs={"enable_thinking": ...})``; chat template kwargs via
  ``request.build_chat_params(...)``; the parser class via
  ``ParserManager.get_parser(tool_parser_name="hermes",
  reasoning_parser_name="qwen3", enable_auto_tools=True)``, i.e. a
  ``DelegatingParser`` over ``Qwen3ParserReasoningAdapter`` (the ParserEngine
  one) and the legacy ``Hermes2ProToolParser``. As the renderer does, one
  parser instance runs ``adjust_request`` (which sets
  ``skip_special_tokens=False``) before ``request.to_sampling_params``; then
  ``SamplingParams.update_from_generation_config`` adds the EOS ids as the
  input processor does.
- detokenizer: ``IncrementalDetokenizer.from_new_request`` on an
  ``EngineCoreRequest`` -> ``FastIncrementalDetokenizer`` (tokenizers
  ``DecodeStream`` primed with the prompt); per chunk ``update([id],
  stop_terminated)`` and ``get_next_output_text(finished, delta=True)``.
- parse: per chunk ``parser.parse_delta(delta_text, delta_token_ids, request,
  prompt_token_ids, finished=...)`` -- the only parser call the 0.32 serving
  layer makes while streaming (``DelegatingParser.parse_delta`` keeps the
  previous_text/current_text/token-id bookkeeping itself).
- chunk: ``ChatCompletionResponseStreamChoice`` + ``ChatCompletionStreamResponse``
  + ``maybe_filter_parallel_tool_calls`` + ``model_dump_json(exclude_unset=True)``
  + the SSE framing, the tool_calls finish-reason rewrite, the first role
  chunk and ``count_reasoning_tokens`` at the end, as the serving code does.

Timed tiers (``time.thread_time`` around the whole per-token loop; per-request
setup such as parser and detokenizer construction is outside and reported as
``setup_s``): ``detok`` (i), ``detok_parse`` (ii), ``detok_parse_serialize``
(iii), and ``output_processor_parse_serialize``: (iii) with the detokenizer
driven through vLLM's ``OutputProcessor.process_outputs`` (``EngineCoreOutput``
in, ``RequestOutput`` out through a ``RequestOutputCollector``, with
``log_stats`` on and a fresh ``IterationStats`` per step, as ``AsyncLLM``'s
output handler does).

What is NOT reproduced, because it only exists inside a running server:
ZMQ receive and msgspec decode of ``EngineCoreOutputs``; the asyncio hand-off
between ``AsyncLLM``'s output-handler task and ``generate()``; the stat
loggers' ``record`` (Prometheus); FastAPI/Starlette ``StreamingResponse`` and
uvicorn writing the bytes. The system fingerprint on the final chunk is a
stand-in string of the real shape (the real one hashes the ``VllmConfig``).
Tool-call ids are random per run (``chatcmpl-tool-<hex>``), as in vLLM.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REASONING_PARSER = "qwen3"
TOOL_PARSER = "hermes"
MODEL_NAME = "onehop-bench"
# Placeholder request id; vLLM uses chatcmpl-<16 hex> (random_uuid), same length.
REQUEST_ID = "chatcmpl-" + "0" * 16


@dataclass(frozen=True)
class Spec:
    """The decoded input file."""

    tokenizer: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    tools: list[dict[str, Any]]
    enable_thinking: bool
    repeats: int
    messages: list[dict[str, Any]]
    events_path: str | None


@dataclass
class Env:
    """Per-run vLLM objects shared by every tier (all immutable during a run)."""

    tokenizer: Any
    parser_cls: type
    request: Any
    chat_template_kwargs: dict[str, Any]
    sampling_params: Any
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | None


@dataclass
class Tier:
    """Best-of-repeats CPU seconds for one tier and the chunks it produced."""

    cpu_s: float = float("inf")
    setup_s: float = float("inf")
    output: list[Any] = field(default_factory=list)


def load_spec(path: Path) -> Spec:
    raw = json.loads(path.read_text(encoding="utf-8"))
    return Spec(
        tokenizer=raw["tokenizer"],
        prompt_token_ids=list(raw["prompt_token_ids"]),
        output_token_ids=list(raw["output_token_ids"]),
        tools=list(raw.get("tools") or []),
        enable_thinking=bool(raw.get("enable_thinking", True)),
        repeats=max(1, int(raw.get("repeats", 3))),
        messages=list(raw.get("messages") or [{"role": "user", "content": "(benchmark)"}]),
        events_path=raw.get("events_path"),
    )


def read_generation_config(tokenizer_dir: str) -> dict[str, Any]:
    path = Path(tokenizer_dir) / "generation_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def build_env(spec: Spec) -> Env:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(spec.tokenizer)
    parser_cls = ParserManager.get_parser(
        tool_parser_name=TOOL_PARSER,
        reasoning_parser_name=REASONING_PARSER,
        enable_auto_tools=True,
        model_name=MODEL_NAME,
        tokenizer=tokenizer,
    )
    request = ChatCompletionRequest(
        model=MODEL_NAME,
        messages=spec.messages,
        tools=spec.tools or None,
        tool_choice="auto" if spec.tools else None,
        stream=True,
        chat_template_kwargs={"enable_thinking": spec.enable_thinking},
    )
    chat_template_kwargs = request.build_chat_params(None, "auto").chat_template_kwargs
    # The renderer's adjust_request: hermes/qwen3 set skip_special_tokens=False.
    request = parser_cls(
        tokenizer, request.tools, chat_template_kwargs=chat_template_kwargs
    ).adjust_request(request=request)
    sampling_params = request.to_sampling_params(len(spec.output_token_ids), {})
    sampling_params.update_from_generation_config(
        read_generation_config(spec.tokenizer), tokenizer.eos_token_id
    )
    token_ids, finish_reason, stop_reason = cut_at_stop(spec.output_token_ids, sampling_params)
    return Env(
        tokenizer,
        parser_cls,
        request,
        chat_template_kwargs,
        sampling_params,
        token_ids,
        finish_reason,
        stop_reason,
    )


def cut_at_stop(ids: Sequence[int], params: Any) -> tuple[list[int], str, int | None]:
    """Apply the scheduler's ``check_stop``: the first EOS/stop id ends the stream."""
    stop_ids = set(params.stop_token_ids or ())
    for i, tid in enumerate(ids):
        if tid == params.eos_token_id:
            return list(ids[: i + 1]), "stop", None
        if tid in stop_ids:
            return list(ids[: i + 1]), "stop", tid
    return list(ids), "length", None


def engine_request(env: Env, prompt_ids: list[int]) -> Any:
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=REQUEST_ID,
        prompt_token_ids=list(prompt_ids),
        mm_features=None,
        sampling_params=env.sampling_params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=REQUEST_ID,
    )


def new_parser(env: Env) -> Any:
    return env.parser_cls(
        env.tokenizer, env.request.tools, chat_template_kwargs=env.chat_template_kwargs
    )


class ServingStream:
    """The per-chunk body of 0.32's ``chat_completion_stream_generator`` for n=1,
    no logprobs, no usage options, output logging off -- vLLM classes, same order."""

    def __init__(self, env: Env, parser: Any) -> None:
        from vllm import __version__
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionNamedToolChoiceParam,
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )
        from vllm.entrypoints.serve.utils.tool_calls_utils import (
            maybe_filter_parallel_tool_calls,
        )

        self._choice_cls = ChatCompletionResponseStreamChoice
        self._chunk_cls = ChatCompletionStreamResponse
        self._delta_cls = DeltaMessage
        self._filter = maybe_filter_parallel_tool_calls
        self.request = env.request
        self.parser = parser
        self.created = int(time.time())
        self.fingerprint = f"vllm-{__version__}-00000000"
        self.named_tool = isinstance(env.request.tool_choice, ChatCompletionNamedToolChoiceParam)
        self.tools_streamed = False
        self.previous_text = ""
        self.previous_num_tokens = 0
        self.generated_token_ids: list[int] = []
        self.reasoning_tokens = 0

    def _frame(self, choice: Any) -> str:
        chunk = self._chunk_cls(
            id=REQUEST_ID,
            object="chat.completion.chunk",
            created=self.created,
            choices=[choice],
            model=MODEL_NAME,
        )
        if self.fingerprint is not None and choice.finish_reason is not None:
            chunk.system_fingerprint = self.fingerprint
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    def first(self) -> str:
        role = self._delta_cls(role="assistant", content="")
        choice = self._choice_cls(index=0, delta=role, logprobs=None, finish_reason=None)
        chunk = self._chunk_cls(
            id=REQUEST_ID,
            object="chat.completion.chunk",
            created=self.created,
            choices=[choice],
            model=MODEL_NAME,
            prompt_token_ids=None,
            prompt_text=None,
        )
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    def chunk(
        self,
        delta_text: str,
        token_ids: list[int],
        prompt_ids: list[int],
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> str | None:
        """One engine output -> one SSE event (or None when serving sends nothing)."""
        delta = self.parser.parse_delta(
            delta_text=delta_text,
            delta_token_ids=token_ids,
            request=self.request,
            prompt_token_ids=prompt_ids,
            finished=finish_reason is not None,
        )
        if delta is not None and delta.tool_calls:
            self.tools_streamed = True
        self.previous_text += delta_text
        self.previous_num_tokens += len(token_ids)
        self.generated_token_ids.extend(token_ids)
        if delta is None:
            if finish_reason is None:
                return None
            delta = self._delta_cls()
        if finish_reason is None:
            choice = self._choice_cls(
                index=0, delta=delta, logprobs=None, finish_reason=None, token_ids=None
            )
        else:
            if self.tools_streamed and not self.named_tool and finish_reason == "stop":
                finish_reason = "tool_calls"
            choice = self._choice_cls(
                index=0,
                delta=delta,
                logprobs=None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                token_ids=None,
            )
        return self._frame(self._filter(choice, self.request))

    def close(self) -> str:
        self.reasoning_tokens = self.parser.count_reasoning_tokens(tuple(self.generated_token_ids))
        return "data: [DONE]\n\n"


def finish_at(env: Env, i: int) -> tuple[str | None, int | None]:
    return (env.finish_reason, env.stop_reason) if i == len(env.token_ids) - 1 else (None, None)


def chunks_of(env: Env) -> list[tuple[list[int], bool, bool]]:
    """(delta_token_ids, finished, stop_terminated) per chunk, built before timing."""
    last = len(env.token_ids) - 1
    return [
        ([tid], i == last, i == last and env.finish_reason == "stop")
        for i, tid in enumerate(env.token_ids)
    ]


def run_detok(env: Env, spec: Spec) -> tuple[float, float, list[Any]]:
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    chunks = chunks_of(env)
    t0 = time.thread_time()
    request = engine_request(env, spec.prompt_token_ids)
    detok = IncrementalDetokenizer.from_new_request(env.tokenizer, request)
    setup = time.thread_time() - t0
    out: list[Any] = []
    gc.collect()
    t0 = time.thread_time()
    for ids, finished, stop_terminated in chunks:
        detok.update(ids, stop_terminated)
        out.append(detok.get_next_output_text(finished, True))
    return time.thread_time() - t0, setup, out


def run_detok_parse(env: Env, spec: Spec) -> tuple[float, float, list[Any]]:
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    chunks = chunks_of(env)
    request, prompt = env.request, spec.prompt_token_ids
    t0 = time.thread_time()
    detok = IncrementalDetokenizer.from_new_request(env.tokenizer, engine_request(env, prompt))
    parser = new_parser(env)
    setup = time.thread_time() - t0
    out: list[Any] = []
    gc.collect()
    t0 = time.thread_time()
    for ids, finished, stop_terminated in chunks:
        detok.update(ids, stop_terminated)
        text = detok.get_next_output_text(finished, True)
        out.append(
            parser.parse_delta(
                delta_text=text,
                delta_token_ids=ids,
                request=request,
                prompt_token_ids=prompt,
                finished=finished,
            )
        )
    return time.thread_time() - t0, setup, out


def run_detok_parse_serialize(env: Env, spec: Spec) -> tuple[float, float, list[Any]]:
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    chunks = chunks_of(env)
    prompt = spec.prompt_token_ids
    t0 = time.thread_time()
    detok = IncrementalDetokenizer.from_new_request(env.tokenizer, engine_request(env, prompt))
    serving = ServingStream(env, new_parser(env))
    setup = time.thread_time() - t0
    events: list[Any] = []
    gc.collect()
    t0 = time.thread_time()
    events.append(serving.first())
    for i, (ids, finished, stop_terminated) in enumerate(chunks):
        detok.update(ids, stop_terminated)
        text = detok.get_next_output_text(finished, True)
        finish_reason, stop_reason = finish_at(env, i)
        if (event := serving.chunk(text, ids, prompt, finish_reason, stop_reason)) is not None:
            events.append(event)
    events.append(serving.close())
    return time.thread_time() - t0, setup, events


def run_output_processor(env: Env, spec: Spec) -> tuple[float, float, list[Any]]:
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats

    prompt = spec.prompt_token_ids
    last = len(env.token_ids) - 1
    final = FinishReason.STOP if env.finish_reason == "stop" else FinishReason.LENGTH
    outputs = [
        EngineCoreOutput(
            request_id=REQUEST_ID,
            new_token_ids=[tid],
            finish_reason=final if i == last else None,
            stop_reason=env.stop_reason if i == last else None,
        )
        for i, tid in enumerate(env.token_ids)
    ]
    t0 = time.thread_time()
    processor = OutputProcessor(env.tokenizer, log_stats=True, stream_interval=1)
    queue = RequestOutputCollector(env.sampling_params.output_kind, REQUEST_ID)
    processor.add_request(engine_request(env, prompt), None, None, 0, queue)
    serving = ServingStream(env, new_parser(env))
    setup = time.thread_time() - t0
    stamp = time.monotonic()
    events: list[Any] = []
    gc.collect()
    t0 = time.thread_time()
    for i, eco in enumerate(outputs):
        processor.process_outputs([eco], stamp, IterationStats())
        res = queue.get_nowait()
        if i == 0:
            events.append(serving.first())
        out = res.outputs[0]
        event = serving.chunk(
            out.text, out.token_ids, res.prompt_token_ids, out.finish_reason, out.stop_reason
        )
        if event is not None:
            events.append(event)
    events.append(serving.close())
    return time.thread_time() - t0, setup, events


RunFn = Callable[[Env, Spec], tuple[float, float, list[Any]]]


def best_of(run: RunFn, env: Env, spec: Spec) -> Tier:
    tier = Tier()
    for _ in range(spec.repeats):
        cpu, setup, output = run(env, spec)
        if cpu < tier.cpu_s:
            tier.cpu_s, tier.output = cpu, output
        tier.setup_s = min(tier.setup_s, setup)
    return tier


class Assembly:
    """Client-side accumulation of streamed deltas (dicts, as a client decodes them)."""

    def __init__(self) -> None:
        self.reasoning: str | None = None
        self.content: str | None = None
        self.content_pieces: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.with_delta = 0
        self.finish_reason: str | None = None

    def add(self, delta: dict[str, Any]) -> None:
        nonempty = False
        if (reasoning := delta.get("reasoning")) is not None:
            self.reasoning = (self.reasoning or "") + reasoning
            nonempty = nonempty or bool(reasoning)
        if (content := delta.get("content")) is not None:
            self.content = (self.content or "") + content
            if content:
                self.content_pieces.append(content)
                nonempty = True
        for tc in delta.get("tool_calls") or []:
            nonempty = True
            empty = {"id": None, "name": None, "arguments": ""}
            slot = self.tool_calls.setdefault(tc["index"], empty)
            slot["id"] = slot["id"] or tc.get("id")
            fn = tc.get("function") or {}
            slot["name"] = slot["name"] or fn.get("name")
            slot["arguments"] += fn.get("arguments") or ""
        self.with_delta += nonempty

    def result(self) -> dict[str, Any]:
        return {
            "reasoning": self.reasoning,
            "content": self.content,
            "content_pieces_head": self.content_pieces[:8],
            "tool_calls": [self.tool_calls[k] for k in sorted(self.tool_calls)],
            "finish_reason": self.finish_reason,
            "n_chunks_with_delta": self.with_delta,
        }


def assemble_deltas(deltas: Sequence[Any]) -> dict[str, Any]:
    acc = Assembly()
    for delta in deltas:
        if delta is not None:
            acc.add(json.loads(delta.model_dump_json(exclude_unset=True)))
    return acc.result()


def assemble_events(events: Sequence[str]) -> dict[str, Any]:
    acc = Assembly()
    n_events = 0
    first_role_chunk: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    for event in events:
        body = event.removeprefix("data: ").rstrip("\n")
        if body == "[DONE]":
            continue
        n_events += 1
        last = json.loads(body)
        choice = last["choices"][0]
        if first_role_chunk is None:
            first_role_chunk = choice["delta"]
        acc.add(choice["delta"])
        acc.finish_reason = choice.get("finish_reason") or acc.finish_reason
    result = acc.result()
    result["n_events"] = n_events
    result["first_delta"] = first_role_chunk
    result["last_event"] = last
    return result


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """Drop random tool-call ids; the role chunk's ``content: ""`` equals no content."""
    calls = [{"name": c["name"], "arguments": c["arguments"]} for c in result["tool_calls"]]
    return {
        "reasoning": result["reasoning"] or None,
        "content": result["content"] or None,
        "n_chunks_with_delta": result["n_chunks_with_delta"],
        "tool_calls": calls,
    }


def measure(spec: Spec) -> dict[str, Any]:
    import vllm

    env = build_env(spec)
    n = len(env.token_ids)
    tiers = {
        "detok": best_of(run_detok, env, spec),
        "detok_parse": best_of(run_detok_parse, env, spec),
        "detok_parse_serialize": best_of(run_detok_parse_serialize, env, spec),
        "output_processor_parse_serialize": best_of(run_output_processor, env, spec),
    }
    wire = assemble_events(tiers["detok_parse_serialize"].output)
    full = assemble_events(tiers["output_processor_parse_serialize"].output)
    parsed = assemble_deltas(tiers["detok_parse"].output)
    text = "".join(tiers["detok"].output)
    if spec.events_path:
        Path(spec.events_path).write_text(
            "".join(tiers["detok_parse_serialize"].output), encoding="utf-8"
        )
    return {
        "vllm_version": vllm.__version__,
        "n_tokens": n,
        "n_tokens_input": len(spec.output_token_ids),
        "finish_reason_engine": env.finish_reason,
        "skip_special_tokens": env.sampling_params.skip_special_tokens,
        "cpu_s": {name: tier.cpu_s for name, tier in tiers.items()},
        "per_token_us": {name: tier.cpu_s / n * 1e6 for name, tier in tiers.items()},
        "setup_s": {name: tier.setup_s for name, tier in tiers.items()},
        "repeats": spec.repeats,
        "result": wire,
        "detok_text_len": len(text),
        "detok_text_tail": text[-200:],
        "parity": {
            "parse_delta_vs_wire": comparable(parsed) == comparable(wire),
            "output_processor_vs_wire": comparable(full) == comparable(wire),
        },
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    report = measure(load_spec(Path(argv[0])))
    json.dump(report, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
