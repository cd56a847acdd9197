"""`SimBackend`: the simulator's lifecycle, request checks, disaggregated handshake and pace.

Each request is checked, read (`prompt`), planned per choice (`plans`), prefilled (in the
engine's `prefill` lane when prompt tokens cost time) and then stepped through its choices'
token streams (`stream`) on a fixed schedule of loop timers: ``ttft_ms`` after the prefill
to the first step, then one step every ``itl_ms``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import uuid
import zlib
from array import array
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

from engine.backends.base import (
    BackendError,
    BackendInfo,
    BackendOutput,
    BackendRequest,
    BackendRequestError,
    KVEventsAddress,
    PrefixCacheStats,
)
from engine.backends.checks import ALL_LOGPROBS, check_prompt
from engine.backends.sim.config import SimBackendConfig
from engine.backends.sim.kv_publisher import KVEventPublisher
from engine.backends.sim.plans import Planner
from engine.backends.sim.prefill import Prefill, PrefillLane
from engine.backends.sim.prefix_cache import Lookup, PrefixCache
from engine.backends.sim.prompt import Prompt
from engine.backends.sim.schema import SIM_CONSTRAINTS
from engine.backends.sim.stream import Choice, Logprobs, rules_for
from engine.backends.sim.tokenizer import eos_ids, load_tokenizer, vocab_size
from wire.kv_events import AllBlocksCleared

log = logging.getLogger(__name__)
MAX_LOGPROBS = ALL_LOGPROBS
"""vLLM's default `max_logprobs`; also what `logprobs=-1` means here."""
KV_BLOCK_TOKENS = 16


