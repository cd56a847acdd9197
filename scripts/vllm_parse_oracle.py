"""vLLM 0.32's answer for a token stream: the parity oracle for onehop's parsers.

Run it with the vLLM venv's python (``scripts/setup_vllm.sh`` prints it), never
the project's::

    "$VLLM_PY" scripts/vllm_parse_oracle.py CASES.json > RESULTS.json
    "$VLLM_PY" scripts/vllm_parse_oracle.py --serve   # a CASES list per stdin line, a RESULTS line each

CASES.json is a list of cases::

    {"tokenizer": DIR, "tool_parser": NAME|null, "reasoning_parser": NAME|null,
     "tools": [<OpenAI tool dicts>], "tool_choice": "auto"|"none"|"required"|{...}?,
     "parallel_tool_calls": bool|null, "chat_template_kwargs": {...},
     "prompt_token_ids": [...], "output_token_ids": [...], "stop": [strings],
     "chunkings": [[sizes...], ...], "messages": [...]?,
     "model_type": "gpt_oss"|"kimi_k2"|...?,   # hf_config.model_type stand-in
     "enable_auto_tools": true?,               # --enable-auto-tool-choice
     "request": {...}?}                        # more request fields, as sent

and RESULTS.json the same-length list of ``{"stream": [answer per chunking],
"full": answer, "vllm_version": ...}``, where an answer is ``{"reasoning",
"content", "tool_calls": [{"id", "name", "arguments"}], "finish_reason",
"stop_reason", "reasoning_tokens"}`` and stream tool calls also carry
``header_deltas`` (how many deltas named the call). A stream folds the SSE
deltas as a client does: joined text, ``null`` when none; calls folded by
index. Anything vLLM raises becomes ``{"error": ...}`` in place of that
answer (or of the whole case), so one bad case never hides the others.

Why an oracle and not a server: the parsers are pure functions of the token
stream, so driving vLLM's own objects in-process gives the coupled
``/v1/chat/completions`` answer for any chunking, deterministically, in a
fraction of a second per case. Every object is vLLM's; only the glue of
``chat_completion_stream_generator`` / ``chat_completion_full_generator``
(serving.py) and of the renderer's ``adjust_request`` call is mirrored, in
the same order:

- tokenizer ``vllm.tokenizers.get_tokenizer``; parser class
  ``ParserManager.get_parser`` (``is_harmony`` when ``model_type`` is
  ``gpt_oss``); a ``model_config`` stand-in carrying only ``model_type``
  (parsers read it for the tool-call id type, e.g. Kimi's ``functions.x:0``).
- request ``ChatCompletionRequest``; the renderer's ``adjust_request`` on its
  own parser instance (skipped, as there, for ``tool_choice="none"`` without a
  reasoning parser; ``adjust_harmony_request`` for Harmony). Like the server,
  the serving layer keeps its own request object, so only in-place changes
  reach sampling. ``to_sampling_params`` then
  ``update_from_generation_config`` with the folder's generation_config.json.
- scheduler: the first EOS / stop-token id ends the output (``check_stop``);
  without one the stream ends with ``length`` after the last token.
- engine outputs: one ``EngineCoreOutput`` per chunk through vLLM's
  ``OutputProcessor`` (so ``IncrementalDetokenizer.update(ids,
  stop_terminated)``, ``check_stop_strings``, the stop-string token trim and
  ``get_next_output_text`` are vLLM's own), then one ``parse_delta`` with the
  chunk's ids. The non-streaming request gets ``FINAL_ONLY`` outputs fed one
  token per engine step, then ``set_prompt_token_ids`` + ``parse`` and the
  message / finish-reason / tool-call-id rules of the full generator.

Not modelled: logprobs, ``n > 1``, echo, usage chunks, beam search.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# vLLM logs to stdout by default; stdout carries the results.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
# Sibling scripts are imported as scripts.NAME, from the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.vllm_inprocess_parse import cut_at_stop, read_generation_config

MODEL_NAME = "onehop-oracle"
REQUEST_ID = "chatcmpl-" + "0" * 16
DEFAULT_MESSAGES = [{"role": "user", "content": "(oracle)"}]
ERROR_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Case:
    """One decoded input case."""

    tokenizer: str
    tool_parser: str | None
    reasoning_parser: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    chunkings: list[list[int]]
    body: dict[str, Any]
    model_type: str | None
    enable_auto_tools: bool

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Case:
        return cls(
            tokenizer=raw["tokenizer"],
            tool_parser=raw.get("tool_parser"),
            reasoning_parser=raw.get("reasoning_parser"),
            prompt_token_ids=list(raw["prompt_token_ids"]),
            output_token_ids=list(raw["output_token_ids"]),
            chunkings=[list(sizes) for sizes in raw.get("chunkings") or [[1]]],
            body=request_body(raw),
            model_type=raw.get("model_type"),
            enable_auto_tools=bool(raw.get("enable_auto_tools", True)),
        )


def request_body(raw: dict[str, Any]) -> dict[str, Any]:
    """The chat request as a client would send it (the project side builds the same)."""
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": raw.get("messages") or DEFAULT_MESSAGES}
    if raw.get("tools"):
        body["tools"] = raw["tools"]
    for key in ("tool_choice", "parallel_tool_calls", "chat_template_kwargs"):
        if raw.get(key) is not None:
            body[key] = raw[key]
    if raw.get("stop"):
        body["stop"] = list(raw["stop"])
    body.update(raw.get("request") or {})
    return body


@dataclass
class Env:
    """vLLM's per-request objects, as the server holds them after rendering."""

    case: Case
    tokenizer: Any
    parser_cls: type[Any] | None  # a vLLM parser class (vLLM is untyped here), or none configured
    model_config: Any
    request: Any
    chat_template_kwargs: dict[str, Any]
    sampling_params: Any
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | None
    serving_parser: Any = None
    """The full generator's parser: made before rendering, as ``_create_chat_completion`` does."""


