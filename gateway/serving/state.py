"""What one gateway process holds: config, the served models, engine pools, keys, background tasks."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from plumbing.telemetry import Tracing, TracingConfig
from gateway.edge.admission import Claim, Gate
from gateway.edge.auth import Keys
from gateway.config import GatewayConfig
from gateway.apis.context_edits import IgnoredEdits
from gateway.upstream.engine_client import EngineClient
from gateway.edge.errors import ModelNotFound
from gateway.routing.feedback import EngineFeedback
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.outcome import Outcomes, Tally
from gateway.routing.policy import Policy
from gateway.serving.reload import WatchedFile
from gateway.apis.response_store import InProcess, ResponseStorage, ResponseStore
from gateway.edge.quota import MemoryQuotas, QuotaStore
from gateway.edge.quota_check import QuotaCheck
from gateway.edge.redis_quota import RedisQuotas
from gateway.edge.tenancy import CacheSalts
from gateway.edge.unknown_fields import IgnoredFields
from gateway.serving.runtime import ModelRuntime
from gateway.serving.worker_env import worker_count
from wire.protocol import EngineSummary

_T = TypeVar("_T")


@dataclass
class GatewayState:
    config: GatewayConfig
    gate: Gate
    clients: list[EngineClient]
    """Every pool's client (main, named, prefill) of every model: started, watched and closed together."""
    feedback: EngineFeedback
    """Live load of every decoding engine, for the cost policy."""
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    outcomes: Outcomes = field(default_factory=Outcomes)
    """Subscribers to each API request's outcome (`gateway.observe.outcome`): spans and metrics, at least."""
    tracing: Tracing = field(default_factory=lambda: Tracing(TracingConfig(), "onehop-gateway"))
    policy_file: WatchedFile[Policy] | None = None
    key_file: WatchedFile[Keys] | None = None
    env_keys: Keys = field(default_factory=dict)
    models: dict[str, ModelRuntime] = field(default_factory=dict)
    """Each served model under every exact name it answers to; built once at start."""
    patterns: list[tuple[re.Pattern[str], ModelRuntime]] = field(default_factory=list)
    """Alias patterns (`claude-*`), in config order: tried when no exact name matches."""
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    """Aborts sent after a client left; kept referenced until done."""
    responses: ResponseStorage = field(default_factory=lambda: InProcess(ResponseStore()))
    """Responses API answers kept for `previous_response_id` and `GET /v1/responses/{id}`,
    each caller's own, bounded: this replica's (its workers share them), lost on restart, or
    with `state.backend: redis` the Redis server's, which every replica shares."""
    ignored_fields: IgnoredFields = field(default_factory=IgnoredFields)
    """Unknown request fields ignored so far (`gateway.edge.unknown_fields`): each logged once."""
    ignored_edits: IgnoredEdits = field(default_factory=IgnoredEdits)
    """Context edit types ignored so far, for their bounded metric labels."""
    salts: CacheSalts = field(init=False)
    """The `cache_salt` each tenant's requests get (`gateway.edge.tenancy`)."""
    quotas: QuotaCheck = field(init=False)
    """Each tenant's token and request quotas (`gateway.edge.quota_check`)."""

    def __post_init__(self) -> None:
        self.salts = CacheSalts(self.config)
        self.quotas = quota_check(self.config, self.metrics)

    def policy(self, model: ModelRuntime) -> Policy:
        """The policy file's, as last loaded; without one, the model's fixed route."""
        return self.policy_file.current if self.policy_file is not None else model.fixed_policy

    def model(self, name: str | None) -> ModelRuntime:
        """The model a request names; a request that names none gets the first configured."""
        if name is None:
            return next(iter(self.models.values()))
        found = self.models.get(name)
        if found is None:
            found = next((model for pattern, model in self.patterns if pattern.fullmatch(name)), None)
        if found is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return found

    def served(self) -> list[ModelRuntime]:
        """Each model once, in config order."""
        return list({id(model): model for model in self.models.values()}.values())

    def admitted(
        self, tenant: str | None = None, priority: int | None = None, tally: Tally | None = None
    ) -> AbstractAsyncContextManager[None]:
        """A served-at-once slot, held to the answer's last byte (`gateway.edge.admission`: a
        429 or 503 when none comes); `priority` None: the tenant's. The tally's tokens, read
        when the slot is given back, are what the tenant is charged in the fair queue."""
        settings = self.config.tenant(tenant or "*")
        claim = Claim(
            tenant=tenant,
            priority=settings.priority if priority is None else priority,
            weight=settings.weight,
            max_concurrency=settings.max_concurrency,
            max_queue=settings.max_queue,
        )
        return self.gate.slot(claim, None if tally is None else lambda: _served_tokens(tally))

    def api_keys(self) -> Keys:
        """The keys accepted now: the environment's and the file's, as last loaded."""
        return {**self.env_keys, **(self.key_file.current if self.key_file is not None else {})}

    def abort(self, engines: EngineClient, url: str, request_id: str) -> asyncio.Task[EngineSummary | None]:
        """Tell the engine to stop a request whose client left (in the background); the task
        ends with what the request used, when the engine says."""
        self.metrics.engine_aborts.inc()
        return self.spawn(engines.abort(url, request_id))

    def spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task


def quota_check(config: GatewayConfig, metrics: GatewayMetrics) -> QuotaCheck:
    """Quotas in Redis (every worker and replica together), else in this process, which holds
    its share of each limit: 1/N under `--workers N`."""
    if config.state.backend == "redis":
        return QuotaCheck(config, RedisQuotas(config.state), metrics)
    store: QuotaStore = MemoryQuotas()
    return QuotaCheck(config, store, metrics, share=worker_count())


def _served_tokens(tally: Tally) -> int:
    tokens = tally.tokens
    return 0 if tokens is None else tokens.prompt + tokens.completion


GATEWAY = web.AppKey("gateway", GatewayState)
