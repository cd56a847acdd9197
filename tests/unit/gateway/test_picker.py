"""The picker (`gateway.routing.picker`): filters, scorers and the pick, as a plain function of
the request's facts and the pool's datastore; the kv_cache cost checked against its
documented formula, the datastore's index fed by events."""

from __future__ import annotations

import itertools
import random

import pytest

from gateway.config import Balancing, EngineEndpoint, Health
from gateway.edge.errors import EngineUnavailable, InvalidRequest
from gateway.routing.datastore import EndpointStore, Load
from gateway.routing.kv_index import KVIndex
from gateway.routing.picker import Picker, RequestFacts
from wire.kv_events import BlockHash, BlockStored

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
NOW = 1000.0


def store_of(*urls: str, index: KVIndex | None = None, sessions: int = 0, **health: float) -> EndpointStore:
    members = [EngineEndpoint(url=url) for url in urls]
    return EndpointStore(members, Health(**health), index=index, max_sessions=sessions)  # type: ignore[arg-type]


def facts(prompt: list[int] | None = None, **known: object) -> RequestFacts:
    return RequestFacts(prompt=prompt, **known)  # type: ignore[arg-type]


# ------------------------------------------------------------ filters


def test_filters_drop_tried_open_and_refusing_engines_and_say_why_none_is_left() -> None:
    store = store_of(A, B, C, failure_threshold=1, open_s=60)
    picker = Picker(Balancing())
    store.failed(store.endpoints[A], NOW)
    assert {picker.pick(store, facts(tried=frozenset({B})), NOW).endpoint.url for _ in range(20)} == {C}
    with pytest.raises(EngineUnavailable, match=r"every circuit is open \(2 tried\)"):
        picker.pick(store, facts(tried=frozenset({B, C})), NOW)
    store.succeeded(store.endpoints[A])
    assert picker.pick(store, facts(tried=frozenset({B, C})), NOW).endpoint.url == A
    for endpoint in store.endpoints.values():
        endpoint.off_at = NOW - 1  # each refused the generate API (403) a second ago
    with pytest.raises(EngineUnavailable, match="no engine serves the generate API"):
        picker.pick(store, facts(), NOW)


def test_a_constraint_keeps_the_engines_known_to_enforce_it_and_those_not_probed_yet() -> None:
    store = store_of(A, B, C)
    picker = Picker(Balancing())
    store.endpoints[A].routes, store.endpoints[A].constraints = frozenset({"tokens"}), frozenset({"json"})
    store.endpoints[B].routes, store.endpoints[B].constraints = frozenset({"tokens"}), frozenset({"json", "regex"})
    picked = {picker.pick(store, facts(constraint="regex"), NOW).endpoint.url for _ in range(60)}
    assert picked == {B, C}  # C is not probed yet: its client probes it and asks again
    store.endpoints[C].routes = frozenset({"tokens"})
    with pytest.raises(InvalidRequest, match=r"enforces structured_outputs\.grammar"):
        picker.pick(store, facts(constraint="grammar"), NOW)


# ------------------------------------------------------------ least_outstanding, prefix_affinity


def test_power_of_two_choices_prefers_the_less_loaded_and_spreads_over_equals() -> None:
    store = store_of(A, B)
    picker = Picker(Balancing(), rng=random.Random(7))
    store.endpoints[A].outstanding = 5
    assert {picker.pick(store, facts(), NOW).endpoint.url for _ in range(50)} == {B}
    even = store_of(A, B, C)
    assert {picker.pick(even, facts(), NOW).endpoint.url for _ in range(200)} == {A, B, C}


def test_prefix_affinity_keeps_a_prefix_on_one_engine_and_bounds_the_load() -> None:
    store = store_of(*(f"http://e{i}" for i in range(4)))
    picker = Picker(Balancing(mode="prefix_affinity", prefix_tokens=8))
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    assert len({picker.pick(store, facts([*shared, i, i + 1]), NOW).endpoint.url for i in range(50)}) == 1
    assert len({picker.pick(store, facts([i, 7, 7, 7, 7, 7, 7, 7]), NOW).endpoint.url for i in range(200)}) == 4
    prompt = [9] * 16
    home = picker.pick(store, facts(prompt), NOW).endpoint
    home.outstanding = 10  # far above the pool's mean (10/4 × 1.25 + 1)
    assert picker.pick(store, facts(prompt), NOW).endpoint is not home
    home.outstanding = 1
    assert picker.pick(store, facts(prompt), NOW).endpoint is home  # back under the bound: back home


# ------------------------------------------------------------ kv_cache: the formula


def stored(prompt: list[int], hashes: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=list[BlockHash](hashes), parent_block_hash=None, token_ids=prompt[: 16 * len(hashes)], block_size=16
    )


