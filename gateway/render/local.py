"""Render: an OpenAI request → prompt token ids, once per request.

Local render runs the model folder's chat template (`gateway.render.chat_template`:
jinja2 as transformers runs it, without transformers) and tokenizes the
result with `tokenizers` (`gateway.render.tokenizer_folder`). Tokenization is cached
per chat turn: the rendered text is cut right before each turn-opening
special token (`<|im_start|>` for ChatML), which is exactly where the
tokenizer itself splits the text (added tokens are matched before any other
processing), so the ids equal tokenizing the whole text, and a system
prompt or tool list repeated across requests is tokenized once. The cache
is bounded in bytes (an estimate of what its strings and id lists hold), not
entries: one huge turn cannot pin memory.

Every render runs off the event loop, on the renderer's worker threads,
several at once. A render of more than `large_chars` characters of text
(`gateway.edge.validate`'s count) takes a lane of its own, `large_workers` threads
wide: a few huge requests can neither hold up the small ones behind them
(four ~4 MB bodies once stalled a 4-token request 8–17 s, all workers busy)
nor, rendered side by side, multiply the memory one render takes (a
tokenizer's intermediates are ~100 bytes a character). Long segments are encoded through `encode_batch`, which releases
the GIL (`encode` holds it for the whole call: 13 s for 8.8 MB of text on
this project's CI machine, during which no other thread runs).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from tokenizers import Tokenizer

from wire.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.render.chat_template import ChatTemplate, ChatTemplateError, pick_template
from gateway.config import LARGE_RENDER_CHARS, LARGE_RENDER_WORKERS
from gateway.edge.errors import InvalidRequest
from gateway.render.tokenizer_folder import load_folder
from gateway.edge.validate import chat_text_chars, completion_text_chars

T = TypeVar("T")

_TURN_MARKERS = ("<|im_start|>",)
CACHE_BYTES = 64 * 1024 * 1024
RENDER_WORKERS = 4
_ID_BYTES = 36
"""What one cached token id costs: a list slot and (most often) an int object."""
_RELEASE_GIL_CHARS = 4096
"""Segments longer than this go through `encode_batch`, which lets other threads run."""


class LocalRenderer:
    def __init__(
        self,
        tokenizer_dir: str | Path,
        *,
        workers: int = RENDER_WORKERS,
        cache_bytes: int = CACHE_BYTES,
        large_chars: int = LARGE_RENDER_CHARS,
        large_workers: int = LARGE_RENDER_WORKERS,
    ) -> None:
        folder = load_folder(tokenizer_dir)
        self._backend = folder.tokenizer
        self._special_tokens = folder.special_tokens
        self._templates = {name: ChatTemplate(source) for name, source in folder.templates.items()}
        markers = [m for m in _TURN_MARKERS if self._backend.token_to_id(m) is not None]
        self._split = re.compile("(?=" + "|".join(re.escape(m) for m in markers) + ")") if markers else None
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._lock = threading.Lock()
        """Guards the cache: workers share it (tokenizing runs outside the lock)."""
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="render")
        self._large = ThreadPoolExecutor(max_workers=large_workers, thread_name_prefix="render-large")
        self._large_chars = large_chars
        self.large_pending = 0
        """Large renders queued or running (tests wait on it; a gauge could read it)."""

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)

    async def _run(self, chars: int, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the small lane, or on the large one past `large_chars` characters."""
        loop = asyncio.get_running_loop()
        if chars <= self._large_chars:
            return await loop.run_in_executor(self._executor, work, *args)
        self.large_pending += 1
        try:
            return await loop.run_in_executor(self._large, work, *args)
        finally:
            self.large_pending -= 1

    @property
    def tokenizer(self) -> Tokenizer:
        """The `tokenizers` backend prompts are encoded with (special tokens as the folder declares)."""
        return self._backend

    async def chat(self, request: ChatCompletionRequest, *, suffix: str | None = None) -> list[int]:
        """The rendered prompt's ids, then `suffix`'s (the forced tool-call opening)."""
        return await self._run(chat_text_chars(request), self.chat_sync, request, suffix)

    async def encode(self, text: str) -> list[int]:
        return await self._run(len(text), self.encode_sync, text)

    async def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        return await self._run(completion_text_chars(request), self.completion_prompts_sync, request)

    def chat_sync(self, request: ChatCompletionRequest, suffix: str | None = None) -> list[int]:
        ids = self.encode_sync(self.chat_text(request))
        return ids + self.encode_sync(suffix) if suffix else ids

    def chat_text(self, request: ChatCompletionRequest) -> str:
        messages = [msgspec.to_builtins(message) for message in request.messages]
        tools = [msgspec.to_builtins(tool) for tool in request.tools] if request.tools else None
        try:
            return pick_template(self._templates, tools=tools is not None).render(
                messages,
                tools=tools,
                documents=request.documents,
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                special_tokens=self._special_tokens,
                kwargs=request.chat_template_kwargs,
            )
        except ChatTemplateError as exc:  # template errors are the request's fault (a bad role, a missing field)
            raise InvalidRequest(f"the chat template could not render these messages: {exc}", param="messages") from exc

    def completion_prompts_sync(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if prompt is None or prompt == [] or prompt == "":
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(prompt, str):
            return [self.encode_sync(prompt, add_special_tokens=request.add_special_tokens)]
        # The request's own check: one kind of item throughout (`CompletionRequest.__post_init__`).
        if isinstance(prompt[0], int):
            return [[item for item in prompt if isinstance(item, int)]]
        return [self._prompt_ids(item, request.add_special_tokens) for item in prompt]

    def _prompt_ids(self, item: str | int | list[int], add_special_tokens: bool) -> list[int]:
        """One prompt of a list: text, encoded; token ids, as they are."""
        if isinstance(item, str):
            return self.encode_sync(item, add_special_tokens=add_special_tokens)
        assert isinstance(item, list)  # a list of ints is the whole prompt, taken above
        return list(item)

    def encode_sync(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens or self._split is None:
            return self._ids(text, add_special_tokens)
        ids: list[int] = []
        for segment in self._split.split(text):
            if segment:
                ids += self._segment_ids(segment)
        return ids

    def _ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > _RELEASE_GIL_CHARS:
            return list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def _segment_ids(self, segment: str) -> list[int]:
        cache = self._segments
        with self._lock:
            hit = cache.get(segment)
            if hit is not None:
                cache.move_to_end(segment)
                return hit
        ids = self._ids(segment)
        size = len(segment) + _ID_BYTES * len(ids)
        if size > self._cache_bytes // 8:
            return ids  # a turn this large is not worth a slot that would evict many others
        with self._lock:
            if segment not in cache:
                cache[segment] = ids
                self.cached_bytes += size
            while self.cached_bytes > self._cache_bytes:
                evicted, evicted_ids = cache.popitem(last=False)
                self.cached_bytes -= len(evicted) + _ID_BYTES * len(evicted_ids)
        return ids