_TOKENIZERS: dict[str, Any] = {}


def tokenizer_for(path: str) -> Any:
    from vllm.tokenizers import get_tokenizer

    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = get_tokenizer(path)
    return _TOKENIZERS[path]


def model_config_for(model_type: str | None) -> Any:
    hf_config = SimpleNamespace(model_type=model_type)
    return SimpleNamespace(
        model=MODEL_NAME, hf_config=hf_config, hf_text_config=hf_config, hf_overrides={}, architecture=None
    )


def make_parser(env: Env, chat_template_kwargs: dict[str, Any] | None) -> Any:
    assert env.parser_cls is not None
    return env.parser_cls(
        env.tokenizer, env.request.tools, chat_template_kwargs=chat_template_kwargs, model_config=env.model_config
    )


def build_env(case: Case, *, stream: bool) -> Env:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    tokenizer = tokenizer_for(case.tokenizer)
    is_harmony = case.model_type == "gpt_oss"
    # Not cached: for Harmony, get_parser sets class attributes on HarmonyParser itself.
    parser_cls = ParserManager.get_parser(
        tool_parser_name=case.tool_parser,
        reasoning_parser_name=case.reasoning_parser,
        enable_auto_tools=case.enable_auto_tools,
        model_name=MODEL_NAME,
        is_harmony=is_harmony,
        tokenizer=tokenizer,
    )
    request = ChatCompletionRequest.model_validate({**case.body, "stream": stream})
    env = Env(
        case=case,
        tokenizer=tokenizer,
        parser_cls=parser_cls,
        model_config=model_config_for(case.model_type),
        request=request,
        chat_template_kwargs=request.build_chat_params(None, "auto").chat_template_kwargs,
        sampling_params=None,
        token_ids=[],
        finish_reason="length",
        stop_reason=None,
    )
    if parser_cls is not None:
        env.serving_parser = make_parser(env, env.chat_template_kwargs)
        renderer_adjust(env, is_harmony=is_harmony)
    # The scheduler's length cap is the end of output_token_ids (see engine_outputs).
    params = request.to_sampling_params(max(1, len(case.output_token_ids)), {})
    params.update_from_generation_config(read_generation_config(case.tokenizer), tokenizer.eos_token_id)
    env.sampling_params = params
    env.token_ids, env.finish_reason, env.stop_reason = cut_at_stop(case.output_token_ids, params)
    return env


def renderer_adjust(env: Env, *, is_harmony: bool) -> None:
    """``OnlineRenderer``'s ``adjust_request`` call (its return value is dropped there too)."""
    from vllm.renderers import merge_kwargs

    assert env.parser_cls is not None
    request = env.request
    if is_harmony:
        env.parser_cls(env.tokenizer, request.tools, model_config=env.model_config).adjust_request(request=request)
        return
    should_adjust = (
        env.parser_cls.always_adjust_request
        or env.parser_cls.reasoning_parser_cls is not None
        or getattr(request, "tool_choice", "none") != "none"
    )
    if not should_adjust:
        return
    tool_dicts = None if request.tools is None else [tool.model_dump() for tool in request.tools]
    defaults = merge_kwargs(None, {"tools": tool_dicts, "tokenize": False})
    kwargs = request.build_chat_params(None, "auto").with_defaults(defaults).chat_template_kwargs
    make_parser(env, kwargs).adjust_request(request=request)


def engine_request(env: Env) -> Any:
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=REQUEST_ID,
        prompt_token_ids=list(env.case.prompt_token_ids),
        mm_features=None,
        sampling_params=env.sampling_params.clone(),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=REQUEST_ID,
    )


