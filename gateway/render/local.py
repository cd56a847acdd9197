"""Render: an OpenAI request → prompt token ids, once per request.

Local render runs the model folder's chat template (`gateway.render.chat_template`:
jinja2 as transformers runs it, without transformers) and tokenizes the
result with `tokenizers` (`gateway.render.tokenizer_folder`). Tokenization is cached
per chat turn (`gateway.render.turn_cache`): the rendered text is cut right before
each turn marker the vocabulary has as an added token (`<|im_start|>` for ChatML,
`<|start_header_id|>` for Llama 3, ...), which is exactly where the tokenizer itself
splits the text (added tokens are matched before any other processing), so the ids
equal tokenizing the whole text; a system prompt or tool list repeated across
requests, and every earlier turn of a conversation, is tokenized once. The segments
a render misses are tokenized together with `encode_batch`, on every core. Each
render reports how many of its tokens came from the cache and how many were
tokenized (`on_cache`: the gateway counts them in
`onehop_gateway_render_cache_tokens_total`).

The template itself runs on every request, the whole conversation: templates
rewrite earlier turns (Qwen3 drops the reasoning of turns before the latest user
query, tool results fold into one turn), and no cheaper check proves a cached
rendering of the earlier turns still holds. It costs ~2.5 ms for a 40-turn,
140K-token conversation, against ~330 ms to tokenize it
(`scripts/bench_render.py`; docs/performance.md).

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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from tokenizers import Tokenizer

from wire.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.render.chat_template import ChatTemplate, ChatTemplateError, pick_template
from gateway.config import LARGE_RENDER_CHARS, LARGE_RENDER_WORKERS, RENDER_CACHE_BYTES
from gateway.edge.errors import InvalidRequest
from gateway.render.tokenizer_folder import load_folder
from gateway.render.token_ids import TokenIds
from gateway.render.turn_cache import TurnCache, digest
from gateway.edge.validate import chat_text_chars, completion_text_chars

T = TypeVar("T")
CacheReport = Callable[[int, int], None]
"""Told after each encode: (tokens taken from the turn cache, tokens tokenized). Called on
the render threads."""

_TURN_MARKERS = frozenset(
    {
        "<|im_start|>",  # ChatML (Qwen, ...)
        "<|start_header_id|>", "<|header_start|>",  # Llama 3, Llama 4
        "<|start|>",  # Harmony (gpt-oss)
        "<｜User｜>", "<｜Assistant｜>", "<｜tool▁output▁begin｜>",  # DeepSeek
        "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",  # GLM
        "<|im_system|>", "<|im_user|>", "<|im_assistant|>",  # Kimi K2
        "]~b]",  # MiniMax M2
        "[INST]", "[SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]",  # Mistral
        "<|eot|>",  # turn ends, where a family has no turn opening token
    }
)  # fmt: skip
"""Tokens that open (or close) a chat turn in the families onehop parses; the vocabulary's own
added tokens among them are where a rendered prompt is cut for the turn cache."""
RENDER_WORKERS = 4
_RELEASE_GIL_CHARS = 4096
"""Segments longer than this go through `encode_batch`, which lets other threads run."""


class LocalRenderer:
    def __init__(
        self,
        tokenizer_dir: str | Path,
        *,
        workers: int = RENDER_WORKERS,
        cache_bytes: int = RENDER_CACHE_BYTES,
        large_chars: int = LARGE_RENDER_CHARS,
        large_workers: int = LARGE_RENDER_WORKERS,
        on_cache: CacheReport | None = None,
    ) -> None:
        folder = load_folder(tokenizer_dir)
        self._backend = folder.tokenizer
        self._special_tokens = folder.special_tokens
        self._templates = {name: ChatTemplate(source) for name, source in folder.templates.items()}
        self.turn_markers = turn_markers(self._backend)
        self.turn_cache = TurnCache(cache_bytes)
        self._on_cache = on_cache
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

    async def chat(self, request: ChatCompletionRequest, *, suffix: str | None = None) -> TokenIds:
        """The rendered prompt's ids, then `suffix`'s (the forced tool-call opening)."""
        return await self._run(chat_text_chars(request), self.chat_sync, request, suffix)

    async def encode(self, text: str) -> TokenIds:
        return await self._run(len(text), self.encode_sync, text)

    async def completion_prompts(self, request: CompletionRequest) -> list[Sequence[int]]:
        return await self._run(completion_text_chars(request), self.completion_prompts_sync, request)

    def chat_sync(self, request: ChatCompletionRequest, suffix: str | None = None) -> TokenIds:
        ids = self.encode_sync(self.chat_text(request))
        return TokenIds.joined((ids, self.encode_sync(suffix))) if suffix else ids

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

    def completion_prompts_sync(self, request: CompletionRequest) -> list[Sequence[int]]:
        prompt = request.prompt
        if prompt is None or prompt == [] or prompt == "":
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if isinstance(prompt, str):
            return [self.encode_sync(prompt, add_special_tokens=request.add_special_tokens)]
        # The request's own check: one kind of item throughout (`CompletionRequest.__post_init__`).
        if isinstance(prompt[0], int):
            return [[item for item in prompt if isinstance(item, int)]]
        return [self._prompt_ids(item, request.add_special_tokens) for item in prompt]

    def _prompt_ids(self, item: str | int | list[int], add_special_tokens: bool) -> Sequence[int]:
        """One prompt of a list: text, encoded; token ids, as they are."""
        if isinstance(item, str):
            return self.encode_sync(item, add_special_tokens=add_special_tokens)
        assert isinstance(item, list)  # a list of ints is the whole prompt, taken above
        return list(item)

    def encode_sync(self, text: str, *, add_special_tokens: bool = False) -> TokenIds:
        if add_special_tokens or not self.turn_markers:
            ids = TokenIds.encoded(self._ids(text, add_special_tokens))
            self._report(0, len(ids))
            return ids
        return self._segmented(text)

    def _segmented(self, text: str) -> TokenIds:
        """`text`'s ids, segment by segment: cached ones looked up, the others tokenized in one batch."""
        segments = split_turns(text, self.turn_markers)
        keys = [digest(segment) for segment in segments]
        found = self.turn_cache.lookup(keys)
        hits = sum(len(ids) for ids in found if ids is not None)
        missing = {key: segment for key, segment, ids in zip(keys, segments, found, strict=True) if ids is None}
        tokenized = 0
        if missing:
            fresh = dict(zip(missing, self._encode_many(list(missing.values())), strict=True))
            self.turn_cache.store(fresh.items())
            tokenized = sum(len(ids) for ids in fresh.values())
            found = [ids if ids is not None else fresh[key] for key, ids in zip(keys, found, strict=True)]
        self._report(hits, tokenized)
        return TokenIds.joined(ids for ids in found if ids is not None)  # every miss was just filled

    def _report(self, hits: int, tokenized: int) -> None:
        if self._on_cache is not None:
            self._on_cache(hits, tokenized)

    def _encode_many(self, segments: list[str]) -> list[TokenIds]:
        """Segments not cached, tokenized: many or long ones with `encode_batch` (every core, the GIL
        released: a first render of a long conversation is cut at each turn), a short one inline."""
        if len(segments) == 1 and len(segments[0]) <= _RELEASE_GIL_CHARS:
            return [TokenIds.encoded(self._ids(segments[0]))]
        encodings = self._backend.encode_batch(segments, add_special_tokens=False)
        return [TokenIds.encoded(encoding.ids) for encoding in encodings]

    def _ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > _RELEASE_GIL_CHARS:
            return list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    @property
    def cached_bytes(self) -> int:
        """What the turn cache holds, by its own estimate (ids, keys and their slots)."""
        return self.turn_cache.bytes


