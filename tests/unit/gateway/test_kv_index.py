"""The KV cache index: chaining, removal by engine hash, clears, budget, stale, match."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from time import process_time

from gateway.render.token_ids import TokenIds
from gateway.routing.kv_index import KVIndex, block_keys, request_extra_keys
from wire.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

A = "http://a:8000"
B = "http://b:8000"
BS = 4


def tokens(blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + blocks * BS))


def stored(hashes: list[int], token_ids: list[int], parent: int | None = None, **extra: object) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=BS, **extra)  # type: ignore[arg-type]


def test_block_keys_chain_on_the_parent_and_skip_a_partial_block() -> None:
    keys = block_keys([*tokens(3), 99], BS)
    assert len(keys) == 3
    assert block_keys(tokens(3)[BS:], BS, parent_key=keys[0]) == keys[1:]
    assert block_keys(tokens(1, start=50) + tokens(2)[BS:], BS)[1] != keys[1]  # same tokens, other parent


def test_a_stored_chain_is_matched_from_the_start() -> None:
    index = KVIndex(block_size=BS)
    prompt = tokens(4)
    index.apply(A, [stored([1, 2], prompt[: 2 * BS])])
    index.apply(A, [stored([3], prompt[2 * BS : 3 * BS], parent=2)])  # chained on the engine's hash 2
    assert index.match(prompt) == {A: 3}
    assert index.match(prompt[BS:]) == {}  # not from the start
    assert index.size == 3 and index.counts() == {A: 3}


def test_match_reports_each_engines_longest_leading_run() -> None:
    index = KVIndex(block_size=BS)
    prompt = tokens(5)
    index.apply(A, [stored([1, 2, 3, 4, 5], prompt)])
    index.apply(B, [stored([9, 8], prompt[: 2 * BS])])
    assert index.match(prompt) == {A: 5, B: 2}
    assert index.match(prompt[: 3 * BS] + [7] * BS) == {A: 3, B: 2}
    assert index.match([7] * BS + prompt) == {}
    assert index.match(prompt[:3]) == {}  # no full block


def test_an_unknown_parent_is_counted_and_never_guessed() -> None:
    index = KVIndex(block_size=BS)
    index.apply(A, [stored([5], tokens(1, start=BS), parent=404)])
    assert index.size == 0 and index.ignored["unknown_parent"] == 1


def test_removal_by_engine_hash_and_all_blocks_cleared() -> None:
    index = KVIndex(block_size=BS)
    prompt = tokens(3)
    index.apply(A, [stored([1, 2, 3], prompt)])
    index.apply(B, [stored([1, 2, 3], prompt)])
    index.apply(A, [BlockRemoved(block_hashes=[3, 777])])  # 777: never stored, no harm
    assert index.match(prompt) == {A: 2, B: 3}
    index.apply(B, [AllBlocksCleared()])
    assert index.match(prompt) == {A: 2}
    assert index.counts() == {A: 2, B: 0}


def test_ranks_of_one_engine_are_kept_apart_and_matched_as_its_best() -> None:
    index = KVIndex(block_size=BS)
    prompt = tokens(3)
    index.apply(A, [stored([1, 2, 3], prompt)], rank=0)
    index.apply(A, [stored([1], prompt[:BS])], rank=1)
    index.apply(A, [BlockRemoved(block_hashes=[1])], rank=1)  # rank 0 still holds its block 1
    assert index.match(prompt) == {A: 3}
    index.clear(A, rank=0)
    assert index.match(prompt) == {}


def test_other_block_sizes_media_and_groups_are_ignored_with_a_reason() -> None:
    index = KVIndex(block_size=BS)
    index.apply(A, [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens(2), block_size=2 * BS)])
    index.apply(A, [stored([2], tokens(1), medium="CPU")])
    index.apply(A, [stored([3], tokens(1), group_idx=1)])
    index.apply(A, [stored([4, 5], tokens(1))])
    index.apply(A, [stored([6], [-1, *tokens(1)[1:]])])  # an id no token has
    index.apply(A, [stored([7], [1 << 32, *tokens(1)[1:]])])
    assert index.size == 0
    assert dict(index.ignored) == {"block_size": 1, "medium": 1, "group": 1, "shape": 1, "token_ids": 2}


def test_a_rendered_prompt_is_keyed_as_its_list_and_ids_past_4_bytes_match_nothing() -> None:
    index = KVIndex(block_size=BS)
    prompt = tokens(3, start=70_000)
    index.apply(A, [stored([1, 2, 3], prompt)])
    assert block_keys(TokenIds(prompt), BS) == block_keys(prompt, BS)
    assert index.match(TokenIds(prompt)) == index.match(prompt) == {A: 3}
    assert block_keys([1 << 32, *prompt[1:]], BS) == [] and index.match([1 << 32, *prompt[1:]]) == {}


def test_extra_keys_go_into_their_block() -> None:
    index = KVIndex(block_size=BS)
    prompt = tokens(2)
    # As vLLM publishes a LoRA request with a cache salt: the name in every block, the salt in the first.
    index.apply(A, [stored([1, 2], prompt, extra_keys=[["my-lora", "salt"], ["my-lora"]], lora_name="my-lora")])
    assert index.match(prompt) == {}
    assert index.match(prompt, request_extra_keys(2, lora_name="my-lora")) == {}
    assert index.match(prompt, request_extra_keys(2, lora_name="my-lora", cache_salt="salt")) == {A: 2}
    index.apply(B, [stored([1, 2], prompt)])
    assert index.match(prompt) == {B: 2}


def test_the_budget_evicts_the_least_recently_stored() -> None:
    index = KVIndex(block_size=BS, max_blocks=3)
    first, second = tokens(1, start=100), tokens(1, start=200)
    index.apply(A, [stored([1], first)])
    index.apply(B, [stored([2], second)])
    index.apply(A, [stored([3], tokens(1, start=300))])
    index.apply(A, [stored([1], first)])  # a cache hit reported again: now the youngest
    index.apply(B, [stored([4], tokens(1, start=400))])
    assert index.size == 3 and index.evicted == 1
    assert index.match(second) == {}
    assert index.match(first) == {A: 1}
    index.apply(B, [BlockRemoved(block_hashes=[2])])  # already evicted: nothing to undo
    assert index.counts() == {A: 2, B: 1}


def test_the_budget_evicts_the_oldest_held_after_removals_out_of_order() -> None:
    index = KVIndex(block_size=BS, max_blocks=6000)
    first, second = tokens(6000), tokens(6000, start=100_000)
    index.apply(A, [stored(list(range(1, 6001)), first)])
    # Removed out of store order, leaving A's first block and, 5998 removed blocks later, its last.
    index.apply(A, [BlockRemoved(block_hashes=[h for h in range(5999, 1, -1)])])
    assert index.counts() == {A: 2}
    index.apply(B, [stored(list(range(1, 5999)), second[: 5998 * BS])])
    assert index.size == 6000 and index.evicted == 0
    index.apply(B, [stored([5999], second[5998 * BS : 5999 * BS], parent=5998)])
    assert index.evicted == 1 and index.match(first) == {}  # A's first block, the oldest, went first
    assert index.counts() == {A: 1, B: 5999}
    index.apply(B, [stored([6000], second[5999 * BS :], parent=5999)])
    assert index.evicted == 2 and index.counts() == {A: 0, B: 6000}  # then A's last, past the gap
    index.apply(A, [stored([1], first[:BS])])
    assert index.counts() == {A: 1, B: 5999} and index.match(second) == {}  # then B's first
    index.apply(A, [BlockRemoved(block_hashes=[6000, 2])])  # evicted or removed already: nothing to undo
    assert index.size == 6000


def test_the_budget_counts_after_the_batch_whose_removals_it_carries() -> None:
    """An engine at capacity publishes its stores and, in the same batch, the removals that
    made room: the index, at its budget too, then forgets nothing the engine still holds."""
    index = KVIndex(block_size=BS, max_blocks=2)
    first, second = tokens(1), tokens(1, start=100)
    index.apply(A, [stored([1], first)])
    index.apply(A, [stored([2], second)])
    index.apply(A, [stored([3], tokens(1, start=200)), BlockRemoved(block_hashes=[2])])
    assert index.evicted == 0 and index.counts() == {A: 2}
    assert index.match(first) == {A: 1} and index.match(second) == {}


def test_a_block_held_under_another_engine_hash_is_counted_not_indexed_twice() -> None:
    index = KVIndex(block_size=BS)
    prompt = tokens(1)
    index.apply(A, [stored([1], prompt)])
    index.apply(A, [stored([2], prompt)])  # the same tokens under another hash
    assert index.size == 1 and index.ignored["duplicate"] == 1
    index.apply(A, [BlockRemoved(block_hashes=[2])])  # never indexed: nothing to undo
    assert index.match(prompt) == {A: 1}


def traversed(root: object) -> int:
    """The references the cyclic GC follows among the objects `root` holds: those of each
    tracked object reachable from it (classes and what they hold left out)."""
    seen: set[int] = set()
    stack = [root]
    visits = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type) or not gc.is_tracked(obj):
            continue
        seen.add(id(obj))
        referents = gc.get_referents(obj)
        visits += len(referents)
        stack.extend(referents)
    return visits


def test_the_cyclic_gc_does_not_walk_the_blocks() -> None:
    """A collection of the oldest generation walks every tracked container: an index of a
    million blocks in one would cost ~100 ms a collection, a pause of every stream."""
    index = KVIndex(block_size=16)
    empty = traversed(index)
    for event in chain(20_000):
        index.apply(A, [event])
    index.apply(B, [BlockStored(block_hashes=[1], token_ids=list(range(16)), block_size=16)])  # a second source
    assert index.size == 20_001
    assert traversed(index) - empty < 100


def test_stale_is_per_engine_until_its_cache_is_cleared() -> None:
    index = KVIndex(block_size=BS)
    index.mark_stale(A, "gap", rank=1)
    assert index.is_stale(A) and index.stale_reason(A) == "gap" and not index.is_stale(B)
    index.apply(A, [AllBlocksCleared()], rank=1)
    assert not index.is_stale(A)
    index.mark_stale(A, "decode")
    index.mark_fresh(A)
    assert not index.is_stale(A)


def test_forget_drops_an_engine_and_its_rank_ids_are_reused() -> None:
    index = KVIndex(block_size=BS)
    index.apply(A, [stored([1], tokens(1))])
    index.forget(A)
    index.apply(B, [stored([1], tokens(1))])
    assert index.match(tokens(1)) == {B: 1} and index.counts() == {B: 1}


def chain(blocks: int, per_event: int = 32) -> Iterator[BlockStored]:
    """One long prompt's blocks of 16 tokens, stored `per_event` at a time, with 64-bit engine hashes as vLLM's."""
    base = 1 << 62
    for start in range(0, blocks, per_event):
        ids = [(start * 16 + i) % 150_000 for i in range(per_event * 16)]
        parent = None if start == 0 else base + start - 1
        hashes: list[BlockHash] = [base + i for i in range(start, start + per_event)]
        yield BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=ids, block_size=16)


def test_cost_of_apply_and_memory_per_block() -> None:
    """Prints the CPU per stored block of 16 tokens and the bytes per block held."""
    blocks = 100_000
    index = KVIndex(block_size=16, max_blocks=blocks)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for event in chain(blocks):  # built inside: the hashes the index keeps are counted, the rest is freed
        index.apply(A, [event])
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.size == blocks
    events = list(chain(blocks))
    began = process_time()
    for event in events:
        index.apply(B, [event])  # at the budget: each store evicts one of A's
    spent = process_time() - began
    assert index.counts() == {A: 0, B: blocks}
    print(f"\napply: {spent / blocks * 1e6:.2f} µs per stored block of 16 tokens (budget full, evicting); "
          f"index: {held / blocks:.0f} bytes per block")
    assert spent / blocks < 50e-6  # generous for a shared machine; measured ~1-2 µs
