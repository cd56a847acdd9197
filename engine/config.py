"""Engine server configuration: one strict struct, from flags or a file."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from derender.chat import ReasoningField
from plumbing.http_server import HEADER_S, KEEPALIVE_S
from wire.grammar_limits import GrammarLimits
from plumbing.telemetry import TracingConfig

BackendName = Literal["hf", "sim", "vllm"]

DEFAULT_PORT = 8100
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field."""


class EngineLimits(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The largest counts one generate request may ask for; more is a 400 naming the field.

    The engine is reachable directly (not only behind the gateway, which has its own,
    lower bounds), so every count that sizes work or memory is checked here before any
    generation. Names follow vLLM's flags where it has one. The context length is not
    here: it is the backend's `max_model_len` (prompt + max_tokens must fit it, and a
    larger max_tokens is capped to it, as vLLM does). Token ids in `stop_token_ids`,
    `allowed_token_ids`, `logit_bias` and the logprob id lists must be in the
    vocabulary, and those lists may not be longer than the vocabulary.
    """

    max_num_seqs: Annotated[int, Meta(ge=1)] = 256
    """Most choices (`n`) per request, as vLLM's `--max-num-seqs` bounds them. 256 is vLLM's
    default on most GPUs (it picks 128 on CPU, 1024 on H100-class cards): a request that stock
    vLLM accepts there is accepted here, while the per-choice state stays small."""
    max_logprobs: Annotated[int, Meta(ge=-1)] = 20
    """Most `logprobs` and `prompt_logprobs` candidates per token, as vLLM's `--max-logprobs`;
    -1 allows the whole vocabulary (and so `logprobs: -1`)."""
    max_logprob_token_ids: Annotated[int, Meta(ge=0)] = 128
    """Longest `logprob_token_ids` list (vLLM's fixed `MAX_LOGPROB_TOKEN_IDS`)."""
    max_stop: Annotated[int, Meta(ge=0)] = 64
    """Most `stop` strings: each one is searched in every choice's text at every step."""
    max_bad_words: Annotated[int, Meta(ge=0)] = 128
    """Most `bad_words` (vLLM's `VLLM_MAX_NUM_BAD_WORDS`, which it counts after tokenizing)."""
    max_string_chars: Annotated[int, Meta(ge=1)] = 1024
    """Longest stop string or bad word, in characters: a stop string's length is the text
    each choice holds back while it might still match."""
    grammar: GrammarLimits = msgspec.field(default_factory=GrammarLimits)
    """Size, depth and symbol bounds of a `structured_outputs` constraint, checked before it
    is compiled (past them the grammar library crashes or stalls: `wire.grammar_limits`)."""


class KVEventsConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """vLLM's `--kv-events-config`: where the engine publishes its prefix cache's block events.

    The keys and defaults are vLLM's (`KVEventsConfig`), so one JSON serves both engines; an
    unknown key is an error here, not a silently ignored typo. `publisher` left out follows
    `enable_kv_cache_events`, as in vLLM. Wire format: `wire.kv_events`.
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] | None = None
    endpoint: str = "tcp://*:5557"
    """The PUB socket: a wildcard (`*`, `::`), `ipc://`, `inproc://` or port-0 endpoint is
    bound, any other connected to (a collector that binds), as vLLM decides."""
    replay_endpoint: str | None = None
    """The ROUTER socket that resends buffered batches from a sequence number; None: none."""
    buffer_steps: Annotated[int, Meta(ge=1)] = 10_000
    """Batches kept for replay."""
    hwm: Annotated[int, Meta(ge=0)] = 100_000
    """ZMQ's send high-water mark: past it a slow subscriber misses messages (and replays)."""
    max_queue_size: Annotated[int, Meta(ge=1)] = 100_000
    """Accepted for vLLM's sake; events are sent as they come, so nothing queues here."""
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether events leave the engine: enabled, on the zmq publisher."""
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def kv_events_config(text: str) -> KVEventsConfig:
    """The `--kv-events-config` JSON, strictly decoded; raises `ConfigError` naming the key."""
    try:
        return msgspec.json.decode(text, type=KVEventsConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"invalid --kv-events-config: {exc}") from exc


def engine_limits(**values: Any) -> EngineLimits:
    """`EngineLimits` with its bounds checked (a plain constructor call skips `Meta`)."""
    try:
        return msgspec.convert(values, EngineLimits)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid engine limits: {exc}") from exc


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
    keepalive_s: Annotated[float, Meta(gt=0)] = KEEPALIVE_S
    """An idle kept-alive connection is closed after this long."""
    client_header_s: Annotated[float, Meta(gt=0)] = HEADER_S
    """A request's headers must be complete this long after its first byte, else the connection is closed."""
    limits: EngineLimits = msgspec.field(default_factory=EngineLimits)
    """Per-request count bounds (`n`, logprobs, stop lists, ...), checked before generation."""
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    """OpenTelemetry export; the OTEL_* variables apply when this leaves a field unset."""
    enable_prefix_caching: bool | None = None
    """vLLM's `--enable-prefix-caching`; None leaves the backend's own default (the sim's
    `prefix_caching` option)."""
    block_size: Annotated[int, Meta(ge=1)] | None = None
    """vLLM's `--block-size`: tokens per KV cache block; None: the backend's default."""
    kv_events_config: KVEventsConfig | None = None
    """vLLM's `--kv-events-config`; only the sim backend publishes here."""
    backend_options: dict[str, Any] = {}
    """Extra fields of the backend's own config struct (e.g. sim's `ttft_ms`), checked strictly there."""


def convert_backend_config(config: EngineConfig, kind: type[Struct], base: dict[str, Any]) -> Any:
    """Build a backend's config struct from the engine config, naming any bad field."""
    try:
        return msgspec.convert({**base, **config.backend_options}, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid backend_options for the {config.backend} backend: {exc}") from exc
