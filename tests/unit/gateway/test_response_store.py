"""The in-memory Responses store: scoped to its owner, bounded per owner and in all, and
counting what its entries really take."""

from __future__ import annotations

import gc
import random
import tracemalloc
from typing import Any

import msgspec

from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessageParam,
    TopLogprob,
    Usage,
)
from gateway.config import ResponseStoreConfig
from gateway.apis.response_store import ENTRY_OVERHEAD, InProcess, ResponseStore, entry_size
from gateway.apis.responses import ResponsesPresenter, ResponsesRequest, decode_request, to_chat
from gateway.apis.translate import Presented, Turn, turn

A, B = "tenant:a", "tenant:b"


def bounds(**fields: int) -> ResponseStoreConfig:
    """Generous bounds but for the ones given."""
    big = {"max_entries": 1_000, "max_bytes": 1 << 30, "max_tenant_entries": 1_000, "max_tenant_bytes": 1 << 30}
    return ResponseStoreConfig(**{**big, **fields})


def test_store_evicts_the_least_recently_used_beyond_its_count() -> None:
    store = ResponseStore(bounds(max_entries=2, max_tenant_entries=2))
    store.put(A, "a", b'{"id":"a"}', [])
    store.put(A, "b", b'{"id":"b"}', [])
    assert store.get(A, "a") is not None  # a is now the more recent
    store.put(A, "c", b'{"id":"c"}', [])
    assert (store.get(A, "a") is not None, store.get(A, "b"), store.get(A, "c") is not None, len(store)) == (True, None, True, 2)


def test_store_is_bounded_in_bytes() -> None:
    one = entry_size(b"x" * 100, b"[]")
    store = ResponseStore(bounds(max_bytes=2 * one + 50, max_tenant_bytes=2 * one + 50))
    assert store.put(A, "a", b"x" * 100, []) and store.put(A, "b", b"x" * 100, [])
    assert store.bytes == 2 * one == 2 * (102 + ENTRY_OVERHEAD)
    store.put(A, "c", b"x" * 100, [])
    assert store.get(A, "a") is None and store.bytes == 2 * one
    assert not store.put(A, "huge", b"x" * 3 * one, []) and store.get(A, "huge") is None and len(store) == 2
    store.put(A, "b", b"x" * 10, [])  # replaced, not counted twice
    assert store.bytes == one + entry_size(b"x" * 10, b"[]")


def test_store_delete_and_what_it_answers() -> None:
    store = ResponseStore()
    conversation = [ChatMessageParam(role="user", content="Hi")]
    store.put(A, "r", b'{"id":"r"}', conversation)
    entry = store.get(A, "r")
    assert entry is not None and msgspec.json.encode(entry.response) == b'{"id":"r"}' and entry.conversation == conversation
    assert store.delete(A, "r") and not store.delete(A, "r") and store.get(A, "r") is None and store.bytes == 0


def test_another_owners_entry_is_not_there_for_it() -> None:
    store = ResponseStore(bounds(max_entries=2, max_tenant_entries=2))
    store.put(A, "a1", b'{"id":"a1"}', [ChatMessageParam(role="user", content="secret")])
    store.put(A, "a2", b'{"id":"a2"}', [])
    assert store.get(B, "a1") is None and not store.delete(B, "a1")
    store.put(A, "a3", b'{"id":"a3"}', [])  # B's look did not make a1 the more recent: it goes
    assert store.get(A, "a1") is None and store.get(A, "a2") is not None and store.get(A, "a3") is not None


def test_an_owner_past_its_share_evicts_its_own_oldest_first() -> None:
    one = entry_size(b"x" * 1000, b"[]")
    store = ResponseStore(bounds(max_bytes=10 * one, max_tenant_bytes=3 * one, max_entries=10, max_tenant_entries=4))
    store.put(A, "a", b"x" * 1000, [])
    for index in range(20):  # B's many large answers
        assert store.put(B, f"b{index}", b"x" * 1000, [])
    assert store.get(A, "a") is not None
    assert [store.get(B, f"b{index}") is not None for index in range(16, 20)] == [False, True, True, True]
    assert store.owner_bytes(B) == 3 * one and store.bytes == 4 * one
    for index in range(30):  # small ones: the count share binds first
        store.put(B, f"s{index}", b"{}", [])
    assert store.get(A, "a") is not None and len(store) == 5
    assert not store.put(B, "too-big", b"x" * 4 * one, [])  # over the share alone: refused, nothing evicted for it
    assert len(store) == 5