class Live:
    """A running request: the abort flag, the timer future it may be waiting on, and its place
    in the prefill lane while it has one."""

    __slots__ = ("aborted", "blocks", "prefill", "request_id", "waiter")

    def __init__(self, request_id: str, blocks: int = 0) -> None:
        self.request_id = request_id
        self.blocks = blocks
        """KV blocks its prompt takes while it runs (vLLM's `kv_cache_usage_perc` counts these)."""
        self.aborted = False
        self.waiter: asyncio.Future[None] | None = None
        self.prefill: Prefill | None = None

    def abort(self) -> None:
        self.aborted = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SimBackend:
    """The `Backend` protocol, simulated; see the package docstring for the output."""

    def __init__(self, config: SimBackendConfig) -> None:
        folder = Path(config.tokenizer)
        tokenizer = load_tokenizer(folder)
        self._config = config
        self._planner = Planner(config, tokenizer)
        self._eos = eos_ids(folder, tokenizer)
        self._info = BackendInfo(
            name="sim",
            model=config.served_model_name,
            max_model_len=config.max_model_len,
            vocab_size=vocab_size(tokenizer),
            eos_token_ids=frozenset(self._eos),
            constraints=SIM_CONSTRAINTS,
        )
        self._live: dict[str, Live] = {}
        self._closed = False
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.prefills = 0
        """Prefill requests served (`do_remote_decode`): one token, then the KV handed over."""
        self.remote_decodes = 0
        """Decode requests that started from another engine's prefill (`do_remote_prefill`)."""
        self._cache = PrefixCache(config.block_size, config.cache_blocks) if config.prefix_caching else None
        self._publisher: KVEventPublisher | None = None
        events = config.kv_events
        if events is not None and events.publishes:
            if self._cache is None:
                log.warning("KV cache events are on but prefix caching is off: nothing will be published")
            else:
                self._publisher = KVEventPublisher(events, config.kv_events_encoding)
        self._lane: PrefillLane | None = None
        if config.prefill_us_per_token > 0:
            self._lane = PrefillLane(self._prefill_starts, self._prefill_ends)

    @property
    def info(self) -> BackendInfo:
        return self._info

    async def start(self) -> None:
        """Nothing to load beyond the tokenizer, which the constructor read; the KV event
        sockets open here, on the serving loop."""
        self._closed = False
        if self._publisher is not None:
            await self._publisher.start()

    async def close(self) -> None:
        self._closed = True
        if self._lane is not None:
            self._lane.clear()  # before the aborts, so none of them starts the next prefill
        for live in self._live.values():
            self._stop(live)
        self._live.clear()
        if self._publisher is not None:
            await self._publisher.close()

    # -- prefix cache (`PrefixCaching`) ---------------------------------------

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        cache = self._cache
        if cache is None:
            return None
        # Only prefill waits (no batch limit): the prompts queued in the lane, not yet started.
        waiting = self._lane.waiting if self._lane is not None else 0
        # As vLLM's: the share of blocks that running requests use (cached blocks no request
        # holds are free to evict, so not in use); a request queued for prefill holds none yet.
        running = sum(live.blocks for live in self._live.values() if live.prefill is None or live.prefill.ends_at)
        usage = min(running / cache.capacity, 1.0)
        return PrefixCacheStats(
            queries=cache.queries, hits=cache.hits, usage=usage, waiting=waiting,
            blocks=cache.capacity, block_size=self._config.block_size,
        )

    def kv_events_address(self) -> KVEventsAddress | None:
        publisher = self._publisher
        if publisher is None or publisher.endpoint is None:
            return None
        return KVEventsAddress(
            endpoint=publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
            topic=publisher.topic,
            block_size=self._config.block_size,
        )

    def reset_prefix_cache(self) -> bool:
        if self._cache is None:
            return False
        self._cache.clear()
        if self._publisher is not None:
            self._publisher.publish([AllBlocksCleared()])
        return True

    async def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._stop(live)

    def running(self) -> frozenset[str]:
        return frozenset(self._live)

    async def prepare(self, request: BackendRequest) -> BackendRequest:
        return request  # a constraint is read when its answer is written: nothing compiles

    async def generate(self, request: BackendRequest) -> AsyncGenerator[list[BackendOutput], None]:
        if self._closed:
            raise BackendError("the sim backend is closed")
        prompt = self._check(request)
        role = self._kv_role(request)
        choices = self._choices(request, prompt)
        live = self._register(request.request_id, -(-len(request.prompt_token_ids) // self._config.block_size))
        loop = asyncio.get_running_loop()
        handover = self._handover(request) if role == "prefill" else None
        try:
            # A decode whose prefill ran elsewhere starts with the KV cache in place: no lane.
            laned = self._lane is not None and role != "decode"
            if laned:
                prefill = await self._prefill(request, live, loop)
                lookup, queued_s = prefill.lookup, prefill.queued_s
                ended = loop.time() if prefill.ends_at is None else prefill.ends_at  # None: aborted unstarted
                deadline = ended + self._config.ttft_ms / 1000
            else:
                lookup, queued_s = self._lookup(request), None
                # No lane: prompt tokens cost nothing (`prefill_us_per_token` 0), so `ttft_ms` alone.
                deadline = loop.time() + (0 if role == "decode" else self._config.ttft_ms / 1000)
            first = True
            while True:
                await self._wait(live, loop, deadline)
                if live.aborted:
                    yield [choice.aborted() for choice in choices if not choice.finished]
                    return
                width = self._config.tokens_per_step
                step = [choice.take(width) for choice in choices if not choice.finished]
                if first:
                    if lookup is not None and not laned:
                        self._store(lookup)  # the lane stores as the prefill ends; here, with the first step
                    self._first_step(step, lookup, queued_s)
                    first = False
                if handover is not None:
                    for output in step:
                        if output.finish_reason is not None:
                            output.kv_transfer_params = handover
                yield step
                if all(choice.finished for choice in choices):
                    return
                deadline += self._config.itl_ms / 1000
        finally:
            # Cancellation and aclose() land here too; CancelledError propagates after.
            if live.prefill is not None and self._lane is not None:
                self._lane.leave(live.prefill)
            if self._live.get(live.request_id) is live:
                del self._live[live.request_id]

    # -- per request --------------------------------------------------------

    def _lookup(self, request: BackendRequest) -> Lookup | None:
        if self._cache is None:
            return None
        return self._cache.lookup(request.prompt_token_ids, request.cache_salt, request.session_id)

    async def _prefill(self, request: BackendRequest, live: Live, loop: asyncio.AbstractEventLoop) -> Prefill:
        """Queue the request's prefill in the lane and wait for it to end; an abort wakes it
        early (the abort has taken it out of the lane)."""
        assert self._lane is not None
        prefill = Prefill(request, loop.create_future())
        live.prefill = prefill
        self._lane.join(prefill)
        live.waiter = prefill.done
        try:
            await prefill.done
        finally:
            live.waiter = None
        return prefill

    def _prefill_starts(self, prefill: Prefill) -> float:
        """The lane starts this prefill: look the prompt up now, as vLLM's scheduler does; its
        length is the prompt tokens not cached, at `prefill_us_per_token` each."""
        prefill.lookup = lookup = self._lookup(prefill.request)
        cached = lookup.cached_tokens if lookup is not None else 0
        uncached = len(prefill.request.prompt_token_ids) - cached
        return uncached * self._config.prefill_us_per_token / 1e6

    def _prefill_ends(self, prefill: Prefill) -> None:
        """The lane ends this prefill: its blocks are computed, so keep them before the next
        prefill is looked up."""
        if prefill.lookup is not None:
            self._store(prefill.lookup)

    def _store(self, lookup: Lookup) -> None:
        """The prompt's KV is computed: keep its blocks and publish what changed."""
        assert self._cache is not None
        events = self._cache.store(lookup)
        if self._publisher is not None:
            self._publisher.publish(events)

    @staticmethod
    def _first_step(step: list[BackendOutput], lookup: Lookup | None, queued_s: float | None) -> None:
        """Report the cache hit, and the lane's wait, on each choice's first output."""
        for output in step:
            if lookup is not None:
                output.num_cached_tokens = lookup.cached_tokens
            if queued_s is not None:
                output.queued_s = queued_s

    def _stop(self, live: Live) -> None:
        """Abort a request: wake it, and take it out of the lane at once (its unstarted or
        unfinished prefill is charged to nobody behind it)."""
        live.abort()
        if live.prefill is not None and self._lane is not None:
            self._lane.leave(live.prefill)

    def _check(self, request: BackendRequest) -> Prompt:
        check_prompt(request, self._info, self._live)
        k = request.sampling.logprobs
        if k is not None and k > MAX_LOGPROBS:
            raise BackendRequestError(f"logprobs={k} is more than the maximum of {MAX_LOGPROBS}")
        return self._planner.reader.read(list(request.prompt_token_ids))

    def _kv_role(self, request: BackendRequest) -> str | None:
        """Check a disaggregated-serving handshake the way a KV connector would see it.

        Prefill (`do_remote_decode`): exactly one output token, one choice.
        Decode (`do_remote_prefill`): the params must be a prefill engine's
        answer for this very prompt (its block ids are derived from the tokens).
        """
        params = request.kv_transfer_params
        if not params:
            return None
        if params.get("do_remote_decode"):
            if request.sampling.max_tokens != 1 or request.sampling.n != 1:
                raise BackendRequestError("a prefill request (do_remote_decode) must ask for max_tokens=1 and n=1")
            self.prefills += 1
            return "prefill"
        if params.get("do_remote_prefill"):
            engine = params.get("remote_engine_id")
            if not isinstance(engine, str) or not engine.startswith("sim-"):
                raise BackendRequestError(f"kv_transfer_params name no prefill engine (remote_engine_id={engine!r})")
            if params.get("remote_block_ids") != _kv_blocks(request.prompt_token_ids):
                raise BackendRequestError("kv_transfer_params describe another prompt's KV blocks (remote_block_ids)")
            self.remote_decodes += 1
            return "decode"
        return None

    def _handover(self, request: BackendRequest) -> dict[str, object]:
        """What a prefill engine's connector returns for the decode engine to pull the KV cache."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": _kv_blocks(request.prompt_token_ids),
            "remote_host": "127.0.0.1",
            "remote_port": 0,
            "tp_size": 1,
        }

    def _register(self, request_id: str, blocks: int) -> Live:
        live = Live(request_id, blocks)
        self._live[request_id] = live
        return live

    def _choices(self, request: BackendRequest, prompt: Prompt) -> list[Choice]:
        rules = rules_for(request, self._info, self._eos)
        logprobs = Logprobs(rules.logprobs or 0, self._info.vocab_size)
        digest = hashlib.blake2b(array("I", prompt.ids).tobytes(), digest_size=16).digest()
        shared = self._planner.shared(prompt)
        constraint = request.sampling.structured_outputs
        choices: list[Choice] = []
        for index in range(request.sampling.n):
            rng = random.Random(self._seed(request.sampling.seed, digest, index))
            plan = shared if shared is not None else self._planner.drawn(prompt, rng, constraint)
            choices.append(Choice(index, plan, self._planner.words.padding(rng), rules, logprobs))
        return choices

    def _seed(self, request_seed: int | None, digest: bytes, index: int) -> int:
        key = f"{self._config.seed}:{request_seed}:{index}:".encode() + digest
        return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "big")

    async def _wait(self, live: Live, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Sleep until `deadline` on a loop timer; an abort wakes it early."""
        if live.aborted:
            return  # aborted while the consumer held the stream between steps
        if deadline <= loop.time():
            await asyncio.sleep(0)  # still yield, so aborts and other requests run between steps
            return
        waiter: asyncio.Future[None] = loop.create_future()
        handle = loop.call_at(deadline, _wake, waiter)
        live.waiter = waiter
        try:
            await waiter
        finally:
            handle.cancel()
            live.waiter = None


def _kv_blocks(ids: Sequence[int]) -> list[int]:
    """Stand-in KV block ids: one per 16 prompt tokens, derived from the tokens they hold."""
    data = array("I", ids).tobytes()
    step = KV_BLOCK_TOKENS * 4
    return [zlib.crc32(data[i : i + step]) for i in range(0, len(data), step)]