def kv_store(**known: object) -> tuple[EndpointStore, KVIndex]:
    index = KVIndex(block_size=16)
    return store_of(A, B, C, index=index, **known), index  # type: ignore[arg-type]


PROMPT = list(range(1000, 1000 + 16 * 100))  # 100 blocks


def test_the_engine_holding_the_longest_prefix_wins_and_says_why() -> None:
    store, index = kv_store()
    index.apply(A, [stored(PROMPT, list(range(10)))])
    index.apply(B, [stored(PROMPT, list(range(100, 190)))])
    index.apply(C, [stored(PROMPT, list(range(200, 240)))])
    choice = Picker(Balancing(mode="kv_cache")).pick(store, facts([*PROMPT, 5, 6, 7]), NOW)
    assert choice.endpoint.url == B
    assert choice.why == f"cache: {90 * 16} tokens cached, cost {10 * 16 + 3}"
    assert choice.prefill_tokens == 10 * 16 + 3  # what B prefills: its uncached blocks and the tail


def test_an_overloaded_holder_is_passed_over_exactly_where_the_formula_says() -> None:
    # B holds 80 more blocks (1,280 tokens of prefill) than the idle A: worth 2.5 requests at 512 tokens each.
    store, index = kv_store()
    del store.endpoints[C]
    index.apply(A, [stored(PROMPT, list(range(10)))])
    index.apply(B, [stored(PROMPT, list(range(100, 190)))])
    for outstanding, winner in [(2, B), (3, A)]:
        store.endpoints[B].outstanding = outstanding
        assert Picker(Balancing(mode="kv_cache")).pick(store, facts(PROMPT), NOW).endpoint.url == winner
    assert Picker(Balancing(mode="kv_cache", kv_load_tokens=100)).pick(store, facts(PROMPT), NOW).endpoint.url == B


@pytest.mark.parametrize(
    ("matched", "outstanding", "queued", "waiting", "usage"),
    list(itertools.product([0, 50, 100], [0, 4], [0, 3000], [0, 6], [0.0, 0.9])),
)
def test_the_winner_has_the_lowest_cost(matched: int, outstanding: int, queued: int, waiting: int, usage: float) -> None:
    store, index = kv_store()
    for url, held, base in ((A, matched, 0), (B, 50, 1000), (C, 20, 2000)):
        if held:
            index.apply(url, [stored(PROMPT, list(range(base, base + held)))])
    a, b, c = (store.endpoints[url] for url in (A, B, C))
    a.outstanding, a.prefill_tokens = outstanding, queued
    a.load = Load(waiting=waiting, kv_usage=usage, cache_blocks=200)
    b.outstanding, b.prefill_tokens, b.load = 2, 800, Load(waiting=1, kv_usage=0.5, cache_blocks=100)
    c.outstanding, c.load = 1, Load(kv_usage=0.2)  # its cache's size unknown: no fill term
    balancing = Balancing(mode="kv_cache")
    choice = Picker(balancing).pick(store, facts(PROMPT), NOW)
    holds = {A: matched, B: 50, C: 20}

    def cost(url: str) -> float:  # the module's formula, written out
        e = store.endpoints[url]
        return (
            len(PROMPT) - 16 * holds[url] + e.prefill_tokens + 512 * e.outstanding + 512 * e.load.waiting
            + 2048 * e.load.kv_usage + (4096 * holds[url] / e.load.cache_blocks if e.load.cache_blocks else 0)
        )

    costs = {url: cost(url) for url in (A, B, C)}
    assert costs[choice.endpoint.url] == min(costs.values())
    assert choice.why is not None and choice.why.endswith(f"cost {costs[choice.endpoint.url]:g}")
    assert choice.why.split(":")[1].strip().startswith(f"{holds[choice.endpoint.url] * 16} tokens cached")


def test_a_tie_goes_to_the_sessions_engine_of_the_same_tenant_then_to_the_hash() -> None:
    store, _ = kv_store(sessions=100)
    picker = Picker(Balancing(mode="kv_cache"))
    first = picker.pick(store, facts(PROMPT[:64], session="conversation-1", tenant="acme"), NOW)
    assert first.why is not None and first.why.startswith("hash: 0 tokens cached")
    other = [token + 1 for token in PROMPT[:64]]  # another prompt: a tie that the session breaks
    again = picker.pick(store, facts(other, session="conversation-1", tenant="acme"), NOW)
    assert (again.endpoint, again.why) == (first.endpoint, first.why.replace("hash", "session", 1))
    elsewhere = picker.pick(store, facts(other, session="conversation-1", tenant="globex"), NOW)
    assert elsewhere.why is not None and elsewhere.why.startswith("hash")  # another tenant's session
    cold = {picker.pick(store, facts([i] * 32), NOW).endpoint.url for i in range(60)}
    assert cold == {A, B, C}  # new prompts spread over the pool