def turn_markers(backend: Tokenizer) -> tuple[str, ...]:
    """The turn markers a text may be cut before, giving exactly the ids of the whole text.

    The tokenizer matches added tokens first and tokenizes the text between them
    separately, so a cut before one is a cut it makes itself, unless the marker
    takes whitespace from the text before it (`lstrip`), is not matched at all
    (a special token while `encode_special_tokens` is on), or may sit inside a longer
    added token (then an occurrence is not always the token)."""
    added = [token for token in backend.get_added_tokens_decoder().values()]
    contents = [token.content for token in added]
    usable = []
    for token in added:
        if token.content not in _TURN_MARKERS or token.lstrip or token.single_word:
            continue
        if token.special and backend.encode_special_tokens:
            continue
        if any(token.content in other and token.content != other for other in contents):
            continue
        usable.append(token.content)
    return tuple(usable)


def split_turns(text: str, markers: Sequence[str]) -> list[str]:
    """`text` cut right before every occurrence of a marker (empty pieces left out)."""
    cuts = {0, len(text)}
    for marker in markers:  # str.find scans at memory speed; a lookahead regex took 7 ms for 440K characters
        at = text.find(marker)
        while at != -1:
            cuts.add(at)
            at = text.find(marker, at + 1)
    bounds = sorted(cuts)
    return [text[start:end] for start, end in pairwise(bounds) if end > start]