def split(ids: Sequence[int], sizes: Sequence[int]) -> Iterator[list[int]]:
    """Consecutive chunks of ``ids`` by ``sizes``; the last may be short, sizes repeat if short."""
    position, k = 0, 0
    while position < len(ids):
        width = max(1, int(sizes[k % len(sizes)])) if sizes else 1
        yield list(ids[position : position + width])
        position += width
        k += 1


def engine_outputs(env: Env, sizes: Sequence[int]) -> Iterator[Any]:
    """What the engine core sends: chunks of the scheduler-cut ids, the finish on the last."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    final = FinishReason.STOP if env.finish_reason == "stop" else FinishReason.LENGTH
    chunks = list(split(env.token_ids, sizes))
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        yield EngineCoreOutput(
            request_id=REQUEST_ID,
            new_token_ids=ids,
            finish_reason=final if last else None,
            stop_reason=env.stop_reason if last else None,
        )


def request_outputs(env: Env, sizes: Sequence[int]) -> Iterator[Any]:
    """``RequestOutput``s as ``AsyncLLM.generate`` yields them, via vLLM's ``OutputProcessor``."""
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats

    processor = OutputProcessor(env.tokenizer, log_stats=True, stream_interval=1)
    queue = RequestOutputCollector(env.sampling_params.output_kind, REQUEST_ID)
    processor.add_request(engine_request(env), None, None, 0, queue)
    for eco in engine_outputs(env, sizes):
        processor.process_outputs([eco], time.monotonic(), IterationStats())
        res = queue.get_nowait()
        if res is None:
            continue
        yield res
        if res.finished:
            return


@dataclass
class CallFold:
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    header_deltas: int = 0


@dataclass
class StreamFold:
    """A client's accumulation of the streamed deltas (the dicts on the wire)."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: dict[int, CallFold] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reasoning_tokens: int | None = None

    def add(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            self.reasoning.append(delta["reasoning"])
        if delta.get("content"):
            self.content.append(delta["content"])
        for tc in delta.get("tool_calls") or []:
            call = self.calls.setdefault(tc["index"], CallFold())
            call.id = call.id or tc.get("id")
            fn = tc.get("function") or {}
            if fn.get("name") is not None:
                call.name = call.name or fn["name"]
                call.header_deltas += 1
            call.arguments += fn.get("arguments") or ""
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def answer(self) -> dict[str, Any]:
        return {
            "reasoning": "".join(self.reasoning) or None,
            "content": "".join(self.content) or None,
            "tool_calls": [
                {"id": c.id, "name": c.name, "arguments": c.arguments, "header_deltas": c.header_deltas}
                for _, c in sorted(self.calls.items())
            ],
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "reasoning_tokens": self.reasoning_tokens,
        }


def stream_answer(case: Case, sizes: Sequence[int]) -> dict[str, Any]:
    """The per-output body of ``chat_completion_stream_generator`` for n=1, folded."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
    from vllm.utils.collection_utils import as_list

    env = build_env(case, stream=True)
    request = env.request
    parser = make_parser(env, env.chat_template_kwargs) if env.parser_cls is not None else None
    named_tool = isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)
    counts_reasoning = bool(case.reasoning_parser)
    fold = StreamFold()
    tools_streamed = False
    previous_num_tokens = 0
    generated: list[int] = []
    for res in request_outputs(env, sizes):
        output = res.outputs[0]
        delta_text = output.text
        if not delta_text and not output.token_ids and not previous_num_tokens:
            continue
        if parser is not None:
            delta = parser.parse_delta(
                delta_text=delta_text,
                delta_token_ids=as_list(output.token_ids),
                request=request,
                prompt_token_ids=res.prompt_token_ids,
                finished=output.finish_reason is not None,
            )
            if delta is not None and delta.tool_calls:
                tools_streamed = True
        else:
            delta = DeltaMessage(content=delta_text)
        previous_num_tokens += len(output.token_ids)
        if parser is not None and counts_reasoning:
            generated.extend(output.token_ids)
        if delta is None:
            if output.finish_reason is None:
                continue
            delta = DeltaMessage()
        if output.finish_reason is None:
            choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=None, finish_reason=None)
        else:
            if tools_streamed and not named_tool and output.finish_reason == "stop":
                finish = "tool_calls"
            else:
                finish = output.finish_reason or "stop"
            choice = ChatCompletionResponseStreamChoice(
                index=0, delta=delta, logprobs=None, finish_reason=finish, stop_reason=output.stop_reason
            )
        choice = maybe_filter_parallel_tool_calls(choice, request)
        chunk = ChatCompletionStreamResponse(
            id=REQUEST_ID, object="chat.completion.chunk", created=0, choices=[choice], model=MODEL_NAME
        )
        fold.add(json.loads(chunk.model_dump_json(exclude_unset=True))["choices"][0])
    if counts_reasoning:
        fold.reasoning_tokens = 0
        if parser is not None and generated:
            fold.reasoning_tokens = parser.count_reasoning_tokens(tuple(generated))
    return fold.answer()


