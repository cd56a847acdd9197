"""Backend outputs → response bytes, one writer per `output_mode`.

A writer lives for one request and keeps one derender state per choice:
`tokens` (ids and id logprobs, stop strings still checked when text exists),
`text` (vLLM's text mode: text deltas, decoded logprobs) and onehop's
`derender` (finished OpenAI chat or completion objects, or with `present`
another API's: Responses or Anthropic events). Every writer turns
one backend step of one choice into at most one SSE payload (one choice per
event, as vLLM streams) and can also build the non-streaming body.

The engine spends its output CPU here; `engine.generate` times each step
around the writer (and the write after it), so the writers keep no clock.
A streamed request keeps per choice only what its next chunk needs (the
detokenizer, stop strings, parsers, counts); the whole answer — every id,
text delta and logprob — is kept only when the non-streaming body is built.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from engine.backends.base import BackendOutput
from derender.chat import ChatDerender, ChatOptions
from derender.completion import CompletionDerender, CompletionOptions
from derender.logprobs import chat_logprobs
from derender.messages import MessagesAssembler
from derender.messages import error_frame as messages_error_frame
from derender.responses import ResponsesAssembler
from derender.text import TextParams, TextPipeline
from derender.usage import derender_summary, open_choices, summary_of
from wire.openai_schema import ChatLogprobs, PromptTokensDetails, Usage
from wire.protocol import (
    EngineSummary,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateTextChoice,
    GenerateTextResponse,
    GenerateTextStreamChoice,
    GenerateTextStreamResponse,
    GenerateTokensChoice,
    GenerateTokensResponse,
    GenerateTokensStreamChoice,
    GenerateTokensStreamResponse,
    ResponsesPresent,
    SamplingParams,
    encode,
    public_request_id,
)
from engine.vllm_derender import VllmDerenderWriter
from engine.errors import EngineHTTPError
from engine.writer_context import DataFrames, note_cached
from engine.writer_context import WriterContext as WriterContext  # make_writer's argument, for its callers


class OutputWriter(Protocol):
    def head(self) -> list[bytes]:
        """Payloads to stream before any output (chat role chunks)."""

    def step(self, output: BackendOutput) -> bytes | None:
        """One choice's step as one payload, or None when nothing is visible yet."""

    def tail(self) -> list[bytes]:
        """Payloads after every choice finished (the usage chunk)."""

    def body(self) -> bytes:
        """The non-streaming response."""

    def open_choices(self) -> list[int]:
        """Indices of choices that have not finished."""

    def summary(self) -> EngineSummary:
        """Finish reasons and token counts so far (for the trace, and the gateway's)."""

    def frame(self, payload: bytes) -> bytes:
        """A streamed payload as the SSE bytes written."""

    def error_frame(self, error: EngineHTTPError) -> bytes:
        """The SSE bytes that say a stream failed after its first byte."""


def text_params(sampling: SamplingParams) -> TextParams:
    stop = sampling.stop
    return TextParams(
        skip_special_tokens=sampling.skip_special_tokens,
        spaces_between_special_tokens=sampling.spaces_between_special_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        min_tokens=sampling.min_tokens,
    )


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> Usage:
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
    if cached_tokens is not None:
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached_tokens)
    return usage


