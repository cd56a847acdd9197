"""What one gateway process holds: config, renderer, engine client, background tasks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from engine.derender.vocab import TokenVocab
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.metrics import GatewayMetrics
from gateway.policy import Policy
from gateway.render import LocalRenderer


@dataclass
class GatewayState:
    config: GatewayConfig
    engines: EngineClient
    renderer: LocalRenderer | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    policy: Policy = field(default_factory=Policy)
    vocab: TokenVocab | None = None
    background: set[asyncio.Task[None]] = field(default_factory=set)
    """Aborts sent after a client left; kept referenced until done."""

    def spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self.background.add(task)
        task.add_done_callback(self.background.discard)


GATEWAY = web.AppKey("gateway", GatewayState)
