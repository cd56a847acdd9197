"""Render: an OpenAI request → prompt token ids, once per request.

Local render runs the model folder's chat template (transformers) and
tokenizes the result. Tokenization is cached per chat turn: the rendered text
is cut right before each turn-opening special token (`<|im_start|>` for
ChatML), which is exactly where the tokenizer itself splits the text (added
tokens are matched before any other processing), so the ids equal tokenizing
the whole text, and a system prompt or tool list repeated across requests is
tokenized once. Work runs off the event loop, in a worker thread.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from engine.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.errors import InvalidRequest

_TURN_MARKERS = ("<|im_start|>",)
_SEGMENT_CACHE_SIZE = 4096


class LocalRenderer:
    def __init__(self, tokenizer_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self._backend = self._tokenizer.backend_tokenizer
        markers = [m for m in _TURN_MARKERS if self._backend.token_to_id(m) is not None]
        self._split = re.compile("(?=" + "|".join(re.escape(m) for m in markers) + ")") if markers else None
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        # One worker: renders are short, and the segment cache is then never shared between threads.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def chat(self, request: ChatCompletionRequest) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.chat_sync, request)

    async def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.completion_prompts_sync, request)

    def chat_sync(self, request: ChatCompletionRequest) -> list[int]:
        return self.encode(self.chat_text(request))

    def chat_text(self, request: ChatCompletionRequest) -> str:
        messages = [msgspec.to_builtins(message) for message in request.messages]
        tools = [msgspec.to_builtins(tool) for tool in request.tools] if request.tools else None
        kwargs = dict(request.chat_template_kwargs or {})
        try:
            return self._tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:  # template errors are the request's fault (a bad role, a missing field)
            raise InvalidRequest(f"the chat template could not render these messages: {exc}", param="messages") from exc

    def completion_prompts_sync(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if prompt is None or prompt == [] or prompt == "":
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(prompt, str):
            return [self.encode(prompt, add_special_tokens=request.add_special_tokens)]
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if all(isinstance(item, str) for item in prompt):
            return [self.encode(item, add_special_tokens=request.add_special_tokens) for item in prompt]  # type: ignore[arg-type]
        return [list(item) for item in prompt]  # type: ignore[arg-type]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens or self._split is None:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        ids: list[int] = []
        for segment in self._split.split(text):
            if segment:
                ids += self._segment_ids(segment)
        return ids

    def _segment_ids(self, segment: str) -> list[int]:
        cache = self._segments
        hit = cache.get(segment)
        if hit is not None:
            cache.move_to_end(segment)
            return hit
        ids = list(self._backend.encode(segment, add_special_tokens=False).ids)
        cache[segment] = ids
        if len(cache) > _SEGMENT_CACHE_SIZE:
            cache.popitem(last=False)
        return ids
