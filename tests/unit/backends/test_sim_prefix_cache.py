"""The sim's prefix cache alone (chained hashes, hits, LRU order) and the strict KV events config."""

from __future__ import annotations

import pytest

from engine.backends.sim.prefix_cache import PrefixCache, block_hash, prompt_hashes
from engine.config import ConfigError, kv_events_config
from wire.kv_events import BlockRemoved, BlockStored


def test_a_blocks_hash_depends_on_its_parent_salt_and_tokens() -> None:
    tokens = list(range(4))
    assert block_hash(None, tokens) == block_hash(None, tokens)
    assert block_hash(None, tokens) != block_hash(1, tokens)
    assert block_hash(None, tokens) != block_hash(None, tokens, "salt")
    assert -(2**63) <= block_hash(None, tokens) < 2**63
    hashes = prompt_hashes(list(range(10)), 4)
    assert len(hashes) == 2 and hashes[1] == block_hash(hashes[0], [4, 5, 6, 7])


def test_hits_are_leading_blocks_short_of_the_last_token() -> None:
    cache = PrefixCache(block_size=4, capacity=16)
    prompt = list(range(12))
    cache.store(cache.lookup(prompt))
    assert cache.lookup(prompt).cached_tokens == 8  # the last token is always computed
    assert cache.lookup([*prompt, 99]).cached_tokens == 12
    assert cache.lookup([99, *prompt]).cached_tokens == 0
    assert (cache.queries, cache.hits) == (12 + 12 + 13 + 13, 20)


def test_eviction_takes_the_least_recent_prompt_tail_first() -> None:
    cache = PrefixCache(block_size=2, capacity=4)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    cache.store(cache.lookup(a))
    cache.store(cache.lookup(b))
    cache.store(cache.lookup(a))  # touched: b is now the least recent
    events = cache.store(cache.lookup(c))
    hashes_b = prompt_hashes(b, 2)
    assert isinstance(events[0], BlockStored)
    assert events[1] == BlockRemoved(block_hashes=[hashes_b[1], hashes_b[0]], medium="GPU")
    assert cache.lookup([*a, 0]).cached_tokens == 4 and len(cache) == 4


def test_a_prompt_larger_than_the_cache_keeps_its_head() -> None:
    cache = PrefixCache(block_size=2, capacity=2)
    prompt = list(range(8))
    events = cache.store(cache.lookup(prompt))
    assert isinstance(events[-1], BlockRemoved) and events[-1].block_hashes == prompt_hashes(prompt, 2)[:1:-1]
    assert cache.lookup(prompt).cached_tokens == 4


def test_kv_events_config_is_vllms_and_strict() -> None:
    config = kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5600", "topic": "t"}')
    assert config.publishes and config.replay_endpoint is None and config.buffer_steps == 10_000
    assert not kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert not kv_events_config('{"publisher": "zmq"}').publishes
    with pytest.raises(ConfigError, match="endpont"):
        kv_events_config('{"enable_kv_cache_events": true, "endpont": "tcp://*:5600"}')
