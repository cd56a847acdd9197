"""Generation backends behind one `Backend` protocol (see `base.py`).

`make_backend` imports the chosen backend only, so a gateway-only install
(no torch) and an engine without vLLM both work.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from engine.backends.base import Backend
from engine.config import EngineConfig, convert_backend_config


def _sim_formats(config: EngineConfig) -> dict[str, str | None]:
    """The simulator writes in the engine's parser families, where it knows how to."""
    from derender.parsers import REASONING_PARSERS, TOOL_PARSERS

    formats: dict[str, str | None] = {}
    reasoning = REASONING_PARSERS.get(config.reasoning_parser or "")
    if reasoning is not None and reasoning.format_reasoning is not None:
        formats["reasoning_format"] = reasoning.name
    tools = TOOL_PARSERS.get(config.tool_parser or "")
    if tools is not None and tools.format_calls is not None:
        formats["tool_format"] = tools.name
        if config.reasoning_parser is None:
            # A tool parser alone (Llama's formats have no reasoning): calls open the output,
            # where those parsers look for them.
            formats["reasoning_format"] = None
    return formats


log = logging.getLogger(__name__)


def _sim_cache(config: EngineConfig) -> dict[str, Any]:
    """vLLM's prefix-cache flags as the simulator's options (`backend_options` still win)."""
    options: dict[str, Any] = {}
    if config.enable_prefix_caching is not None:
        options["prefix_caching"] = config.enable_prefix_caching
    if config.block_size is not None:
        options["block_size"] = config.block_size
    if config.kv_events_config is not None:
        options["kv_events"] = msgspec.to_builtins(config.kv_events_config)
    return options


def _unused_cache_flags(config: EngineConfig) -> None:
    if config.kv_events_config is not None or config.enable_prefix_caching or config.block_size is not None:
        log.warning(
            "the %s backend ignores --enable-prefix-caching, --block-size and --kv-events-config", config.backend
        )


def make_backend(config: EngineConfig) -> Backend:
    name = config.served_model_name
    if config.backend == "sim":
        from engine.backends.sim import SimBackend, SimBackendConfig

        base = {
            "tokenizer": config.model,
            **({"served_model_name": name} if name else {}),
            **_sim_formats(config),
            **_sim_cache(config),
        }
        return SimBackend(convert_backend_config(config, SimBackendConfig, base))
    if config.backend == "hf":
        _unused_cache_flags(config)
        from engine.backends.hf import HFBackend, HFBackendConfig

        return HFBackend(
            convert_backend_config(config, HFBackendConfig, {"model": config.model, "served_model_name": name})
        )
    from engine.backends.vllm import VLLMBackend, VLLMBackendConfig

    cache: dict[str, Any] = {"enable_prefix_caching": config.enable_prefix_caching, "block_size": config.block_size}
    if config.kv_events_config is not None:
        cache["kv_events"] = msgspec.to_builtins(config.kv_events_config)
    base = {"model": config.model, "served_model_name": name, **{k: v for k, v in cache.items() if v is not None}}
    return VLLMBackend(convert_backend_config(config, VLLMBackendConfig, base))
