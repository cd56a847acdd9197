"""The contract between the engine server and a generation backend.

A backend turns prompt token ids into generated token ids. It owns sampling
and the token-level stop conditions (EOS, `stop_token_ids`, `max_tokens`,
`min_tokens`, `ignore_eos`); it knows nothing about text. Stop *strings*,
detokenization and parsing happen in the engine server, which aborts the
backend request when a stop string matches.

Cancellation: `generate()` is an async generator. When its consumer stops
iterating (the client went away, the engine saw a stop string, an abort
arrived), the generator is closed; the backend must then stop the request
within a bounded time, free its resources, and not generate any more tokens
for it. `abort()` does the same by id from outside the generator.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from wire.protocol import GenerateLogProbsContent, SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class BackendError(Exception):
    """A backend failed to generate (not the client's fault): mapped to a 5xx."""


class BackendRequestError(ValueError):
    """A request the backend cannot take (prompt too long, bad parameter): mapped to a 400."""


@dataclass(frozen=True, slots=True)
class BackendRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    """The wire sampling params; backends ignore `stop`/`detokenize` (the engine handles text)."""
    eos_token_ids: frozenset[int] = frozenset()
    """Ids that end generation unless `ignore_eos` (from the model's generation config)."""
    kv_transfer_params: dict[str, object] | None = None
    reasoning_end_ids: frozenset[int] | None = None
    """With `sampling.structured_outputs`: the constraint holds once the output has one of these
    ids (the model is reasoning when it starts); None: from the first token."""
    prepared: object | None = None
    """What the backend's `prepare` made for this request (the hf backend: its grammar matchers)."""
    cache_salt: str | None = None
    """Mixed into the prefix cache's first block: requests with other salts share no blocks."""
    session_id: str | None = None
    """The client's conversation (vLLM's `X-Session-ID`), named in the KV cache events."""
    priority: int = 0
    """vLLM's request priority (lower sooner): its scheduler's order with `--scheduling-policy
    priority`, ignored under first come, first served (vLLM 0.32 and 0.33 alike)."""


@dataclass(slots=True)
class BackendOutput:
    """New output of one choice since the previous step."""

    index: int
    """Choice index, 0..n-1."""
    token_ids: list[int]
    logprobs: list[GenerateLogProbsContent] | None = None
    """One entry per token when `sampling.logprobs` is set: sampled first, then top-k by rank."""
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    """The stop token id that ended the choice; None for EOS, length and abort."""
    num_cached_tokens: int | None = None
    """On a request's first output: prompt tokens its prefix cache held; None where the backend
    does not know (no prefix cache), and on later outputs."""
    queued_s: float | None = None
    """Seconds the request waited before the backend started it; None where the backend cannot tell."""
    kv_transfer_params: dict[str, object] | None = None
    """Disaggregated serving: what a prefill engine hands the decode engine (on the finishing output)."""


@dataclass(frozen=True, slots=True)
class BackendInfo:
    name: str
    """"hf", "sim" or "vllm"."""
    model: str
    """Served model name."""
    max_model_len: int
    vocab_size: int
    """Ids at or above this are rejected with a 400 before generation."""
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    constraints: frozenset[str] = frozenset()
    """The structured-output kinds (`wire.protocol.CONSTRAINT_KINDS`) it can enforce."""


@dataclass(frozen=True, slots=True)
class KVEventsAddress:
    """Where a backend publishes its KV cache events (`wire.kv_events`), as bound."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """A prefix cache's counters, read at each metrics scrape (vLLM's metric meanings)."""

    queries: int
    """Prompt tokens looked up."""
    hits: int
    """Prompt tokens found cached."""
    usage: float
    """The share of the KV cache in use, 0 to 1."""
    waiting: int
    """Requests waiting for room to start."""
    blocks: int = 0
    """The cache's size in blocks (vLLM's `num_gpu_blocks`); 0: not known."""
    block_size: int = 0


@runtime_checkable
class PrefixCaching(Protocol):
    """A backend with a prefix cache the engine can report on and reset (the sim's)."""

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """None while prefix caching is off."""

    def kv_events_address(self) -> KVEventsAddress | None:
        """None unless KV cache events are published (and the sockets are open)."""

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (published as `AllBlocksCleared`); whether a cache was there."""


@runtime_checkable
class Backend(Protocol):
    @property
    def info(self) -> BackendInfo: ...

    async def start(self) -> None:
        """Load the model, start background loops."""

    async def close(self) -> None:
        """Stop every request and release resources."""

    async def prepare(self, request: BackendRequest) -> BackendRequest:
        """The awaited checks and work before `generate` (the hf backend compiles a grammar,
        off the event loop); a BackendRequestError here is a 400 before any byte is sent."""

    def generate(self, request: BackendRequest) -> AsyncGenerator[list[BackendOutput], None]:
        """Yield batches of per-choice outputs until every choice has a finish_reason."""

    async def abort(self, request_id: str) -> None:
        """Stop a running request by id; a no-op for an unknown id."""

    def running(self) -> frozenset[str]:
        """Ids of requests still generating (tests assert on this after disconnects)."""
