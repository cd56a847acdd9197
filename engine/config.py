"""Engine server configuration: one strict struct, from flags or a file."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from engine.derender.chat import ReasoningField
from engine.telemetry import TracingConfig

BackendName = Literal["hf", "sim", "vllm"]

DEFAULT_PORT = 8100
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field."""


class EngineConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    backend: BackendName = "hf"
    model: str
    """Model folder (hf, vllm) or tokenizer folder (sim)."""
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = DEFAULT_PORT
    tokens_only: bool = False
    """No tokenizer: only `output_mode: "tokens"` without stop strings is served, like vLLM's flag."""
    reasoning_parser: str | None = "auto"
    """vLLM's `--reasoning-parser` name; `auto` reads the family from the model folder."""
    tool_parser: str | None = "auto"
    """vLLM's `--tool-call-parser` name; `auto` reads the family from the model folder."""
    reasoning_field: ReasoningField = "reasoning"
    max_body_bytes: Annotated[int, Meta(ge=1024)] = DEFAULT_MAX_BODY_BYTES
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    """OpenTelemetry export; the OTEL_* variables apply when this leaves a field unset."""
    backend_options: dict[str, Any] = {}
    """Extra fields of the backend's own config struct (e.g. sim's `ttft_ms`), checked strictly there."""


def convert_backend_config(config: EngineConfig, kind: type[Struct], base: dict[str, Any]) -> Any:
    """Build a backend's config struct from the engine config, naming any bad field."""
    try:
        return msgspec.convert({**base, **config.backend_options}, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid backend_options for the {config.backend} backend: {exc}") from exc