class _Choices:
    """Per-choice bookkeeping shared by the tokens and text writers."""

    def __init__(self, request: GenerateRequest, context: WriterContext, *, decode: bool) -> None:
        n = request.sampling_params.n
        self.request = request
        self.context = context
        self.keep = not request.stream
        """The body is built at the end: keep every id (a stream only counts them)."""
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.counts = [0] * n
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and bool(options and options.continuous_usage_stats)
        self.kv_transfer_params: dict[str, Any] | None = None
        self.cached_tokens: int | None = None
        """What the backend's first output said its prefix cache held; None: it does not know."""
        self.pipelines: list[TextPipeline] | None = None
        if decode and context.vocab is not None and request.sampling_params.detokenize:
            params = text_params(request.sampling_params)
            self.pipelines = [
                TextPipeline(context.vocab, params, prompt_token_ids=request.token_ids) for _ in range(n)
            ]

    def usage(self) -> Usage:
        return _usage(len(self.request.token_ids), sum(self.counts), self.cached_tokens)

    def open_choices(self) -> list[int]:
        return [i for i, (reason, _) in enumerate(self.finish) if reason is None]

    def advance(self, output: BackendOutput) -> tuple[Sequence[int], str, str | None, int | str | None] | None:
        """Run the choice's text pipeline; (kept ids, text, finish_reason, stop_reason), None if finished."""
        index = output.index
        note_cached(output, self)
        if self.finish[index][0] is not None:
            return None  # a stop string already ended this choice; later ids are dropped
        ids: Sequence[int] = output.token_ids
        finish_reason: str | None = output.finish_reason
        stop_reason: int | str | None = output.stop_reason
        text = ""
        if self.pipelines is not None:
            step = self.pipelines[index].feed(ids, finish_reason=finish_reason, stop_reason=stop_reason)
            ids = ids[: step.kept]
            text = "".join(piece for piece, _ in step.pieces)
            finish_reason, stop_reason = step.finish_reason, step.stop_reason
        self.counts[index] += len(ids)
        if self.keep:
            self.token_ids[index].extend(ids)
        if finish_reason is not None:
            self.finish[index] = (finish_reason, stop_reason)
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        return ids, text, finish_reason, stop_reason


def _kept_logprobs(output: BackendOutput, kept: int) -> list[GenerateLogProbsContent] | None:
    if output.logprobs is None:
        return None
    return output.logprobs[:kept]


class _ModeWriter(DataFrames):
    """The tokens and text writers' shared flow; subclasses build their mode's choices."""

    _stream_type: type[GenerateTokensStreamResponse | GenerateTextStreamResponse]
    _response_type: type[GenerateTokensResponse | GenerateTextResponse]

    def __init__(self, request: GenerateRequest, context: WriterContext, *, decode: bool) -> None:
        self._c = _Choices(request, context, decode=decode)
        self._logprobs: list[list[Any]] = [[] for _ in range(request.sampling_params.n)]

    def head(self) -> list[bytes]:
        return []

    def open_choices(self) -> list[int]:
        return self._c.open_choices()

    def summary(self) -> EngineSummary:
        return summary_of([reason for reason, _ in self._c.finish], self._c.usage())

    def step(self, output: BackendOutput) -> bytes | None:
        advanced = self._c.advance(output)
        if advanced is None:
            return None
        choice = self._stream_choice(output, *advanced)
        if choice is None:
            return None
        chunk = self._stream_type(request_id=self._c.request.request_id, choices=[choice])
        if self._c.continuous:
            chunk.usage = self._c.usage()
        return encode(chunk)

    def tail(self) -> list[bytes]:
        if not self._c.include_usage:
            return []
        return [encode(self._stream_type(request_id=self._c.request.request_id, choices=[], usage=self._c.usage()))]

    def body(self) -> bytes:
        request = self._c.request
        wants_logprobs = request.sampling_params.logprobs is not None
        return encode(
            self._response_type(
                request_id=request.request_id,
                model=self._c.context.model,
                created=int(time.time()),
                usage=self._c.usage(),
                choices=[self._choice(i, ids, wants_logprobs) for i, ids in enumerate(self._c.token_ids)],
                prompt_token_ids=list(request.token_ids) if request.return_token_ids else None,
                kv_transfer_params=self._c.kv_transfer_params,
            )
        )

    def _stream_choice(
        self, output: BackendOutput, ids: Sequence[int], text: str, finish: str | None, stop: int | str | None
    ) -> Any:
        raise NotImplementedError

    def _choice(self, index: int, ids: list[int], wants_logprobs: bool) -> Any:
        raise NotImplementedError


class TokensWriter(_ModeWriter):
    """`output_mode: "tokens"`: ids out; text is only decoded to find stop strings, as vLLM does."""

    _stream_type = GenerateTokensStreamResponse
    _response_type = GenerateTokensResponse

    def __init__(self, request: GenerateRequest, context: WriterContext) -> None:
        super().__init__(request, context, decode=bool(request.sampling_params.stop))

    def _stream_choice(
        self, output: BackendOutput, ids: Sequence[int], text: str, finish: str | None, stop: int | str | None
    ) -> GenerateTokensStreamChoice:
        logprobs = _kept_logprobs(output, len(ids))
        if logprobs is not None and self._c.keep:
            self._logprobs[output.index].extend(logprobs)
        return GenerateTokensStreamChoice(
            index=output.index,
            token_ids=list(ids),
            finish_reason=finish,
            stop_reason=stop,
            logprobs=GenerateLogProbs(content=logprobs) if logprobs is not None else None,
        )

    def _choice(self, index: int, ids: list[int], wants_logprobs: bool) -> GenerateTokensChoice:
        finish, stop = self._c.finish[index]
        return GenerateTokensChoice(
            index=index,
            token_ids=ids,
            finish_reason=finish,
            stop_reason=stop,
            logprobs=GenerateLogProbs(content=self._logprobs[index]) if wants_logprobs else None,
        )