def test_every_owner_together_stays_in_the_whole_bound() -> None:
    one = entry_size(b"x" * 1000, b"[]")
    store = ResponseStore(bounds(max_bytes=5 * one, max_tenant_bytes=2 * one))
    for owner in ("tenant:1", "tenant:2", "tenant:3"):
        for index in range(2):
            store.put(owner, f"{owner}-{index}", b"x" * 1000, [])
    assert store.bytes == 5 * one and store.get("tenant:1", "tenant:1-0") is None  # the least recently used of anyone's
    for owner in ("tenant:1", "tenant:2", "tenant:3"):
        for index in range(2):
            store.delete(owner, f"{owner}-{index}")
    assert store.bytes == 0 and len(store) == 0 and store.owner_bytes("tenant:2") == 0


# ------------------------------------------------------------ what it holds, measured


def _answer(rng: random.Random) -> tuple[tuple[Turn[ResponsesRequest], ChatCompletion], Presented]:
    """A stored turn of varied size: a prompt of 0-8 KiB, an answer of 1-400 tokens, with
    logprobs (the worst case as Python objects: a list of byte values per token) half the time."""
    words = [f"w{rng.randrange(10_000)}" for _ in range(rng.randrange(1, 400))]
    with_logprobs = rng.random() < 0.5

    def entry(word: str) -> ChatLogprobToken:
        top = [TopLogprob(f"{word}{k}", -1.0 - k, list(f"{word}{k}".encode())) for k in range(5)] if with_logprobs else []
        return ChatLogprobToken(word, -0.5, list(word.encode()), top)

    message = ChatCompletionMessage(content=" ".join(words), reasoning="think " * rng.randrange(0, 50))
    logprobs = ChatLogprobs(content=[entry(word) for word in words]) if with_logprobs else None
    choice = ChatCompletionChoice(index=0, message=message, logprobs=logprobs, finish_reason="stop")
    completion = ChatCompletion(model="sim", choices=[choice], usage=Usage(prompt_tokens=10, completion_tokens=len(words), total_tokens=10 + len(words)))
    body: dict[str, Any] = {"model": "sim", "input": "x" * rng.randrange(0, 8192), "metadata": {"n": str(rng.random())}}
    if with_logprobs:
        body["top_logprobs"] = 5
    request = decode_request(msgspec.json.encode(body)).request
    meta = Presented(response_id=f"resp_{rng.getrandbits(128):032x}", model="sim", created=1_700_000_000, prompt_tokens=10)
    return (turn(request, to_chat(request, [])), completion), meta


async def test_what_the_store_holds_stays_near_its_bound() -> None:
    """Filled past its bound several times over with answers of varied size, the store's own
    allocations (tracemalloc) stay within a small factor of the bound: it counts what it holds."""
    bound = 4 << 20
    store = ResponseStore(bounds(max_bytes=bound, max_tenant_bytes=bound, max_entries=100_000, max_tenant_entries=100_000))
    rng = random.Random(7)
    answers = [_answer(rng) for _ in range(600)]  # made before measuring: only the store's part counts
    presenter = ResponsesPresenter(InProcess(store), A)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        offered = 0
        for (asked, completion), meta in answers:
            response = await presenter.whole(asked, meta, completion)
            offered += len(msgspec.json.encode(response))
            del response
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert offered > 3 * bound, "the answers must overflow the store for the test to mean anything"
    assert store.bytes <= bound
    assert held <= 1.25 * bound, f"the store holds {held / bound:.2f}x its bound"
    assert held >= 0.6 * store.bytes, "the store counts far more than it holds: its overhead is overstated"
