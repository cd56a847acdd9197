"""Request checks and readings that the backends and the engine server share.

The engine server (`engine.generate`) refuses a request before any backend sees it, with
HTTP errors that name the field; a backend driven directly (a test, an embedding) repeats
the checks it relies on with `BackendRequestError`, the same for every backend. Written once
here: what a prompt must be for a backend to take it, which token id falls outside
the vocabulary, how many tokens a choice may produce, whose EOS ids end it, and how many top
logprobs a token carries.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from engine.backends.base import BackendInfo, BackendRequest, BackendRequestError

ALL_LOGPROBS = 20
"""What `logprobs=-1` (the whole vocabulary) is served as: OpenAI's `top_logprobs` ceiling and
vLLM's default `max_logprobs` (151k entries a token for Qwen3 would help no client)."""


def check_prompt(request: BackendRequest, info: BackendInfo, running: Container[str]) -> None:
    """A request a backend may take: an id not already running, a prompt of at least one token
    that leaves room for output within `max_model_len`, every id in the vocabulary."""
    if request.request_id in running:
        raise BackendRequestError(f"request id {request.request_id!r} is already running")
    ids = request.prompt_token_ids
    if not ids:
        raise BackendRequestError("the prompt must hold at least one token")
    if len(ids) >= info.max_model_len:
        raise BackendRequestError(
            f"the prompt ({len(ids)} tokens) is longer than the maximum model length allows:"
            f" max_model_len={info.max_model_len} leaves no room for output"
        )
    check_ids(ids, info.vocab_size, "the prompt")


def check_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    """Every id of `what` (the prompt, `allowed_token_ids`, `logit_bias`) in the vocabulary."""
    bad = first_out_of_vocab(ids, vocab)
    if bad is not None:
        raise BackendRequestError(f"token id {bad} in {what} is out of vocabulary (size {vocab})")


def first_out_of_vocab(ids: Sequence[int], vocab: int) -> int | None:
    """The first id outside [0, vocab), in order; None when every id fits.

    Two C-level passes (min, max) clear the common case; only a list that holds a bad id
    is scanned in Python.
    """
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return None
    return next((token for token in ids if not 0 <= token < vocab), None)


def output_limit(max_tokens: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The most tokens one choice may produce: `max_tokens` capped by the context the prompt
    leaves, or all of that context when `max_tokens` is unset."""
    room = max_model_len - prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


def request_eos(request: BackendRequest, info: BackendInfo) -> frozenset[int]:
    """The ids that end a choice as EOS (before `ignore_eos`): the request's, else the backend's."""
    return request.eos_token_ids or info.eos_token_ids


def logprobs_width(asked: int | None) -> int | None:
    """How many top logprobs each token carries: None without logprobs, `ALL_LOGPROBS` for -1."""
    if asked is None:
        return None
    return ALL_LOGPROBS if asked < 0 else asked