class TextWriter(_ModeWriter):
    """`output_mode: "text"`: vLLM's text mode — text deltas plus ids, decoded logprobs."""

    _stream_type = GenerateTextStreamResponse
    _response_type = GenerateTextResponse
    # Text mode keeps every candidate the backend sent (the sampled token at least),
    # as vLLM's text mode does; only chat's `top_logprobs` cuts the list.
    _TOP = 1 << 30

    def __init__(self, request: GenerateRequest, context: WriterContext) -> None:
        assert context.vocab is not None
        super().__init__(request, context, decode=True)
        self._vocab = context.vocab
        self._texts: list[list[str]] = [[] for _ in range(request.sampling_params.n)]

    def _stream_choice(
        self, output: BackendOutput, ids: Sequence[int], text: str, finish: str | None, stop: int | str | None
    ) -> GenerateTextStreamChoice | None:
        raw = _kept_logprobs(output, len(ids))
        logprobs = chat_logprobs(self._vocab, raw, self._TOP) if raw is not None else None
        if self._c.keep:
            self._texts[output.index].append(text)
            if logprobs is not None:
                self._logprobs[output.index].extend(logprobs)
        if not ids and not text and finish is None:
            return None
        return GenerateTextStreamChoice(
            index=output.index,
            text=text,
            token_ids=list(ids),
            finish_reason=finish,
            stop_reason=stop,
            logprobs=ChatLogprobs(content=logprobs) if logprobs is not None else None,
        )

    def _choice(self, index: int, ids: list[int], wants_logprobs: bool) -> GenerateTextChoice:
        finish, stop = self._c.finish[index]
        return GenerateTextChoice(
            index=index,
            text="".join(self._texts[index]),
            token_ids=ids,
            finish_reason=finish,
            stop_reason=stop,
            logprobs=ChatLogprobs(content=self._logprobs[index]) if wants_logprobs else None,
        )


def _response_id(request_id: str, prefix: str) -> str:
    request_id = public_request_id(request_id)  # the client's answer id; the abort handle is the gateway's
    return request_id if request_id.startswith(prefix) else f"{prefix}{request_id}"


class DerenderWriter(DataFrames):
    """`output_mode: "derender"`: finished OpenAI chat / completion objects, ready to relay."""

    def __init__(self, request: GenerateRequest, context: WriterContext) -> None:
        assert context.vocab is not None
        sampling = request.sampling_params
        keep_answer = not request.stream  # only the non-streaming body needs the whole answer
        options = request.stream_options
        # Another API's answer always reports usage at its end (its own shape, never chat's chunk).
        include_usage = bool(options and options.include_usage) or request.present is not None
        continuous = bool(options and options.continuous_usage_stats) and request.present is None
        self._derender: ChatDerender | CompletionDerender
        if request.chat_request is not None:
            chat = request.chat_request
            chat_options = ChatOptions.from_request(
                chat,
                reasoning_parser=context.reasoning_parser,
                tool_parser=context.tool_parser,
                reasoning_field=context.reasoning_field,
                text=text_params(sampling),  # the rendered sampling params are the truth for text
                template_kwargs=template_kwargs(request),
            )
            self._derender = ChatDerender(
                context.vocab,
                chat_options,
                model=chat.model or context.model,
                n=sampling.n,
                prompt_token_ids=request.token_ids,
                response_id=_response_id(request.request_id, "chatcmpl-"),
                include_usage=include_usage,
                continuous_usage=continuous,
                keep_answer=keep_answer,
            )
        else:
            completion = request.completion_request
            assert completion is not None
            base_options = CompletionOptions.from_request(completion)
            completion_options = CompletionOptions(
                text=text_params(sampling),
                logprobs=base_options.logprobs,
                echo=base_options.echo,
                return_token_ids=base_options.return_token_ids,
            )
            self._derender = CompletionDerender(
                context.vocab,
                completion_options,
                model=completion.model or context.model,
                n=sampling.n,
                first_index=request.prompt_index * sampling.n,
                prompt_token_ids=request.token_ids,
                response_id=_response_id(request.request_id, "cmpl-"),
                include_usage=include_usage,
                continuous_usage=continuous,
                keep_answer=keep_answer,
            )

    def head(self) -> list[bytes]:
        if isinstance(self._derender, ChatDerender):
            return [encode(chunk) for chunk in self._derender.start()]
        return []

    def open_choices(self) -> list[int]:
        return open_choices(self._derender)

    def summary(self) -> EngineSummary:
        return derender_summary(self._derender)

    def step(self, output: BackendOutput) -> bytes | None:
        note_cached(output, self._derender)
        if self._derender.choices[output.index].finished:
            return None
        chunk = self._derender.step(
            output.index,
            output.token_ids,
            output.logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )
        return None if chunk is None else encode(chunk)

    def tail(self) -> list[bytes]:
        chunk = self._derender.usage_chunk()
        return [] if chunk is None else [encode(chunk)]

    def body(self) -> bytes:
        return encode(self._derender.response())