def full_answer(case: Case) -> dict[str, Any]:
    """``chat_completion_full_generator`` for n=1: one parse of the final text."""
    from vllm.entrypoints.generate.base.protocol import ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
    from vllm.renderers.chat_utils import make_tool_call_id

    env = build_env(case, stream=False)
    request = env.request
    final = None
    for received in request_outputs(env, [1]):
        final = received
    if final is None:
        raise RuntimeError("no output received from the engine")
    output = final.outputs[0]
    parser = env.serving_parser
    if parser is not None and final.prompt_token_ids is not None:
        parser.set_prompt_token_ids(final.prompt_token_ids)
    reasoning_tokens = None
    if parser is not None:
        reasoning, content, tool_calls = parser.parse(
            output.text, request, enable_auto_tools=case.enable_auto_tools, model_output_token_ids=output.token_ids
        )
        if not request.include_reasoning:
            reasoning = None
        reasoning_tokens = parser.count_reasoning_tokens(output.token_ids)
    else:
        reasoning, content, tool_calls = None, output.text, []
    if case.reasoning_parser:
        reasoning_tokens = reasoning_tokens or 0
    tool_parser_cls = env.parser_cls.tool_parser_cls if env.parser_cls is not None else None
    named = request.tool_choice is not None and type(request.tool_choice) is ChatCompletionNamedToolChoiceParam
    required = request.tool_choice == "required"
    auto_tools_called = False
    calls: list[Any] = []
    if (not case.enable_auto_tools or not tool_parser_cls) and not named and not required:
        pass
    elif named or required:
        content = content or ""
        calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in tool_calls or []]
    elif not request.tool_choice or request.tool_choice == "none":
        pass
    elif request.tools and request.tool_choice in ("auto", None) and case.enable_auto_tools and tool_parser_cls:
        auto_tools_called = tool_calls is not None and len(tool_calls) > 0
        calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in tool_calls or []]
    message = ChatMessage(role="assistant", reasoning=reasoning, content=content, tool_calls=calls)
    tool_calls_finish = auto_tools_called or (
        request.tool_choice and request.tool_choice == "required" and output.finish_reason == "stop"
    )
    choice = ChatCompletionResponseChoice(
        index=0,
        message=message,
        logprobs=None,
        finish_reason="tool_calls" if tool_calls_finish else output.finish_reason or "stop",
        stop_reason=output.stop_reason,
    )
    choice = maybe_filter_parallel_tool_calls(choice, request)
    dumped = json.loads(choice.model_dump_json())
    msg = dumped["message"]
    return {
        "reasoning": msg.get("reasoning"),
        "content": msg.get("content"),
        "tool_calls": [
            {"id": tc["id"], "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            for tc in msg.get("tool_calls") or []
        ],
        "finish_reason": dumped["finish_reason"],
        "stop_reason": dumped.get("stop_reason"),
        "reasoning_tokens": reasoning_tokens,
    }


def error_of(exc: BaseException) -> dict[str, str]:
    text = "".join(traceback.format_exception(exc))
    return {"error": f"{type(exc).__name__}: {exc}\n{text[-ERROR_TAIL_CHARS:]}"}


def guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return dict(fn(*args))
    except Exception as exc:  # the caller needs vLLM's failure as data
        return error_of(exc)


def run_case(raw: dict[str, Any], version: str) -> dict[str, Any]:
    try:
        case = Case.from_json(raw)
    except Exception as exc:
        return {**error_of(exc), "vllm_version": version}
    return {
        "stream": [guarded(stream_answer, case, sizes) for sizes in case.chunkings],
        "full": guarded(full_answer, case),
        "vllm_version": version,
    }


def run(cases: list[dict[str, Any]], out: TextIO) -> None:
    import vllm

    results = [run_case(raw, vllm.__version__) for raw in cases]
    json.dump(results, out, ensure_ascii=False)
    out.write("\n")
    out.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.stdout
    # Anything vLLM or a parser prints must not land in the JSON.
    sys.stdout = sys.stderr
    try:
        if argv[0] == "--serve":
            # One batch per input line, one result line per batch: a test session pays
            # vLLM's import once for every parity module.
            for line in sys.stdin:
                run(json.loads(line), out)
        else:
            run(json.loads(Path(argv[0]).read_text(encoding="utf-8")), out)
    finally:
        sys.stdout = out
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
