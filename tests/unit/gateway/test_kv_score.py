"""The kv_cache scorer (`gateway.routing.kv_score`): a plain function of the engines' cached
prefix and load, checked against its documented cost formula."""

from __future__ import annotations

import itertools

import pytest

from gateway.config import Balancing, EngineEndpoint, Health
from gateway.routing.kv_index import KVIndex
from gateway.routing.kv_score import EngineView, score
from gateway.upstream.pool import Pool
from wire.kv_events import BlockHash, BlockStored

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def chosen(views: list[EngineView], *, blocks: int = 100, load_tokens: float = 512, session: str | None = None,
           key: bytes = b"first block") -> tuple[str, str]:
    scored = score(views, prompt_blocks=blocks, block_size=16, load_tokens=load_tokens, session_engine=session, tie_key=key)
    assert scored is not None
    return scored.url, scored.rule


def test_the_engine_holding_the_longest_prefix_wins() -> None:
    views = [EngineView(A, 0, 10), EngineView(B, 0, 90), EngineView(C, 0, 40)]
    assert chosen(views) == (B, "cache")


def test_an_overloaded_holder_is_passed_over_exactly_where_the_formula_says() -> None:
    # B holds 80 more blocks (1,280 tokens of prefill) than the idle A: worth 2.5 requests at 512 tokens each.
    for outstanding, winner in [(2, B), (3, A)]:
        views = [EngineView(A, 0, 10), EngineView(B, outstanding, 90)]
        assert chosen(views)[0] == winner, outstanding
    # the same loads with load worth less: B keeps it
    assert chosen([EngineView(A, 0, 10), EngineView(B, 3, 90)], load_tokens=100)[0] == B


def test_a_tie_goes_to_the_sessions_engine_then_to_the_hash_of_the_first_block() -> None:
    cold = [EngineView(A, 0, 0), EngineView(B, 0, 0), EngineView(C, 0, 0)]
    assert chosen(cold, session=C) == (C, "session")
    picks = {chosen(cold, key=f"prompt {i}".encode()) for i in range(60)}
    assert {rule for _, rule in picks} == {"hash"}
    assert {url for url, _ in picks} == {A, B, C}  # spread over the pool
    assert chosen(cold, key=b"same") == chosen(list(reversed(cold)), key=b"same")  # not the order given


def test_the_hash_moves_only_the_keys_of_an_engine_that_leaves() -> None:
    three = [EngineView(url, 0, 0) for url in (A, B, C)]
    two = [EngineView(url, 0, 0) for url in (A, B)]
    keys = [f"k{i}".encode() for i in range(200)]
    before = {key: chosen(three, key=key)[0] for key in keys}
    after = {key: chosen(two, key=key)[0] for key in keys}
    assert all(after[key] == url for key, url in before.items() if url != C)


def test_a_stale_index_declines_so_the_pool_hashes() -> None:
    views = [EngineView(A, 0, 90), EngineView(B, 0, 0, stale=True)]
    assert score(views, prompt_blocks=100, block_size=16, load_tokens=512, session_engine=None, tie_key=b"k") is None


@pytest.mark.parametrize(("matched", "outstanding"), list(itertools.product([0, 5, 50, 100], [0, 1, 4])))
def test_the_winner_has_the_lowest_cost(matched: int, outstanding: int) -> None:
    views = [EngineView(A, outstanding, matched), EngineView(B, 2, 50), EngineView(C, 1, 20)]
    scored = score(views, prompt_blocks=100, block_size=16, load_tokens=512, session_engine=None, tie_key=b"k")
    assert scored is not None
    costs = {v.url: (100 - v.matched_blocks) * 16 + 512 * v.outstanding for v in views}
    assert scored.cost == costs[scored.url] == min(costs.values())
    assert scored.explain(16).startswith(f"{scored.rule}: {scored.matched_blocks * 16} tokens cached")


# ------------------------------------------------------------ the pool in kv_cache mode, its index fed by events


def stored(prompt: list[int], hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=list[BlockHash](hashes), parent_block_hash=None, token_ids=prompt[: 16 * len(hashes)], block_size=16)


def kv_pool(index: KVIndex) -> Pool:
    members = [EngineEndpoint(url=url, kv_events=f"tcp://127.0.0.1:{5557 + i}") for i, url in enumerate((A, B, C))]
    return Pool(members, Health(), Balancing(mode="kv_cache"), index=index)


def test_the_pool_sends_a_prompt_where_its_blocks_are_and_says_why() -> None:
    index = KVIndex(block_size=16)
    pool = kv_pool(index)
    prompt = list(range(1000, 1000 + 16 * 40))
    index.apply(B, [stored(prompt, list(range(30)))])
    index.apply(C, [stored(prompt, [7, 8])])
    endpoint, why = pool.choose(prompt=[*prompt, 5, 6, 7])
    assert endpoint.url == B
    assert why == f"cache: {30 * 16} tokens cached, cost {10 * 16}"
    pool.endpoints[B].outstanding = 2  # B's cost: 10 × 16 + 2 × 512 = 1,184; C's: 38 × 16 = 608
    assert pool.choose(prompt=prompt)[0].url == C


def test_a_cold_session_sticks_to_its_first_engine_and_a_stale_index_hashes() -> None:
    index = KVIndex(block_size=16)
    pool = kv_pool(index)
    prompt = list(range(50, 50 + 16 * 4))
    first, why = pool.choose(prompt=prompt, session="conversation-1")
    assert why is not None and why.startswith("hash: 0 tokens cached")
    other = [token + 1 for token in prompt]  # another prompt: a tie that the session breaks
    assert pool.choose(prompt=other, session="conversation-1") == (first, why.replace("hash", "session", 1))
    index.mark_stale(A, "lost a batch")
    endpoint, why = pool.choose(prompt=prompt, session="conversation-1")
    assert why == "hash: an engine's KV index is stale"
    assert endpoint == pool._by_prefix(list(pool.endpoints.values()), prompt)
