"""The simulator's configuration (`SimBackendConfig`), checked when it is built."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from derender.parsers import REASONING_PARSERS, TOOL_PARSERS
from engine.config import KVEventsConfig


class SimConfigError(ValueError):
    """The simulator's configuration or tokenizer folder cannot be used."""


class SimBackendConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokenizer: str
    """A Hugging Face tokenizer folder; its tokenizer.json is loaded."""
    served_model_name: str = "sim"
    ttft_ms: Annotated[float, Meta(ge=0)] = 0
    itl_ms: Annotated[float, Meta(ge=0)] = 0
    tokens_per_step: Annotated[int, Meta(ge=1)] = 1
    mode: Literal["auto", "echo", "script", "agent"] = "auto"
    script: list[str] = []
    agent_calls: dict[str, dict[str, Any]] = {}
    seed: int = 0
    max_model_len: Annotated[int, Meta(ge=1)] = 32768
    reasoning: bool = True
    output_tokens: Annotated[int, Meta(ge=0)] | None = None
    reasoning_format: str | None = "qwen3"
    tool_format: str = "hermes"
    prefix_caching: bool = False
    block_size: Annotated[int, Meta(ge=1)] = 16
    cache_blocks: Annotated[int, Meta(ge=1)] = 4096
    prefill_us_per_token: Annotated[float, Meta(ge=0)] = 0
    kv_events: KVEventsConfig | None = None
    """The engine's `--kv-events-config`, set by the engine (publishing needs `prefix_caching`)."""
    kv_events_encoding: Literal["map", "array"] = "map"

    def __post_init__(self) -> None:
        # Constructing directly skips the Meta checks; a zero step would never end one.
        if self.tokens_per_step < 1:
            raise SimConfigError(f"tokens_per_step must be at least 1, got {self.tokens_per_step}")
        if self.block_size < 1 or self.cache_blocks < 1:
            raise SimConfigError("block_size and cache_blocks must be at least 1")
        if self.mode == "script" and not self.script:
            raise SimConfigError("mode 'script' needs at least one text in script")
        if self.mode == "agent" and not self.agent_calls:
            raise SimConfigError("mode 'agent' needs at least one tool in agent_calls")
        reasoning = REASONING_PARSERS.get(self.reasoning_format) if self.reasoning_format is not None else None
        if self.reasoning_format is not None and (reasoning is None or reasoning.format_reasoning is None):
            raise SimConfigError(f"the simulator cannot write reasoning as {self.reasoning_format!r}")
        tools = TOOL_PARSERS.get(self.tool_format)
        if tools is None or tools.format_calls is None:
            raise SimConfigError(f"the simulator cannot write tool calls as {self.tool_format!r}")