class PresentedWriter(DerenderWriter):
    """`derender` with `present`: the chat derender's chunks (parsed reasoning, text and tool
    calls) as another API's events, or its whole answer, by that API's assembler. Payloads are
    whole SSE events (`event:` and `data:`), several per step where the API opens and closes
    items; they are never chat's, so the gateway relays them as they are."""

    def __init__(self, request: GenerateRequest, context: WriterContext) -> None:
        super().__init__(request, context)
        assert isinstance(self._derender, ChatDerender)  # `present` comes with a chat_request
        self._chat = self._derender
        present = request.present
        self._assembler: ResponsesAssembler | MessagesAssembler
        if isinstance(present, ResponsesPresent):
            self._assembler = ResponsesAssembler(present)
        else:
            assert present is not None  # make_writer's choice
            self._assembler = MessagesAssembler(present, len(request.token_ids))

    def head(self) -> list[bytes]:
        opening = b"".join(self._assembler.feed(chunk) for chunk in self._chat.start())
        return [opening] if opening else []

    def step(self, output: BackendOutput) -> bytes | None:
        note_cached(output, self._chat)
        if self._chat.choices[output.index].finished:
            return None
        chunk = self._chat.step(
            output.index,
            output.token_ids,
            output.logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )
        return (self._assembler.feed(chunk) or None) if chunk is not None else None

    def tail(self) -> list[bytes]:
        usage = self._chat.usage_chunk()
        return [(self._assembler.feed(usage) if usage is not None else b"") + self._assembler.end()]

    def body(self) -> bytes:
        return encode(self._assembler.whole(self._chat.response()))

    def frame(self, payload: bytes) -> bytes:
        return payload

    def error_frame(self, error: EngineHTTPError) -> bytes:
        if isinstance(self._assembler, ResponsesAssembler):
            code = "engine_failed" if error.status >= 500 else None  # the gateway's code for the same failure
            return self._assembler.error(code, error.message, error.param)
        return messages_error_frame(error.status, error.message)


def template_kwargs(request: GenerateRequest) -> dict[str, object]:
    """`enable_thinking` and friends: /render's parser kwargs win over the chat request's."""
    kwargs: dict[str, object] = {}
    if request.chat_request is not None and request.chat_request.chat_template_kwargs:
        kwargs.update(request.chat_request.chat_template_kwargs)
    if request.reasoning_parser_kwargs is not None:
        kwargs.update(request.reasoning_parser_kwargs.chat_template_kwargs)
    return kwargs


def make_writer(request: GenerateRequest, context: WriterContext) -> OutputWriter:
    if request.output_mode == "tokens":
        return TokensWriter(request, context)
    if request.output_mode == "text":
        return TextWriter(request, context)
    if request.vllm_derender:
        return VllmDerenderWriter(request, context, text_params(request.sampling_params))
    if request.present is not None:
        return PresentedWriter(request, context)
    return DerenderWriter(request, context)
