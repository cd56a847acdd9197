"""A real gateway on a loopback port in front of a given engine, with any config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from gateway.serving.app import create_app
from gateway.config import EngineEndpoint, GatewayConfig
from gateway.serving.state import GATEWAY, GatewayState
from tests.support.engine import AppServer


@asynccontextmanager
async def gateway_server(tokenizer_dir: Path, engine_url: str | list[str], **config: Any) -> AsyncIterator[tuple[str, GatewayState]]:
    """Start the gateway (model `sim`) on a free port, in front of one engine or several;
    yield its `/v1` base URL and state. The route override and policy headers are on
    unless `config` says otherwise."""
    urls = [engine_url] if isinstance(engine_url, str) else engine_url
    config.setdefault("route_header", True)  # tests pick routes and read why one was chosen
    config.setdefault("policy_header", True)
    gateway = GatewayConfig(model="sim", tokenizer=str(tokenizer_dir), engines=[EngineEndpoint(url=u) for u in urls], **config)
    async with configured_gateway(gateway) as running:
        yield running


@asynccontextmanager
async def configured_gateway(config: GatewayConfig) -> AsyncIterator[tuple[str, GatewayState]]:
    """Start the gateway with exactly this config on a free port; yield its `/v1` base URL and state."""
    server = AppServer(create_app(config), handler_cancellation=True)
    await server.start_server()
    try:
        yield str(server.make_url("/v1")), server.app[GATEWAY]
    finally:
        await server.close()
