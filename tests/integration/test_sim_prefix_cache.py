"""The sim engine's prefix cache on loopback: cached tokens in every mode's usage, vLLM's KV cache
events on real ZMQ sockets (stores, evictions, resets, replay, both encodings), prefill time,
the prefill lane (one prompt at a time, its waiting count, aborts leaving it, lookups as a
prefill starts), the metrics and the capabilities document."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine.backends.base import PrefixCaching
from engine.backends.sim.prefix_cache import prompt_hashes
from engine.config import KVEventsConfig
from engine.state import EngineState
from tests.support.engine import engine_server, post_json, stream_events
from tests.support.waiting import wait_until
from wire.kv_events import END_SEQ, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch, decode_batch, seq_bytes, seq_of

GENERATE = "/inference/v1/generate"
BLOCK = 16
TOPIC = "kv"
POLL_MS = 5000
ABORT = "/inference/v1/abort_requests"
TIMER_SLACK_S = 0.002
"""Loop timers may fire up to a clock tick early: the floors below allow for it."""


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    """The test's own ZMQ sockets, closed on the test's loop (an asyncio socket left to the
    collector after its loop closed fails in its finalizer)."""
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def subscribe(context: zmq.asyncio.Context) -> Iterator[Callable[[str], Subscriber]]:
    """Subscribers on an endpoint, held here and closed at the test's end (one the test's
    frame dropped would be finalized open, which warns)."""
    made: list[Subscriber] = []

    def subscriber(endpoint: str) -> Subscriber:
        made.append(Subscriber(context, endpoint))
        return made[-1]

    yield subscriber
    for each in made:
        each.socket.close(linger=0)


def prose(tokenizer: Any, count: int, theme: str = "river") -> list[int]:
    """`count` ids of plain text (no special tokens), different per `theme`."""
    ids: list[int] = []
    line = 0
    while len(ids) < count:
        ids += tokenizer.encode(f" The {theme} ran past mill number {line} and the stones kept turning.")
        line += 1
    return ids[:count]


@asynccontextmanager
async def cached_engine(tokenizer_dir: Path, **options: Any) -> AsyncIterator[tuple[str, EngineState]]:
    """An engine with prefix caching and KV events on loopback ports the OS picks."""
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        topic=TOPIC,
        buffer_steps=options.pop("buffer_steps", 100),
    )
    async with engine_server(
        tokenizer_dir, enable_prefix_caching=True, block_size=BLOCK, kv_events_config=events, backend_options=options
    ) as served:
        yield served


async def generate(session: aiohttp.ClientSession, base: str, ids: list[int], **extra: Any) -> Any:
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 4, "seed": 1}, **extra}
    status, answer, _ = await post_json(session, base + GENERATE, body)
    assert status == 200, answer
    return answer


def cached_of(answer: Any) -> int | None:
    details = answer["usage"].get("prompt_tokens_details")
    return None if details is None else details["cached_tokens"]


async def capabilities(session: aiohttp.ClientSession, base: str) -> Any:
    async with session.get(base + "/inference/v1/capabilities") as resp:
        assert resp.status == 200
        return await resp.json()


class Subscriber:
    """A SUB socket on the engine's PUB endpoint, joined by a handshake of real events."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.socket.connect(endpoint)

    async def next(self) -> tuple[int, EventBatch]:
        assert await self.socket.poll(POLL_MS), "no KV event batch arrived"
        topic, seq, payload = await self.socket.recv_multipart()
        assert topic == TOPIC.encode()
        return seq_of(seq), decode_batch(payload)

    async def join(self, session: aiohttp.ClientSession, base: str) -> None:
        """Reset the (empty) cache until an `AllBlocksCleared` arrives: from then on every batch
        does (a PUB drops what it sends before the subscription reaches it). Resets sent before
        it and still in flight are read off too, so the next batch is the test's."""
        sent = 0
        while True:
            async with session.post(base + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            sent += 1
            if await self.socket.poll(100):
                seq, batch = await self.next()
                assert batch.events == [AllBlocksCleared()]
                break
            assert sent < 200, "the subscription never took"
        for _ in range(sent - 1 - seq):  # each reset is one batch, numbered from 0
            await self.next()


# -- cached tokens ---------------------------------------------------------------------


async def test_repeated_prompt_reports_its_full_blocks_and_a_longer_one_reuses_them(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = prose(qwen3_tokenizer, 100)  # 6 full blocks and 4 tokens
    async with cached_engine(qwen3_tokenizer_dir) as (base, _):
        assert cached_of(await generate(session, base, prompt)) == 0
        assert cached_of(await generate(session, base, prompt)) == 96
        longer = prompt + prose(qwen3_tokenizer, 60, "valley")
        assert cached_of(await generate(session, base, longer)) == 96
        assert cached_of(await generate(session, base, longer)) == 160 - BLOCK  # its last token is computed, as vLLM
        other = prose(qwen3_tokenizer, 100, "valley")
        assert cached_of(await generate(session, base, other)) == 0


async def test_cache_salt_separates_prompts(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = prose(qwen3_tokenizer, 64)
    async with cached_engine(qwen3_tokenizer_dir) as (base, _):
        await generate(session, base, prompt, cache_salt="alice")
        assert cached_of(await generate(session, base, prompt, cache_salt="bob")) == 0
        assert cached_of(await generate(session, base, prompt)) == 0
        assert cached_of(await generate(session, base, prompt, cache_salt="alice")) == 48


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("mode", ["tokens", "text", "chat", "completion"])
async def test_every_output_mode_reports_cached_tokens(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession, mode: str, stream: bool
) -> None:
    prompt = prose(qwen3_tokenizer, 40)  # 2 full blocks
    body: dict[str, Any] = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 4, "seed": 1},
        "output_mode": "derender" if mode in ("chat", "completion") else mode,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    if mode == "chat":
        body["chat_request"] = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        if stream:
            body["chat_request"]["stream_options"] = {"include_usage": True}
    if mode == "completion":
        body["completion_request"] = {"model": "sim", "prompt": "The river", "max_tokens": 4, "stream": stream}
        if stream:
            body["completion_request"]["stream_options"] = {"include_usage": True}
    async with cached_engine(qwen3_tokenizer_dir) as (base, _):
        await generate(session, base, prompt)
        if stream:
            events, _ = await stream_events(session, base + GENERATE, body)
            usage = events[-1]["usage"]
        else:
            status, answer, headers = await post_json(session, base + GENERATE, body)
            assert status == 200, answer
            usage = answer["usage"]
            assert msgspec.json.decode(headers["onehop-engine-summary"])["cached_tokens"] == 32
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32


async def test_without_prefix_caching_usage_has_no_cached_tokens(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = prose(qwen3_tokenizer, 40)
    async with engine_server(qwen3_tokenizer_dir) as (base, _):
        await generate(session, base, prompt)
        assert cached_of(await generate(session, base, prompt)) is None
        assert (await capabilities(session, base)).get("kv_events") is None
        async with session.get(base + "/metrics") as resp:
            assert "vllm:prefix_cache" not in await resp.text()


async def test_prefill_time_grows_with_uncached_tokens(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = prose(qwen3_tokenizer, 2000)
    # 2,000 cold tokens at 150 µs: 0.3 s of prefill; the warm repeat computes 16 tokens (2.4 ms).
    async with cached_engine(qwen3_tokenizer_dir, prefill_us_per_token=150) as (base, _):
        began = time.monotonic()
        await generate(session, base, prompt)
        cold = time.monotonic() - began
        began = time.monotonic()
        assert cached_of(await generate(session, base, prompt)) == 1984
        warm = time.monotonic() - began
    assert cold >= 0.3  # a floor: the sim waits at least its planned prefill, however idle the machine
    # The one comparison of wall times here: the warm repeat skips ~0.3 s of planned prefill,
    # so only a machine stalled for that long could make it the slower.
    assert warm < cold, (cold, warm)


# -- the prefill lane ------------------------------------------------------------------


def waiting_now(state: EngineState) -> int:
    """The backend's count of prompts queued in the lane (what `/metrics` exports)."""
    assert isinstance(state.backend, PrefixCaching)
    stats = state.backend.prefix_cache_stats()
    assert stats is not None
    return stats.waiting


async def waiting_metric(session: aiohttp.ClientSession, base: str) -> float:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    [value] = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:num_requests_waiting"
    ]
    return value


async def abort(session: aiohttp.ClientSession, base: str, request_id: str) -> None:
    async with session.post(base + ABORT, json={"request_ids": [request_id]}) as resp:
        assert resp.status == 200


async def test_concurrent_cold_prompts_prefill_one_after_another(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    first, second = prose(qwen3_tokenizer, 2000, "river"), prose(qwen3_tokenizer, 2000, "hill")
    # 2,000 cold tokens at 150 µs: 0.3 s of prefill each, one after the other on one engine.
    async with cached_engine(qwen3_tokenizer_dir, prefill_us_per_token=150) as (base, _):
        began = time.monotonic()

        async def finished_after(ids: list[int]) -> float:
            assert cached_of(await generate(session, base, ids)) == 0
            return time.monotonic() - began

        done = sorted(await asyncio.gather(finished_after(first), finished_after(second)))
    # Floors the lane guarantees however the machine runs; prefilling side by side, both
    # would end at about 0.3 s and the later one fail the second.
    assert done[0] >= 0.3 - TIMER_SLACK_S
    assert done[1] >= 0.6 - TIMER_SLACK_S, done


async def test_queued_prompts_are_waiting_and_aborted_ones_leave_the_lane(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    long_a, long_b = prose(qwen3_tokenizer, 2000, "river"), prose(qwen3_tokenizer, 2000, "hill")
    short = prose(qwen3_tokenizer, 10, "sea")
    # At 50 ms a token the long prompts take 100 s each, the short one 0.5 s: the short one
    # ends within the test's timeout only if neither aborted prompt is charged to it.
    async with cached_engine(qwen3_tokenizer_dir, prefill_us_per_token=50_000) as (base, state):
        a = asyncio.create_task(generate(session, base, long_a, request_id="lane-a"))
        await wait_until(lambda: state.backend.running() == {"lane-a"}, what="a prefilling")
        assert waiting_now(state) == 0 and await waiting_metric(session, base) == 0
        b = asyncio.create_task(generate(session, base, long_b, request_id="lane-b"))
        await wait_until(lambda: waiting_now(state) == 1, what="b queued")
        assert await waiting_metric(session, base) == 1
        c = asyncio.create_task(generate(session, base, short, request_id="lane-c"))
        await wait_until(lambda: waiting_now(state) == 2, what="c queued")
        assert await waiting_metric(session, base) == 2

        await abort(session, base, "lane-b")  # queued: it leaves before starting
        assert await waiting_metric(session, base) == 1
        assert (await b)["choices"][0]["finish_reason"] == "abort"
        a.cancel()  # the client leaves mid-prefill: the lane is free from then on
        await wait_until(lambda: "lane-a" not in state.backend.running(), what="a gone")
        assert waiting_now(state) == 0 and await waiting_metric(session, base) == 0
        answer = await asyncio.wait_for(c, timeout=30)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert cached_of(answer) == 0


async def test_a_prompt_queued_behind_its_prefix_finds_the_blocks_stored_before_it(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = prose(qwen3_tokenizer, 2000)  # 125 full blocks
    longer = prompt + prose(qwen3_tokenizer, 40, "hill")
    # 2 s of prefill for the first: the second arrives while it runs and waits behind it.
    async with cached_engine(qwen3_tokenizer_dir, prefill_us_per_token=1000) as (base, state):
        first = asyncio.create_task(generate(session, base, prompt, request_id="prefix-1"))
        await wait_until(lambda: state.backend.running() == {"prefix-1"}, what="the first prefilling")
        second = asyncio.create_task(generate(session, base, longer, request_id="prefix-2"))
        await wait_until(lambda: waiting_now(state) == 1, what="the second queued")
        assert await waiting_metric(session, base) == 1
        answers = await asyncio.gather(first, second)
    # Looked up as its prefill starts, after the first's blocks were stored, as vLLM schedules it.
    assert [cached_of(answer) for answer in answers] == [0, 2000]


# -- KV cache events -------------------------------------------------------------------


async def test_stored_blocks_are_published_chained(
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    session: aiohttp.ClientSession,
    subscribe: Callable[[str], Subscriber],
) -> None:
    prompt = prose(qwen3_tokenizer, 50)  # 3 full blocks
    async with cached_engine(qwen3_tokenizer_dir) as (base, _):
        subscriber = subscribe((await capabilities(session, base))["kv_events"]["endpoint"])
        await subscriber.join(session, base)
        await generate(session, base, prompt, cache_salt="s1")
        async with session.post(
            base + GENERATE,
            data=msgspec.json.encode({"token_ids": prompt + prose(qwen3_tokenizer, 20, "hill"), "sampling_params": {"max_tokens": 2}}),
            headers={"X-Session-ID": "conv-7", "Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 200
        _, first = await subscriber.next()
        _, second = await subscriber.next()
    assert first.data_parallel_rank == 0
    [stored] = first.events
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == prompt[:48] and stored.block_size == BLOCK and stored.medium == "GPU"
    assert stored.parent_block_hash is None and len(stored.block_hashes) == 3
    assert stored.block_hashes == prompt_hashes(prompt, BLOCK, "s1")
    assert stored.extra_keys == [["s1"], None, None]
    # Unsalted, the same first blocks are other blocks: all four stored, chained from the start.
    [unsalted] = second.events
    assert isinstance(unsalted, BlockStored)
    assert unsalted.block_hashes == prompt_hashes(prompt + prose(qwen3_tokenizer, 20, "hill"), BLOCK)
    assert unsalted.extra_keys is None and unsalted.session_id == "conv-7"


async def test_a_longer_prompt_publishes_only_its_new_blocks(
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    session: aiohttp.ClientSession,
    subscribe: Callable[[str], Subscriber],
) -> None:
    prompt = prose(qwen3_tokenizer, 40)
    longer = prompt + prose(qwen3_tokenizer, 30, "hill")  # blocks 0-1 shared, 2-3 new
    async with cached_engine(qwen3_tokenizer_dir) as (base, _):
        subscriber = subscribe((await capabilities(session, base))["kv_events"]["endpoint"])
        await subscriber.join(session, base)
        await generate(session, base, prompt)
        await generate(session, base, prompt)  # all held: nothing changes, nothing is published
        await generate(session, base, longer)
        _, first = await subscriber.next()
        _, second = await subscriber.next()
    hashes = prompt_hashes(longer, BLOCK)
    assert first.events == [BlockStored(block_hashes=list[BlockHash](hashes[:2]), token_ids=prompt[:32], block_size=BLOCK, medium="GPU")]
    [stored] = second.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == hashes[1] and stored.block_hashes == hashes[2:]
    assert stored.token_ids == longer[32:64]


async def test_a_small_cache_evicts_least_recently_used_first(
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    session: aiohttp.ClientSession,
    subscribe: Callable[[str], Subscriber],
) -> None:
    a, b, c = (prose(qwen3_tokenizer, 33, theme) for theme in ("river", "hill", "sea"))  # 2 blocks each
    async with cached_engine(qwen3_tokenizer_dir, cache_blocks=4) as (base, _):
        subscriber = subscribe((await capabilities(session, base))["kv_events"]["endpoint"])
        await subscriber.join(session, base)
        await generate(session, base, a)
        await generate(session, base, b)
        assert cached_of(await generate(session, base, a)) == 32  # a is now the more recent
        await generate(session, base, c)  # evicts b, tail first
        batches = [(await subscriber.next())[1] for _ in range(3)]
        assert cached_of(await generate(session, base, a)) == 32
        assert cached_of(await generate(session, base, b)) == 0
    stored_c, removed = batches[2].events
    assert isinstance(stored_c, BlockStored) and stored_c.token_ids == c[:32]
    hashes_b = prompt_hashes(b, BLOCK)
    assert removed == BlockRemoved(block_hashes=[hashes_b[1], hashes_b[0]], medium="GPU")


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    session: aiohttp.ClientSession,
    subscribe: Callable[[str], Subscriber],
) -> None:
    prompt = prose(qwen3_tokenizer, 40)
    async with cached_engine(qwen3_tokenizer_dir) as (base, _):
        subscriber = subscribe((await capabilities(session, base))["kv_events"]["endpoint"])
        await subscriber.join(session, base)
        await generate(session, base, prompt)
        async with session.post(base + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        _, stored = await subscriber.next()
        _, cleared = await subscriber.next()
        assert cached_of(await generate(session, base, prompt)) == 0
    assert isinstance(stored.events[0], BlockStored)
    assert cleared.events == [AllBlocksCleared()]


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_replay_answers_the_buffered_batches_then_end_seq(
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    session: aiohttp.ClientSession,
    context: Any,
    encoding: Literal["map", "array"],
) -> None:
    async with cached_engine(qwen3_tokenizer_dir, buffer_steps=3, kv_events_encoding=encoding) as (base, _):
        for theme in ("river", "hill", "sea", "plain"):  # four batches, 0-3; the buffer keeps 1-3
            await generate(session, base, prose(qwen3_tokenizer, 20, theme))
        dealer = context.socket(zmq.DEALER)
        dealer.connect((await capabilities(session, base))["kv_events"]["replay_endpoint"])
        try:
            await dealer.send_multipart([b"", seq_bytes(2)])
            replies = []
            while True:
                assert await dealer.poll(POLL_MS), "the replay socket did not answer"
                frames = await dealer.recv_multipart()
                replies.append(frames)
                if frames[2] == END_SEQ:
                    break
            await dealer.send_multipart([b"", seq_bytes(0)])  # older than the buffer: what it holds
            held = []
            while True:
                assert await dealer.poll(POLL_MS)
                frames = await dealer.recv_multipart()
                if frames[2] == END_SEQ:
                    break
                held.append(seq_of(frames[2]))
        finally:
            dealer.close(linger=0)
    assert [len(frames) for frames in replies] == [4, 4, 4]
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    assert [(frames[1], seq_of(frames[2])) for frames in replies[:-1]] == [(TOPIC.encode(), 2), (TOPIC.encode(), 3)]
    batches = [decode_batch(frames[3]) for frames in replies[:-1]]
    themes = [prose(qwen3_tokenizer, 20, theme)[:BLOCK] for theme in ("sea", "plain")]
    assert [batch.events[0].token_ids for batch in batches if isinstance(batch.events[0], BlockStored)] == themes
    assert held == [1, 2, 3]
    if encoding == "array":  # the older positional form: each event is an array, tagged first
        assert msgspec.msgpack.decode(replies[0][3])[1][0][0] == "BlockStored"


# -- metrics and capabilities ----------------------------------------------------------


async def test_metrics_use_vllms_names(
    qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    prompt = prose(qwen3_tokenizer, 40)

    async def scraped(base: str) -> dict[str, Any]:
        async with session.get(base + "/metrics") as resp:
            text = await resp.text()
        return {
            sample.name: sample
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith("vllm:")
        }

    async with cached_engine(qwen3_tokenizer_dir, cache_blocks=8, itl_ms=50, output_tokens=200) as (base, _):
        await generate(session, base, prompt, sampling_params={"max_tokens": 1})
        await generate(session, base, prompt, sampling_params={"max_tokens": 1})
        samples = await scraped(base)
        assert samples["vllm:kv_cache_usage_perc"].value == 0  # cached blocks no request holds are free
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 200}, "stream": True}
        async with session.post(base + "/inference/v1/generate", json=body) as running:
            await running.content.readline()  # it runs: its prompt's 3 blocks (40 tokens) are held
            during = await scraped(base)
    assert samples["vllm:prefix_cache_queries_total"].value == 80
    assert samples["vllm:prefix_cache_hits_total"].value == 32
    assert during["vllm:kv_cache_usage_perc"].value == pytest.approx(3 / 8)
    assert samples["vllm:num_requests_waiting"].value == 0
    assert samples["vllm:prefix_cache_hits_total"].labels == {"model_name": "sim", "engine": "0"}
    info = samples["vllm:cache_config_info"]  # the cache's size, as vLLM's info gauge says it
    assert (info.value, info.labels["num_gpu_blocks"], info.labels["block_size"]) == (1, "8", "16")


async def test_capabilities_name_connectable_endpoints(
    qwen3_tokenizer_dir: Path, session: aiohttp.ClientSession
) -> None:
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="t")
    async with engine_server(
        qwen3_tokenizer_dir, enable_prefix_caching=True, block_size=32, kv_events_config=events
    ) as (base, state):
        shown = (await capabilities(session, base))["kv_events"]
        assert isinstance(state.backend, PrefixCaching)
        bound = state.backend.kv_events_address()
    assert bound is not None and bound.replay_endpoint is not None
    assert bound.endpoint.startswith("tcp://0.0.0.0:")
    assert shown["endpoint"] == "tcp://127.0.0.1:" + bound.endpoint.rsplit(":", 1)[1]
    assert shown["replay_endpoint"] == "tcp://127.0.0.1:" + bound.replay_endpoint.rsplit(":", 1)[1]
    assert shown["topic"] == "t" and shown["block_size"] == 32
