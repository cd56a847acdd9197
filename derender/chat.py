"""Stateful chat derender: generate output → OpenAI chat chunks or one completion.

One `ChatChoiceState` per choice lives for the whole request: a detokenizer,
stop strings, and one reasoning/tool parser, each fed only the new tokens
(O(delta) per chunk). `ChatDerender` wraps the choices of one request and
emits `ChatCompletionChunk`s; the non-streaming `ChatCompletion` is the fold
of the very same deltas, so both shapes always agree. Only that fold needs
the deltas kept: a stream (`keep_answer=False`) holds per choice what the
next chunk needs and counts, not every delta and logprob (at top_logprobs=20
those are ~1.4 KB a token).

Output follows vLLM 0.32's coupled `/v1/chat/completions`, with these
deliberate choices:
- the reasoning field is `reasoning` (vLLM's name), `reasoning_content`, or
  both (`ReasoningField`), since clients differ in which they read;
- a tool-call header delta carries `arguments: ""` as OpenAI's does;
- `finish_reason` turns from `stop` into `tool_calls` when calls were made,
  unless a stop string ended the output (the call may be cut short);
- tool-call ids are `chatcmpl-tool-<hex>` in both shapes;
- the EOS token's text never reaches `content`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from derender.detokenizer import make_detokenizer
from derender.errors import AnswerNotKept
from derender.logprobs import chat_logprobs
from derender.markers import MarkerSplitter
from derender.parsers import (
    TOOL_PARSERS,
    ParseOptions,
    ToolDelta,
    ToolSchema,
    bind_parsers,
    new_tool_call_id,
)
from derender.parsers.choice import ChoiceParsing
from derender.stop import Piece
from derender.text import OutputFinished, TextParams, TextPipeline
from derender.usage import usage_of
from derender.vocab import TokenVocab
from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    Usage,
)
from wire.protocol import GenerateLogProbsContent

ReasoningField = Literal["reasoning", "reasoning_content", "both"]


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """Everything a chat choice needs from the request, resolved once."""

    text: TextParams = field(default_factory=TextParams)
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    tools_enabled: bool = False
    """Tools were offered and `tool_choice` is not `none`."""
    tools: tuple[ToolSchema, ...] = ()
    """The offered tools' names and parameter schemas (formats that type values by schema)."""
    enable_thinking: bool = True
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The template kwargs as sent (vLLM's parsers read more than `enable_thinking`)."""
    include_reasoning: bool = True
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    reasoning_field: ReasoningField = "reasoning"
    forced_prefix: str | None = None
    """Tool-call opening appended to the prompt for `tool_choice` required or named (see `forced_tool_prefix`)."""

    @classmethod
    def from_request(
        cls,
        request: ChatCompletionRequest,
        *,
        reasoning_parser: str | None,
        tool_parser: str | None,
        reasoning_field: ReasoningField = "reasoning",
        text: TextParams | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatOptions:
        """Options for a chat request; `text` and `template_kwargs` override what the
        request says when the rendered generate request is the truth (the engine)."""
        stop = request.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        kwargs = template_kwargs if template_kwargs is not None else (request.chat_template_kwargs or {})
        return cls(
            text=text
            or TextParams(
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                stop=stops,
                include_stop_str_in_output=request.include_stop_str_in_output,
                min_tokens=request.min_tokens,
            ),
            reasoning_parser=reasoning_parser,
            tool_parser=tool_parser,
            tools_enabled=bool(request.tools) and request.effective_tool_choice() != "none",
            tools=tuple(ToolSchema(t.function.name, t.function.parameters) for t in request.tools or ()),
            enable_thinking=bool(kwargs.get("enable_thinking", True)),
            chat_template_kwargs=kwargs,
            include_reasoning=request.include_reasoning,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            logprobs=bool(request.logprobs),
            top_logprobs=request.top_logprobs or 0,
            return_token_ids=bool(request.return_token_ids),
            reasoning_field=reasoning_field,
            forced_prefix=forced_tool_prefix(request, tool_parser),
        )


def forced_tool_prefix(request: ChatCompletionRequest, tool_parser: str | None) -> str | None:
    """How onehop honours `tool_choice` "required" or a named function without guided decoding.

    The gateway appends this opening of a call to the rendered prompt, so the
    model can only continue a call (no reasoning first); every derender of the
    request primes its parser with the same text, so the call's header comes
    out first and its arguments are what the model writes.
    """
    factory = TOOL_PARSERS.get(tool_parser) if tool_parser is not None else None
    if not request.tools or factory is None or factory.forced_prefix is None:
        return None
    choice = request.effective_tool_choice()
    if choice == "required":
        if len(request.tools) == 1:
            return factory.forced_prefix(request.tools[0].function.name)
        return factory.forced_prefix(None)
    if choice is None or isinstance(choice, str):
        return None
    return factory.forced_prefix(choice.function.name)


@dataclass(slots=True)
class _CallAcc:
    id: str
    name: str
    arguments: list[str]


class ChatChoiceState:
    """One choice's derender state for the life of the request."""

    __slots__ = (
        "_called",
        "_calls",
        "_content",
        "_logprobs",
        "_options",
        "_parser",
        "_parsers",
        "_reasoning",
        "_splitter",
        "_text",
        "_vocab",
        "_whole",
        "completion_tokens",
        "finish_reason",
        "index",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        index: int,
        vocab: TokenVocab,
        options: ChatOptions,
        *,
        prompt_token_ids: Sequence[int] = (),
        new_tool_call_id: Callable[[], str] = new_tool_call_id,
        keep_answer: bool = True,
    ) -> None:
        self.index = index
        self._whole = keep_answer
        self._vocab = vocab
        self._options = options
        parsers = bind_parsers(vocab, options.reasoning_parser, options.tool_parser)
        self._parsers = parsers
        self._splitter: MarkerSplitter | None = None  # made on the first text-route step
        atomic = parsers.atomic_ids if parsers is not None else frozenset()
        self._text = TextPipeline(vocab, options.text, atomic_ids=atomic, prompt_token_ids=prompt_token_ids)
        self._parser: ChoiceParsing | None = None
        if parsers is not None:
            self._parser = parsers.new(
                ParseOptions(
                    tools_enabled=options.tools_enabled,
                    tools=options.tools,
                    parallel_tool_calls=options.parallel_tool_calls,
                    enable_thinking=options.enable_thinking,
                    new_id=new_tool_call_id,
                    chat_template_kwargs=options.chat_template_kwargs,
                ),
                prompt_token_ids,
                forced=options.forced_prefix is not None,
            )
            if options.forced_prefix is not None:
                self._prime(vocab, options.forced_prefix)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[_CallAcc] = []
        self._logprobs: list[ChatLogprobToken] = []
        self._called = False
        self.token_ids: list[int] = []
        """Every kept id when the answer is kept (`choice()` needs them), else empty."""
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def reasoning_tokens(self) -> int:
        """Tokens the reasoning parser counted so far (read when usage is asked, not per step)."""
        return self._parser.reasoning_tokens if self._parser is not None else 0

    def _prime(self, vocab: TokenVocab, prefix: str) -> None:
        """Parse the forced call opening as if generated; its deltas go out with the first step."""
        assert self._parser is not None
        detok = make_detokenizer(vocab)
        ids = vocab.backend.encode(prefix, add_special_tokens=False).ids
        self._parser.feed([(detok.step(token_id), token_id) for token_id in ids])

    def feed(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[GenerateLogProbsContent] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionChunkChoice | None:
        """Take one step of token output; return the chunk choice to stream, if any."""
        step = self._text.feed(token_ids, finish_reason=finish_reason, stop_reason=stop_reason)
        kept = token_ids[: step.kept] if step.kept < len(token_ids) else token_ids
        entries = self._format_logprobs(logprobs, len(kept))
        return self._emit(step.pieces, kept, entries, step.finish_reason, step.stop_reason)

    def feed_text(
        self,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: list[ChatLogprobToken] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionChunkChoice | None:
        """Take one step of an engine's `text` output (stop strings and EOS already applied there)."""
        if self.finish_reason is not None:
            raise OutputFinished("text arrived after the choice finished")
        self._vocab.check_ids(token_ids)  # the ids count and carry markers: each must be the tokenizer's
        parsers = self._parsers
        if parsers is None:
            pieces: list[Piece] = [(text, -1)] if text else []
        else:
            if self._splitter is None:
                self._splitter = MarkerSplitter(parsers.marker_ids)
            pieces = self._splitter.feed(text) if text else []
            if finish_reason is not None:
                pieces += self._splitter.finish()
            pieces = _with_token_ids(pieces, token_ids)
        if logprobs is not None and self._options.logprobs:
            top = self._options.top_logprobs
            for entry in logprobs:  # text mode sends every candidate; the client asked for `top`
                if len(entry.top_logprobs) > top:
                    entry.top_logprobs = entry.top_logprobs[:top]
            if self._whole:
                self._logprobs.extend(logprobs)
        else:
            logprobs = None
        return self._emit(pieces, token_ids, logprobs, finish_reason, stop_reason)

    def _emit(
        self,
        pieces: list[tuple[str, int]],
        kept: Sequence[int],
        entries: list[ChatLogprobToken] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> ChatCompletionChunkChoice | None:
        self.completion_tokens += len(kept)
        reasoning, content, tool_deltas = self._parse(pieces, finish_reason is not None)
        if self._whole:
            self.token_ids.extend(kept)
            self._reasoning.append(reasoning)
            self._content.append(content)
            self._collect_calls(tool_deltas)
        elif tool_deltas:
            self._called = True
        if finish_reason is not None:
            self.finish_reason = self._final_reason(finish_reason, stop_reason)
            self.stop_reason = stop_reason
        return self._chunk_choice(reasoning, content, tool_deltas, entries, kept)

    # -- per-step pieces ----------------------------------------------------

    def _parse(self, pieces: list[tuple[str, int]], finishing: bool) -> tuple[str, str, list[ToolDelta]]:
        parser = self._parser
        if parser is None:
            return "", "".join(text for text, _ in pieces), []
        parser.feed(pieces)
        if finishing:
            parser.finish()
        return parser.drain()

    def _collect_calls(self, deltas: list[ToolDelta]) -> None:
        for delta in deltas:
            if delta.name is not None:
                self._calls.append(_CallAcc(id=delta.id or "", name=delta.name, arguments=[]))
            if delta.arguments:
                self._calls[delta.index].arguments.append(delta.arguments)

    def _format_logprobs(
        self, logprobs: Sequence[GenerateLogProbsContent] | None, kept: int
    ) -> list[ChatLogprobToken] | None:
        if not self._options.logprobs or logprobs is None:
            return None
        entries = chat_logprobs(self._vocab, logprobs[:kept], self._options.top_logprobs)
        if self._whole:
            self._logprobs.extend(entries)
        return entries

    def _final_reason(self, finish_reason: str, stop_reason: int | str | None) -> str:
        called = self._called or bool(self._calls)
        if finish_reason == "stop" and called and not isinstance(stop_reason, str):
            return "tool_calls"
        return finish_reason

    def _chunk_choice(
        self,
        reasoning: str,
        content: str,
        tool_deltas: list[ToolDelta],
        logprobs: list[ChatLogprobToken] | None,
        kept: Sequence[int],
    ) -> ChatCompletionChunkChoice | None:
        delta = ChatDelta()
        empty = True
        if reasoning and self._options.include_reasoning:
            self._set_reasoning(delta, reasoning)
            empty = False
        if content:
            delta.content = content
            empty = False
        if tool_deltas:
            delta.tool_calls = _merge_tool_deltas(tool_deltas)
            empty = False
        if empty and logprobs is None and self.finish_reason is None:
            return None
        choice = ChatCompletionChunkChoice(
            index=self.index,
            delta=delta,
            logprobs=ChatLogprobs(content=logprobs) if logprobs is not None else None,
            finish_reason=self.finish_reason,
        )
        if self.finish_reason is not None:
            choice.stop_reason = self.stop_reason
        if self._options.return_token_ids:
            choice.token_ids = list(kept)
        return choice

    def _set_reasoning(self, target: ChatDelta | ChatCompletionMessage, text: str | None) -> None:
        field_name = self._options.reasoning_field
        if field_name != "reasoning_content":
            target.reasoning = text
        if field_name != "reasoning":
            target.reasoning_content = text

    # -- non-streaming ------------------------------------------------------

    def choice(self) -> ChatCompletionChoice:
        """The non-streaming choice: everything streamed so far, joined."""
        if not self._whole:
            raise AnswerNotKept("this choice streamed without keeping its answer")
        reasoning = "".join(self._reasoning) or None
        content = "".join(self._content) or None
        message = ChatCompletionMessage(content=content)
        if self._options.reasoning_field == "reasoning_content":
            message.reasoning = None
        self._set_reasoning(message, reasoning if self._options.include_reasoning else None)
        if self._calls:
            message.tool_calls = [
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments="".join(c.arguments)))
                for c in self._calls
            ]
        return ChatCompletionChoice(
            index=self.index,
            message=message,
            logprobs=ChatLogprobs(content=self._logprobs) if self._options.logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            token_ids=self.token_ids if self._options.return_token_ids else None,
        )


def _merge_tool_deltas(deltas: list[ToolDelta]) -> list[DeltaToolCall]:
    """One entry per call index and chunk: header fields first, fragments joined."""
    merged: list[DeltaToolCall] = []
    by_index: dict[int, tuple[DeltaToolCall, list[str]]] = {}
    for delta in deltas:
        slot = by_index.get(delta.index)
        if slot is None:
            entry = DeltaToolCall(index=delta.index)
            slot = (entry, [])
            by_index[delta.index] = slot
            merged.append(entry)
        entry, parts = slot
        if delta.name is not None:
            entry.id = delta.id
            entry.type = "function"
            entry.function = DeltaFunctionCall(name=delta.name, arguments="")
        if delta.arguments:
            parts.append(delta.arguments)
    for entry, parts in by_index.values():
        if parts:
            arguments = "".join(parts)
            if isinstance(entry.function, DeltaFunctionCall):
                entry.function.arguments = arguments
            else:
                entry.function = DeltaFunctionCall(arguments=arguments)
    return merged


def _with_token_ids(pieces: list[Piece], token_ids: Sequence[int]) -> list[Piece]:
    """Text-route pieces carry no token ids: add each of the step's ids that no marker
    piece owns as an empty piece after the text it belongs to (ids before a marker's
    id precede that marker), so the reasoning stage counts tokens as on the token route."""
    if not token_ids:
        return pieces
    out: list[Piece] = []
    position = 0
    for piece in pieces:
        if piece[1] >= 0:
            while position < len(token_ids) and token_ids[position] != piece[1]:
                out.append(("", token_ids[position]))
                position += 1
            position += 1
        out.append(piece)
    for token_id in token_ids[position:]:
        out.append(("", token_id))
    return out


class ChatDerender:
    """All choices of one chat request, producing chunks or the final completion."""

    def __init__(
        self,
        vocab: TokenVocab,
        options: ChatOptions,
        *,
        model: str,
        n: int = 1,
        prompt_token_ids: Sequence[int] = (),
        response_id: str | None = None,
        created: int | None = None,
        include_usage: bool = False,
        continuous_usage: bool = False,
        cached_tokens: int | None = None,
        new_tool_call_id: Callable[[], str] = new_tool_call_id,
        keep_answer: bool = True,
    ) -> None:
        """`keep_answer=False` for a stream: `response()` is then unavailable."""
        self.choices = [
            ChatChoiceState(
                i,
                vocab,
                options,
                prompt_token_ids=prompt_token_ids,
                new_tool_call_id=new_tool_call_id,
                keep_answer=keep_answer,
            )
            for i in range(n)
        ]
        self.id = response_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.prompt_tokens = len(prompt_token_ids)
        self._include_usage = include_usage
        self._continuous = continuous_usage and include_usage
        self.cached_tokens = cached_tokens
        """Prompt tokens the engine's prefix cache held; set once the first output says (None: unknown)."""
        self._count_reasoning = options.reasoning_parser is not None

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def _chunk(self, choices: list[ChatCompletionChunkChoice]) -> ChatCompletionChunk:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        if self._continuous:
            chunk.usage = self.usage()
        return chunk

    def start(self) -> list[ChatCompletionChunk]:
        """The role chunk of every choice, sent before any output."""
        return [
            self._chunk([ChatCompletionChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))])
            for c in self.choices
        ]

    def step(
        self,
        index: int,
        token_ids: Sequence[int],
        logprobs: Sequence[GenerateLogProbsContent] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionChunk | None:
        """Feed one choice's new tokens; the chunk to stream, or None if nothing is visible yet."""
        choice = self.choices[index].feed(token_ids, logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        return None if choice is None else self._chunk([choice])

    def step_text(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: list[ChatLogprobToken] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> ChatCompletionChunk | None:
        """Feed one choice's `text`-mode step (the text route)."""
        choice = self.choices[index].feed_text(
            text, token_ids, logprobs, finish_reason=finish_reason, stop_reason=stop_reason
        )
        return None if choice is None else self._chunk([choice])

    def usage(self) -> Usage:
        reasoning = sum(c.reasoning_tokens for c in self.choices) if self._count_reasoning else None
        return usage_of(self.prompt_tokens, self.choices, cached_tokens=self.cached_tokens, reasoning_tokens=reasoning)

    def usage_chunk(self) -> ChatCompletionChunk | None:
        """The trailing usage-only chunk when `stream_options.include_usage` asked for it."""
        if not self._include_usage:
            return None
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())

    def response(self) -> ChatCompletion:
        """The non-streaming completion, once every choice has finished."""
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[c.choice() for c in self.choices],
            usage=self.usage(),
        )
