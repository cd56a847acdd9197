"""Stateful completions derender: generate output → OpenAI text-completion chunks.

The same per-choice text pipeline as chat (detokenizer + stop strings), no
parsers. One `CompletionDerender` covers one prompt's `n` choices; a request
with several prompts has one per prompt, and `first_index` numbers their
choices `prompt_index * n + i` as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from derender.errors import AnswerNotKept
from derender.logprobs import completion_from_chat_logprobs, completion_logprobs
from derender.text import TextParams, TextPipeline
from derender.usage import usage_of
from derender.vocab import TokenVocab
from wire.openai_schema import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    ChatLogprobToken,
    Usage,
)
from wire.protocol import GenerateLogProbsContent


@dataclass(frozen=True, slots=True)
class CompletionOptions:
    text: TextParams = field(default_factory=TextParams)
    logprobs: int | None = None
    """Top-k count per position, or None for no logprobs (the legacy API's int)."""
    echo: bool = False
    return_token_ids: bool = False

    @classmethod
    def from_request(cls, request: CompletionRequest) -> CompletionOptions:
        stop = request.stop
        return cls(
            text=TextParams(
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
                include_stop_str_in_output=request.include_stop_str_in_output,
                min_tokens=request.min_tokens,
            ),
            logprobs=request.logprobs,
            echo=bool(request.echo),
            return_token_ids=bool(request.return_token_ids),
        )


class CompletionChoiceState:
    __slots__ = (
        "_echo",
        "_logprobs",
        "_offset",
        "_options",
        "_parts",
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
        options: CompletionOptions,
        *,
        prompt_token_ids: Sequence[int] = (),
        echo_text: str = "",
        keep_answer: bool = True,
    ) -> None:
        self.index = index
        self._whole = keep_answer
        self._vocab = vocab
        self._options = options
        self._text = TextPipeline(vocab, options.text, prompt_token_ids=prompt_token_ids)
        self._parts: list[str] = []
        self._echo = echo_text
        self._offset = len(echo_text)  # logprob text offsets count the echoed prompt
        self._logprobs = CompletionLogprobs()
        self.token_ids: list[int] = []
        """Every kept id when the answer is kept (`choice()` needs them), else empty."""
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[GenerateLogProbsContent] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> CompletionChunkChoice | None:
        step = self._text.feed(token_ids, finish_reason=finish_reason, stop_reason=stop_reason)
        kept = token_ids[: step.kept] if step.kept < len(token_ids) else token_ids
        self._count(kept)
        generated = "".join(piece for piece, _ in step.pieces)
        entries = self._format_logprobs(logprobs, len(kept))
        return self._emit(generated, entries, kept, step.finish_reason, step.stop_reason)

    def feed_text(
        self,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[ChatLogprobToken] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> CompletionChunkChoice | None:
        """One step of an engine's `text` output (stop strings already applied there)."""
        self._count(token_ids)
        entries = None
        if self._options.logprobs is not None and logprobs is not None:
            entries = self._keep(completion_from_chat_logprobs(logprobs, self._options.logprobs, self._offset))
        return self._emit(text, entries, token_ids, finish_reason, stop_reason)

    def _emit(
        self,
        generated: str,
        entries: CompletionLogprobs | None,
        kept: Sequence[int],
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> CompletionChunkChoice | None:
        text = self._echo + generated if self._echo else generated
        self._echo = ""
        if self._whole:
            self._parts.append(text)
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        if not text and entries is None and self.finish_reason is None:
            return None
        choice = CompletionChunkChoice(
            index=self.index,
            text=text,
            logprobs=entries,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        if self._options.return_token_ids:
            choice.token_ids = list(kept)
        return choice

    def _count(self, ids: Sequence[int]) -> None:
        self.completion_tokens += len(ids)
        if self._whole:
            self.token_ids.extend(ids)

    def _format_logprobs(
        self, logprobs: Sequence[GenerateLogProbsContent] | None, kept: int
    ) -> CompletionLogprobs | None:
        if self._options.logprobs is None or logprobs is None:
            return None
        return self._keep(completion_logprobs(self._vocab, logprobs[:kept], self._options.logprobs, self._offset))

    def _keep(self, entries: CompletionLogprobs) -> CompletionLogprobs:
        # Offsets advance by each token's own string, so they do not depend on chunking.
        self._offset += sum(len(token) for token in entries.tokens)
        if not self._whole:
            return entries
        whole = self._logprobs
        whole.text_offset += entries.text_offset
        whole.token_logprobs += entries.token_logprobs
        whole.tokens += entries.tokens
        whole.top_logprobs += entries.top_logprobs
        return entries

    def choice(self) -> CompletionChoice:
        if not self._whole:
            raise AnswerNotKept("this choice streamed without keeping its answer")
        return CompletionChoice(
            index=self.index,
            text="".join(self._parts),
            logprobs=self._logprobs if self._options.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            token_ids=self.token_ids if self._options.return_token_ids else None,
        )


class CompletionDerender:
    """The `n` choices of one prompt of a completions request."""

    def __init__(
        self,
        vocab: TokenVocab,
        options: CompletionOptions,
        *,
        model: str,
        n: int = 1,
        first_index: int = 0,
        prompt_token_ids: Sequence[int] = (),
        response_id: str | None = None,
        created: int | None = None,
        include_usage: bool = False,
        continuous_usage: bool = False,
        cached_tokens: int | None = None,
        keep_answer: bool = True,
    ) -> None:
        """`keep_answer=False` for a stream: `response()` is then unavailable."""
        echo = vocab.backend.decode(list(prompt_token_ids), skip_special_tokens=False) if options.echo else ""
        self.choices = [
            CompletionChoiceState(
                first_index + i,
                vocab,
                options,
                prompt_token_ids=prompt_token_ids,
                echo_text=echo,
                keep_answer=keep_answer,
            )
            for i in range(n)
        ]
        self.id = response_id or f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.prompt_tokens = len(prompt_token_ids)
        self._include_usage = include_usage
        self._continuous = continuous_usage and include_usage
        self.cached_tokens = cached_tokens
        """Prompt tokens the engine's prefix cache held; set once the first output says (None: unknown)."""

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def step(
        self,
        index: int,
        token_ids: Sequence[int],
        logprobs: Sequence[GenerateLogProbsContent] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> CompletionChunk | None:
        """Feed choice `index` (0-based within this prompt) one step of output."""
        choice = self.choices[index].feed(token_ids, logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        if choice is None:
            return None
        chunk = CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        if self._continuous:
            chunk.usage = self.usage()
        return chunk

    def step_text(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[ChatLogprobToken] | None = None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> CompletionChunk | None:
        choice = self.choices[index].feed_text(
            text, token_ids, logprobs, finish_reason=finish_reason, stop_reason=stop_reason
        )
        if choice is None:
            return None
        chunk = CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        if self._continuous:
            chunk.usage = self.usage()
        return chunk

    def usage(self) -> Usage:
        return usage_of(self.prompt_tokens, self.choices, cached_tokens=self.cached_tokens)

    def usage_chunk(self) -> CompletionChunk | None:
        if not self._include_usage:
            return None
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())

    def response(self) -> Completion:
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[c.choice() for c in self.choices],
            usage=self.usage(),
        )
