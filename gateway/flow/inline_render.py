"""Small renders on the event loop, the rest on the renderer's threads.

A render hands its work to a thread so that a long one does not hold up the
other requests; for a short prompt the hand-off costs more than the render.
Below `_RELEASE_GIL_CHARS` (4,096 characters a segment) the tokenizer holds
the GIL for the whole encode, and the template is Python: a thread renders
such a prompt no faster and no more concurrently than the loop would, and the
loop gets the result back only once the thread has given up the GIL (the
interpreter's switch interval is 5 ms) and a wake-up has gone through the
self-pipe. Measured with 128 chat streams started at once on one worker
(issue #32): a render of ~60 µs (cached turns) to ~1 ms (4,000 new
characters) took 37 ms p50 from hand-off to result, most of the TTFT the
gateway added; inline, it costs its own time. The ids are the same either way:
the same renderer, the same turn cache.
"""

from __future__ import annotations

from wire.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.edge.validate import chat_text_chars, completion_text_chars
from gateway.render.local import LocalRenderer


async def chat_prompt(
    renderer: LocalRenderer, request: ChatCompletionRequest, suffix: str | None, inline_chars: int
) -> list[int]:
    """The chat request's prompt ids, then `suffix`'s: on the loop when its text is at most
    `inline_chars` characters."""
    if chat_text_chars(request) <= inline_chars:
        return renderer.chat_sync(request, suffix)
    return await renderer.chat(request, suffix=suffix)


async def completion_prompts(renderer: LocalRenderer, request: CompletionRequest, inline_chars: int) -> list[list[int]]:
    """The completion request's prompts' ids: on the loop when their text is at most `inline_chars`."""
    if completion_text_chars(request) <= inline_chars:
        return renderer.completion_prompts_sync(request)
    return await renderer.completion_prompts(request)
