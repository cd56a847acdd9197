"""`onehop serve`: the gateway and an engine in one process — the main job.

The engine listens on a private loopback port chosen by the OS; the gateway
is configured to use it, exactly as it would use a remote engine pool. The
gateway's /metrics serves the engine's metrics after its own, so one scrape
target has both.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiohttp import web

from engine.app import create_app as create_engine_app
from engine.state import ENGINE
from plumbing.http_server import Runner, new_event_loop
from engine.config import EngineConfig
from gateway.edge.access_log import AccessLogger
from gateway.serving.app import create_app as create_gateway_app
from gateway.serving.memory import freeze_start_heap
from gateway.config import EngineEndpoint, GatewayConfig, ModelConfig, Route

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Embedded:
    url: str
    """The gateway's base URL (the OpenAI `base_url` is this plus `/v1`)."""
    gateway: web.Application
    engine: web.Application


def served_name(engine: EngineConfig) -> str:
    return engine.served_model_name or Path(engine.model).name


@asynccontextmanager
async def embedded(
    engine: EngineConfig, *, host: str, port: int, route: Route, aliases: Sequence[str] = ()
) -> AsyncIterator[Embedded]:
    """Start engine then gateway; yield both apps and the gateway's base URL."""
    # The engine is told the gateway's model name: left to itself the simulator answers as
    # `sim` and vLLM as the hub name, and the gateway refuses an engine serving another model.
    engine = msgspec.structs.replace(engine, served_model_name=served_name(engine))
    engine_app = create_engine_app(engine)
    engine_runner = Runner(engine_app, handler_cancellation=True, access_log=None)
    await engine_runner.setup()
    engine_site = web.TCPSite(engine_runner, "127.0.0.1", 0)
    await engine_site.start()
    engine_port = engine_runner.addresses[0][1]
    config = GatewayConfig(
        models=[
            ModelConfig(
                name=served_name(engine),
                aliases=list(aliases),
                tokenizer=engine.model,
                engines=[EngineEndpoint(url=f"http://127.0.0.1:{engine_port}")],
            )
        ],
        host=host,
        port=port,
        route=route,
        route_header=True,  # a local tool: the override and its explanation are for its user
        policy_header=True,
        reasoning_parser=engine.reasoning_parser,
        tool_parser=engine.tool_parser,
        reasoning_field=engine.reasoning_field,
        tracing=engine.tracing,  # one setting for both; each exports as its own service
    )
    # The engine's port is private: its metrics are served on the gateway's /metrics.
    gateway_app = create_gateway_app(config, also_metrics=[engine_app[ENGINE].metrics.render])
    gateway_runner = Runner(gateway_app, handler_cancellation=True, access_log_class=AccessLogger)
    try:
        await gateway_runner.setup()
        site = web.TCPSite(gateway_runner, host, port)
        await site.start()
        bound = gateway_runner.addresses[0][1]
        yield Embedded(url=f"http://{host}:{bound}", gateway=gateway_runner.app, engine=engine_runner.app)
    finally:
        await gateway_runner.cleanup()
        await engine_runner.cleanup()


async def _serve_forever(engine: EngineConfig, host: str, port: int, route: Route, aliases: Sequence[str]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with embedded(engine, host=host, port=port, route=route, aliases=aliases) as running:
        freeze_start_heap()
        log.info(
            "onehop serving %s (OpenAI base_url %s/v1, engine backend %s)",
            served_name(engine),
            running.url,
            engine.backend,
        )
        await stop.wait()


def serve(engine: EngineConfig, *, host: str, port: int, route: Route, aliases: Sequence[str] = ()) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve_forever(engine, host, port, route, aliases))
    finally:
        loop.close()