def test_new_conversations_sharing_a_cached_head_spread_and_a_long_one_stays_with_its_blocks() -> None:
    head = PROMPT[: 16 * 40]  # a system prompt and tools every engine holds
    store, index = kv_store()
    for i, url in enumerate((A, B, C)):
        index.apply(url, [stored(head, list(range(100 * i, 100 * i + 40)))])
    picker = Picker(Balancing(mode="kv_cache"))
    firsts = [picker.pick(store, facts([*head, *[7000 + n] * 40]), NOW) for n in range(60)]
    assert {choice.endpoint.url for choice in firsts} == {A, B, C}  # hashed past the head, not on it
    assert all(choice.why is not None and choice.why.startswith("hash: 640 tokens cached") for choice in firsts)

    # A's cache is full (a long conversation's history besides the head), B's and C's hold the
    # head only: a new conversation is cheaper on an emptier engine by the fill term (its head
    # prefilled once more there, 640 tokens, against up to 4,096), the long one stays with A.
    for endpoint in store.endpoints.values():
        endpoint.load = Load(cache_blocks=340)
    history = [*head, *range(5000, 5000 + 16 * 300)]
    index.apply(A, [stored(history, list(range(40)) + list(range(1000, 1300)))])
    new = [*head, *[9] * 40]
    fresh = picker.pick(store, facts(new), NOW)
    assert fresh.endpoint.url in (B, C) and fresh.why is not None and fresh.why.startswith("hash")  # B, C tie
    assert picker.pick(store, facts([*history, 1, 2, 3]), NOW).endpoint.url == A
    off = Picker(Balancing(mode="kv_cache", kv_fill_tokens=0)).pick(store, facts(new), NOW)
    assert off.why is not None and off.why.startswith("hash")  # without the term: a three-way tie of equal heads


def test_the_hash_moves_only_the_prompts_of_an_engine_that_leaves() -> None:
    prompts = [[i] * 32 for i in range(200)]
    store, _ = kv_store()
    picker = Picker(Balancing(mode="kv_cache"))
    before = {i: picker.pick(store, facts(p), NOW).endpoint.url for i, p in enumerate(prompts)}
    del store.endpoints[C]
    after = {i: picker.pick(store, facts(p), NOW).endpoint.url for i, p in enumerate(prompts)}
    assert all(after[i] == url for i, url in before.items() if url != C)
    assert {url for url in before.values()} == {A, B, C}


def test_a_stale_index_hashes_the_prefix_instead() -> None:
    store, index = kv_store()
    index.apply(B, [stored(PROMPT, list(range(90)))])
    index.mark_stale(A, "lost a batch")
    balancing = Balancing(mode="kv_cache")
    choice = Picker(balancing).pick(store, facts(PROMPT), NOW)
    assert choice.why == "hash: an engine's KV index is stale"
    by_prefix = Picker(Balancing(mode="prefix_affinity")).pick(store, facts(PROMPT), NOW)
    assert choice.endpoint is by_prefix.endpoint


def test_the_decode_pool_of_p_d_is_picked_by_load_alone() -> None:
    store, index = kv_store()
    index.apply(A, [stored(PROMPT, list(range(90)))])  # would win on cache: the decode side ignores it
    store.endpoints[A].outstanding = 1
    store.endpoints[B].load = Load(waiting=2)
    choice = Picker(Balancing(mode="kv_cache"), "load").pick(store, facts(PROMPT), NOW)
    assert choice.endpoint.url == C and choice.why == "load: cost 0"


def test_a_salted_prompt_matches_only_blocks_stored_with_its_salt() -> None:
    store, index = kv_store()
    salted = BlockStored(
        block_hashes=list[BlockHash](range(40)), parent_block_hash=None, token_ids=PROMPT[: 16 * 40], block_size=16,
        extra_keys=[["tenant-a"], *([None] * 39)],  # vLLM's: the salt in the first block's extra keys
    )
    index.apply(B, [salted])
    index.apply(C, [stored(PROMPT, list(range(100, 110)))])  # unsalted
    picker = Picker(Balancing(mode="kv_cache"))
    assert picker.pick(store, facts(PROMPT, cache_salt="tenant-a"), NOW).endpoint.url == B
    assert picker.pick(store, facts(PROMPT), NOW).endpoint.url == C  # the same tokens unsalted
    other = picker.pick(store, facts(PROMPT, cache_salt="tenant-b"), NOW)
    assert other.why is not None and other.why.startswith("hash: 0 tokens cached")
