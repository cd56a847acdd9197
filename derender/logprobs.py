"""Token-id logprobs from the generate wire → OpenAI chat and completion logprobs.

Decoded strings and byte lists come from the vocabulary's per-token cache, so
formatting costs one dict lookup per candidate. `top_logprobs` keeps the
engine's order (sampled token first, then by rank) and is cut to the count the
client asked for, as vLLM's coupled server does.
"""

from __future__ import annotations

from collections.abc import Sequence

from derender.vocab import TokenVocab
from wire.openai_schema import ChatLogprobToken, CompletionLogprobs, TopLogprob
from wire.protocol import GenerateLogProbsContent

# JSON has no -inf; OpenAI clients see this floor instead, as from vLLM.
LOGPROB_FLOOR = -9999.0


def chat_logprobs(vocab: TokenVocab, entries: Sequence[GenerateLogProbsContent], top_n: int) -> list[ChatLogprobToken]:
    out: list[ChatLogprobToken] = []
    piece = vocab.piece
    for entry in entries:
        token, raw = piece(entry.token_id)
        top = [
            TopLogprob(token=p[0], logprob=max(c.logprob, LOGPROB_FLOOR), bytes=p[1])
            for c in entry.top_logprobs[:top_n]
            for p in (piece(c.token_id),)
        ]
        out.append(
            ChatLogprobToken(token=token, logprob=max(entry.logprob, LOGPROB_FLOOR), bytes=raw, top_logprobs=top)
        )
    return out


def completion_logprobs(
    vocab: TokenVocab,
    entries: Sequence[GenerateLogProbsContent],
    top_n: int,
    text_offset: int,
) -> CompletionLogprobs:
    """Legacy completions logprobs; `text_offset` is where this step's text starts."""
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    piece = vocab.piece
    for entry in entries:
        token = piece(entry.token_id)[0]
        tokens.append(token)
        values.append(max(entry.logprob, LOGPROB_FLOOR))
        offsets.append(text_offset)
        text_offset += len(token)
        tops.append({piece(c.token_id)[0]: max(c.logprob, LOGPROB_FLOOR) for c in entry.top_logprobs[:top_n]})
    return CompletionLogprobs(text_offset=offsets, token_logprobs=values, tokens=tokens, top_logprobs=tops)


def completion_from_chat_logprobs(
    entries: Sequence[ChatLogprobToken], top_n: int, text_offset: int
) -> CompletionLogprobs:
    """Decoded (text-mode) logprobs in the legacy completions shape."""
    offsets: list[int] = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return CompletionLogprobs(
        text_offset=offsets,
        token_logprobs=[entry.logprob for entry in entries],
        tokens=[entry.token for entry in entries],
        top_logprobs=[{top.token: top.logprob for top in entry.top_logprobs[:top_n]} for entry in entries],
    )
