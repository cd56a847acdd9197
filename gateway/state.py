"""What one gateway process holds: config, renderer, engine pools, keys, background tasks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from engine.derender.vocab import TokenVocab
from engine.telemetry import Tracing, TracingConfig
from gateway.admission import Gate
from gateway.auth import Keys
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.feedback import EngineFeedback
from gateway.metrics import GatewayMetrics
from gateway.policy import Policy
from gateway.reload import WatchedFile
from gateway.render import LocalRenderer

@dataclass
class GatewayState:
    config: GatewayConfig
    engines: EngineClient
    """The main pool (config `engines`)."""
    renderer: LocalRenderer | None = None
    vocab: TokenVocab | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tracing: Tracing = field(default_factory=lambda: Tracing(TracingConfig(), "onehop-gateway"))
    fixed_policy: Policy = field(default_factory=Policy)
    """The policy when no file is configured (the config's route, with capability fallbacks)."""
    policy_file: WatchedFile[Policy] | None = None
    feedback: EngineFeedback | None = None
    gate: Gate | None = None
    pools: dict[str, EngineClient] = field(default_factory=dict)
    """Named pools (config `pools`), for policy rules that name one."""
    prefill: EngineClient | None = None
    """The prefill pool's client when serving is disaggregated."""
    key_file: WatchedFile[Keys] | None = None
    env_keys: Keys = field(default_factory=dict)
    parses_locally: bool = True
    """onehop implements the configured parsers, so the text and tokens routes can parse chat."""
    background: set[asyncio.Task[None]] = field(default_factory=set)
    """Aborts sent after a client left; kept referenced until done."""

    @property
    def policy(self) -> Policy:
        return self.policy_file.current if self.policy_file is not None else self.fixed_policy

    def clients(self) -> list[EngineClient]:
        """Every pool's client: the main one, the named ones, the prefill one."""
        out = [self.engines, *self.pools.values()]
        return out if self.prefill is None else [*out, self.prefill]

    def api_keys(self) -> Keys:
        """The keys accepted now: the environment's and the file's, as last loaded."""
        return {**self.env_keys, **(self.key_file.current if self.key_file is not None else {})}

    def abort(self, url: str, request_id: str) -> None:
        """Tell the engine to stop a request whose client left (in the background)."""
        self.metrics.engine_aborts.inc()
        self.spawn(self.engines.abort(url, request_id))  # the session reaches any pool's engines

    def spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self.background.add(task)
        task.add_done_callback(self.background.discard)


GATEWAY = web.AppKey("gateway", GatewayState)
