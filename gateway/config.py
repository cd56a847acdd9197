"""Gateway configuration: strict structs decoded from YAML, errors name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec
import yaml
from msgspec import Meta, Struct

from wire.grammar_limits import GrammarLimits
from wire.openai_schema import Int64
from plumbing.telemetry import TracingConfig

Route = Literal["derender", "text", "tokens", "tokens-remote"]
ROUTES: tuple[Route, ...] = ("derender", "text", "tokens", "tokens-remote")

# Named defaults: every timeout is explicit.
CONNECT_TIMEOUT_S = 5.0
FIRST_TOKEN_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0
CLIENT_BODY_TIMEOUT_S = 30.0
CLIENT_WRITE_TIMEOUT_S = 60.0
KEEPALIVE_S = 75.0
CLIENT_HEADER_TIMEOUT_S = 20.0
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STORED = 10_000
MAX_STORED_BYTES = 64 * 1024 * 1024
MAX_BUFFERED_TOKENS = 1 << 20
"""About 60 MB of answer where every token carries top_logprobs, far less without them."""
MAX_ANSWER_BYTES = 128 * 1024 * 1024
LARGE_RENDER_CHARS = 1024 * 1024
"""Above an agent's turn (142K tokens, ~570K characters) and below the bodies that stalled
small requests (~4 MB each)."""
LARGE_RENDER_WORKERS = 2
RENDER_CACHE_BYTES = 512 * 1024 * 1024
"""Per worker: ~50M cached prompt tokens at ~10.5 bytes each (the ids and their JSON text),
~360 agent sessions of 140K tokens."""
KV_INDEX_MAX_BLOCKS = 1_000_000
KV_BLOCK_SIZE = 16
KV_REPLAY_TIMEOUT_S = 2.0
KV_LOAD_TOKENS = 512.0
KV_WAITING_TOKENS = 512.0
KV_USAGE_TOKENS = 2048.0
KV_FILL_TOKENS = 4096.0
KV_SESSIONS = 65_536
MAX_TOKENS_PER_MINUTE = 1_000_000_000
"""About 16 M tokens a second: far above any pool's throughput, so a larger value is a typo."""
MAX_TOKENS_PER_DAY = 1_000_000_000_000
MAX_REQUESTS_PER_MINUTE = 10_000_000


class ConfigError(ValueError):
    pass


class Agents(Struct, forbid_unknown_fields=True, kw_only=True):
    """What the gateway does with fields and tools of coding agents (Codex CLI, Claude Code)
    and of API versions newer than this gateway, on `/v1/responses` and `/v1/messages`."""

    unknown_fields: Literal["ignore", "refuse"] = "ignore"
    """A top-level request field this gateway does not know: `ignore` (counted in
    `onehop_ignored_fields_total` and logged once per name, as vLLM's servers do) or `refuse`
    (a 400 naming it). Chat and completions always refuse one."""
    hosted_tools: Literal["drop", "refuse"] = "drop"
    """Tools only OpenAI's or Anthropic's servers run (`web_search`, `file_search`,
    `code_interpreter`, `image_generation`, `mcp`, ...): left out of the prompt (`drop`,
    counted in `onehop_dropped_tools_total`) or a 400 (`refuse`)."""
    strip_attribution: bool = True
    """Remove Claude Code's per-release attribution line (`x-anthropic-billing-header: ...`)
    from the start of the system prompt before render, so conversations share a cacheable prefix."""


class Timeouts(Struct, forbid_unknown_fields=True, kw_only=True):
    connect_s: Annotated[float, Meta(gt=0)] = CONNECT_TIMEOUT_S
    """Opening a connection to an engine."""
    first_token_s: Annotated[float, Meta(gt=0)] = FIRST_TOKEN_TIMEOUT_S
    """Streams: from sending the request to the engine's first event (covers queueing and prefill)."""
    idle_s: Annotated[float, Meta(gt=0)] = IDLE_TIMEOUT_S
    """Streams: longest silence between two events."""
    request_s: Annotated[float, Meta(gt=0)] = REQUEST_TIMEOUT_S
    """Non-streaming requests: the whole generation."""
    client_body_s: Annotated[float, Meta(gt=0)] = CLIENT_BODY_TIMEOUT_S
    """Reading a client's request body, headers to last byte (nginx's client_body_timeout): a 408."""
    client_header_s: Annotated[float, Meta(gt=0)] = CLIENT_HEADER_TIMEOUT_S
    """From a request's first byte to its last header byte (nginx's client_header_timeout);
    past it the connection is closed (a slow-header client holds a socket for free)."""
    keepalive_s: Annotated[float, Meta(gt=0)] = KEEPALIVE_S
    """An idle kept-alive client connection is closed after this long (aiohttp's own default,
    3,630 s, once let 1,100 idle sockets lock every new client out)."""
    client_write_s: Annotated[float, Meta(gt=0)] = CLIENT_WRITE_TIMEOUT_S
    """Streams: longest a client may take nothing while bytes wait for it, measured at its
    socket (what it acknowledged), however much the kernel's send buffer still holds; then the
    stream is closed and its engine request aborted, as for a client that left."""
    stream_deadline_s: Annotated[float, Meta(gt=0)] | None = None
    """Streams: the longest one may last, from the request's arrival; None: no limit. Past it
    the stream ends with an error event (a 504 before its first byte) and its engine request
    is aborted."""


class Admission(Struct, forbid_unknown_fields=True, kw_only=True):
    max_concurrency: Annotated[int, Meta(ge=1)] | None = None
    """Requests served at once (streams hold a slot to their end), per gateway process, or with
    `state.backend: redis` across every worker and replica; None: no limit."""
    max_queue: Annotated[int, Meta(ge=0)] = 64
    """Requests that may wait for a slot (by priority, then fairly across tenants:
    `gateway.edge.admission`); more get a 503 at once (or make a tenant holding more than its
    share give up its newest, with a 429)."""
    queue_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Longest wait for a slot before a 503 (a 429 when the tenant's own limit held it)."""
    retry_after_s: Annotated[int, Meta(ge=1)] = 1
    """The refusals' Retry-After."""


class Limits(Struct, forbid_unknown_fields=True, kw_only=True):
    max_n: Annotated[int, Meta(ge=1, le=16)] = 16
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    """Largest max_tokens / max_completion_tokens a client may ask for; None: the model's context."""
    max_messages: Annotated[int, Meta(ge=1)] = 2048
    max_prompts: Annotated[int, Meta(ge=1)] = 64
    """Prompts in one /v1/completions request (each is one engine request)."""
    max_buffered_tokens: Annotated[int, Meta(ge=1)] = MAX_BUFFERED_TOKENS
    """Largest n × max_tokens × (1 + top_logprobs) (× prompts) a non-streamed request may ask
    for: its answer is held whole, in the engine and here (n 16 × max_tokens 16000 ×
    top_logprobs 20 was a 384 MB answer from a 200-byte request). A missing max_tokens counts
    as the engines' context length. Streams are not bounded by it."""
    max_answer_bytes: Annotated[int, Meta(ge=1024)] = MAX_ANSWER_BYTES
    """A non-streamed engine answer is read up to this many bytes; more is a 502."""
    large_render_chars: Annotated[int, Meta(ge=0)] = LARGE_RENDER_CHARS
    """A request with more text than this (the text-size check's count) renders on a lane of
    its own, so small requests never wait behind it."""
    large_render_workers: Annotated[int, Meta(ge=1)] = LARGE_RENDER_WORKERS
    """Large renders at once (each may take ~100 bytes of memory a character); more wait."""
    render_cache_bytes: Annotated[int, Meta(ge=0)] = RENDER_CACHE_BYTES
    """The turn cache of each worker: tokenized chat turns (4 bytes a token), least recently
    used out first. A conversation's next turn tokenizes only what is new while its earlier
    turns are here; 0 turns the cache off."""
    grammar: GrammarLimits = msgspec.field(default_factory=GrammarLimits)
    """Bounds of a structured-output constraint (`response_format`, Responses `text.format`
    and custom tools' grammars, Messages `output_config.format`, `structured_outputs`): past them an engine's grammar
    library crashes or stalls, so the request never reaches one (issue #27)."""


class Auth(Struct, forbid_unknown_fields=True, kw_only=True):
    api_keys_file: str | None = None
    """One key per line (`#` comments); reloaded on SIGHUP and when it changes."""
    api_keys_env: str | None = None
    """An environment variable holding comma-separated keys, read at start."""
    protect_metrics: bool = False
    """Ask for a key on /metrics too (/health stays open for probes)."""
    poll_s: Annotated[float, Meta(gt=0)] = 1.0

    @property
    def enabled(self) -> bool:
        return self.api_keys_file is not None or self.api_keys_env is not None


class Tenant(Struct, forbid_unknown_fields=True, kw_only=True):
    """What the gateway does for one tenant (an API key's tenant name), or for every tenant
    without an entry of its own (`"*"`)."""

    share_cache: bool = False
    """Let its prompts share engines' prefix-cache blocks with other tenants' (the client's own
    `cache_salt`, if any, passes through). Off: the gateway sets the request's `cache_salt`
    from the tenant, replacing the client's, so no other tenant's prompt ever hits its blocks
    (prefix-cache timing is a side channel between tenants)."""
    tokens_per_minute: Annotated[int, Meta(ge=1, le=MAX_TOKENS_PER_MINUTE)] | None = None
    """Prompt and completion tokens a minute (a token bucket that refills continuously);
    None: no limit. Past it, a 429 with `Retry-After` (`gateway.edge.quota`)."""
    tokens_per_day: Annotated[int, Meta(ge=1, le=MAX_TOKENS_PER_DAY)] | None = None
    """Prompt and completion tokens a day, as `tokens_per_minute` over 24 hours."""
    requests_per_minute: Annotated[int, Meta(ge=1, le=MAX_REQUESTS_PER_MINUTE)] | None = None
    """Requests a minute, counted when admitted; None: no limit."""

    # -- priority and fair queueing (gateway.edge.admission) --
    priority: Int64 = 0
    """Its requests' priority in the admission queue and at the engines (vLLM's convention:
    lower is served sooner). A waiting request of a lower value always goes first."""
    best_priority: Int64 | None = None
    """The most urgent priority one of its requests may ask for (the `X-Vllm-Priority` header,
    or a non-zero `priority` in the body); a more urgent one is capped to it, not refused.
    None: `priority`, so a request may only make itself less urgent."""
    weight: Annotated[float, Meta(gt=0, le=1_000_000)] = 1.0
    """Its share against other tenants of the same priority: served tokens are charged at
    1 / weight, so a tenant of weight 2 gets twice the tokens of one of weight 1 when both wait."""
    max_concurrency: Annotated[int, Meta(ge=1)] | None = None
    """Its requests served at once (as `admission.max_concurrency`: per gateway process, or with
    `state.backend: redis` across all of them); None: no limit."""
    max_queue: Annotated[int, Meta(ge=0)] | None = None
    """Its requests that may wait while it has `max_concurrency` running; one more is a 429.
    None: only `admission.max_queue` bounds them."""

    def __post_init__(self) -> None:
        if self.best_priority is not None and self.best_priority > self.priority:
            raise ConfigError(
                f"best_priority {self.best_priority} is less urgent than priority {self.priority}"
                " (lower is sooner): it would cap nothing"
            )
    # -- end of priority and fair queueing --


class ResponseStoreConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Bounds of the Responses store (`store: true` answers kept for `previous_response_id` and
    `GET /v1/responses/{id}`); past one, the least recently used are evicted. Each tenant (an
    API key's, or the key itself when it names none) has its own share, so that one tenant's
    answers evict its own oldest and never every tenant's. With auth off there is one tenant,
    who may fill the whole store."""

    max_entries: Annotated[int, Meta(ge=1)] = MAX_STORED
    max_bytes: Annotated[int, Meta(ge=1)] = MAX_STORED_BYTES
    """Bytes kept, counted as they are held: encoded JSON and a fixed cost per entry."""
    max_tenant_entries: Annotated[int, Meta(ge=1)] = MAX_STORED // 4
    max_tenant_bytes: Annotated[int, Meta(ge=1)] = MAX_STORED_BYTES // 4

    def __post_init__(self) -> None:
        if self.max_tenant_entries > self.max_entries:
            raise ConfigError("response_store.max_tenant_entries must be at most response_store.max_entries")
        if self.max_tenant_bytes > self.max_bytes:
            raise ConfigError("response_store.max_tenant_bytes must be at most response_store.max_bytes")

    def one_tenant(self) -> ResponseStoreConfig:
        """The bounds when every request is one tenant's (auth off): the whole store is its."""
        return msgspec.structs.replace(self, max_tenant_entries=self.max_entries, max_tenant_bytes=self.max_bytes)


class StateConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the state that outlives a request is kept (the Responses store, admission's
    slots): `memory`, this process's (the workers of `--workers N` share the Responses store in
    an SQLite file in the run's folder; each has its own slots), or `redis`, one server that
    every replica and worker shares."""

    backend: Literal["memory", "redis"] = "memory"
    url: str | None = None
    """The Redis server, `redis://[user:password@]host:port/db` (`rediss://` for TLS)."""
    timeout_s: Annotated[float, Meta(gt=0)] = 0.5
    """The longest one store operation may take; past it (or with the server down) a request
    that needs the store is answered 503 `state_unavailable`."""
    key_prefix: str = "onehop:"
    """Every key this gateway writes starts with it: several deployments can share a server."""
    quota_on_failure: Literal["open", "closed"] = "open"
    """What a tenant quota check does when the Redis server does not answer in `timeout_s`:
    `open` admits the request unchecked (a quota guards cost and fairness, and an outage of
    the store should not become an outage of serving), `closed` refuses it with a 503
    `state_unavailable`. Either way it is counted in `onehop_gateway_quota_unavailable_total`."""
    fairness_sync_s: Annotated[float, Meta(gt=0, le=10)] | None = 0.2
    """With `backend: redis` and an admission limit: how often each process pushes the tokens
    it served to the fair queue's shared counters and reads everyone's back
    (`gateway.edge.shared_fairness`), so fairness across tenants holds over every worker and
    replica, within about this long. None: each process orders by its own counters only."""

    def __post_init__(self) -> None:
        if self.backend == "redis" and not self.url:
            raise ConfigError("state.url is required for state.backend: redis")
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"state.url must be a redis://, rediss:// or unix:// URL, not {self.url!r}")


class Health(Struct, forbid_unknown_fields=True, kw_only=True):
    interval_s: Annotated[float, Meta(gt=0)] = 2.0
    """Active checks: GET /health on every engine this often."""
    check_timeout_s: Annotated[float, Meta(gt=0)] = 2.0
    failure_threshold: Annotated[int, Meta(ge=1)] = 3
    """Consecutive failures (refused requests, 5xx answers, failed checks) that open an engine's circuit."""
    open_s: Annotated[float, Meta(gt=0)] = 5.0
    """How long an open circuit refuses traffic before one trial request."""
    retries: Annotated[int, Meta(ge=0)] = 2
    """Other engines tried when one fails before the first byte reached the client."""
    dns_interval_s: Annotated[float, Meta(gt=0)] = 10.0
    """How often `resolve: true` engines' host names are looked up again."""


class KVIndexConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Bounds of the index of which engine holds which prefix blocks (one per gateway process)."""

    max_blocks: Annotated[int, Meta(ge=1)] = KV_INDEX_MAX_BLOCKS
    """Blocks held across all engines (once per engine holding one); past it the least
    recently stored are forgotten first."""
    block_size: Annotated[int, Meta(ge=1)] = KV_BLOCK_SIZE
    """The engines' KV cache block size in tokens (vLLM's `--block-size`); events of other
    sizes are counted and ignored."""
    replay_timeout_s: Annotated[float, Meta(gt=0)] = KV_REPLAY_TIMEOUT_S
    """Longest wait for an engine's replay of missed event batches."""


class Balancing(Struct, forbid_unknown_fields=True, kw_only=True):
    mode: Literal["least_outstanding", "prefix_affinity", "kv_cache"] = "least_outstanding"
    """least_outstanding: power of two choices. prefix_affinity: requests that share their
    first `prefix_tokens` rendered tokens go to the same engine (its prefix cache is warm),
    unless it has more than `load_factor` times the pool's mean outstanding requests.
    kv_cache: the engine whose cached prefix of the prompt (from its `kv_events`) saves the
    most prefill, weighed against its load (the formula in `gateway.routing.picker`);
    engines without `kv_events`, or a stale index, fall back to prefix_affinity. With
    prefill/decode disaggregation, kv_cache scores the prefill pool so and the decode pool
    by load alone."""
    prefix_tokens: Annotated[int, Meta(ge=1)] = 256
    load_factor: Annotated[float, Meta(ge=1)] = 1.25
    kv_load_tokens: Annotated[float, Meta(ge=0)] = KV_LOAD_TOKENS
    """kv_cache: what one outstanding request costs an engine, in prompt tokens to prefill."""
    kv_waiting_tokens: Annotated[float, Meta(ge=0)] = KV_WAITING_TOKENS
    """kv_cache: what one request queued in the engine (its `vllm:num_requests_waiting`,
    every gateway's requests) costs, in prompt tokens to prefill."""
    kv_usage_tokens: Annotated[float, Meta(ge=0)] = KV_USAGE_TOKENS
    """kv_cache: what a KV cache full of running requests (`vllm:kv_cache_usage_perc` at 1)
    costs, in prompt tokens to prefill; in proportion below."""
    kv_fill_tokens: Annotated[float, Meta(ge=0)] = KV_FILL_TOKENS
    """kv_cache: what an engine whose prefix cache is full (the blocks the KV index says it
    holds, over its `vllm:cache_config_info` size) costs, in prompt tokens to prefill; in
    proportion below. Without it, at low load every new conversation follows a shared system
    prompt and tool list to the one engine that holds them, and that engine's cache thrashes
    while the others idle; about the size of such a shared head spreads them. 0: off."""
    kv_sessions: Annotated[int, Meta(ge=0)] = KV_SESSIONS
    """kv_cache: sessions whose last engine is remembered (to break ties), least recent forgotten first."""
    kv_index: KVIndexConfig = msgspec.field(default_factory=KVIndexConfig)
    """The index of the engines' KV cache blocks, fed by the engines' `kv_events`."""


class EngineEndpoint(Struct, forbid_unknown_fields=True, kw_only=True):
    url: str
    """Base URL of a onehop engine or a vLLM server started with --enable-scale-out."""
    resolve: bool = False
    """Every address the host name resolves to is an engine (a Kubernetes headless Service)."""
    kv_events: str | None = None
    """`tcp://HOST:PORT` of the engine's KV cache event publisher (vLLM's
    `--kv-events-config` endpoint, as seen from the gateway); None: not subscribed."""
    kv_replay: str | None = None
    """`tcp://HOST:PORT` of its replay socket, to ask for missed batches; None: a missed
    batch drops the engine's index entries instead."""
    kv_topic: str = ""
    data_parallel_size: Annotated[int, Meta(ge=1)] = 1
    """Data-parallel ranks behind this URL: rank r publishes (and replays) on port + r."""

    def __post_init__(self) -> None:
        check_url(self.url, "an engine's url")
        for name in ("kv_events", "kv_replay"):
            endpoint = getattr(self, name)
            if endpoint is not None:
                check_tcp(endpoint, f"engine {self.url}: {name}")
        if self.kv_replay is not None and self.kv_events is None:
            raise ConfigError(f"engine {self.url}: kv_replay needs kv_events")
        if self.resolve and self.kv_events is not None:
            raise ConfigError(f"engine {self.url}: kv_events names one engine, so resolve: true cannot have it")


def check_tcp(endpoint: str, what: str) -> None:
    """`tcp://HOST:PORT`, a ZMQ endpoint to connect to."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{what} {endpoint!r} is not a URL: {exc}") from exc
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path or parts.query:
        raise ConfigError(f"{what} {endpoint!r} is not tcp://HOST:PORT")


def check_url(url: str, what: str) -> None:
    """`http(s)://host[:port][/path]`: caught when the config decodes, not by every worker's
    first request."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - reading it checks it (a port that is not a number raises)
    except ValueError as exc:
        raise ConfigError(f"{what} {url!r} is not a URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {url!r} is not an http:// or https:// URL with a host")


class ModelConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """One served model. Fields left unset take the gateway config's top-level value."""

    name: Annotated[str, Meta(min_length=1)]
    """The model name clients send and answers carry."""
    aliases: list[Annotated[str, Meta(min_length=1)]] = []
    """More names clients may send for this model: exact names, or glob patterns (`claude-*`,
    `gpt-5*`: `*`, `?` and `[...]` as in shell globs) for clients whose model names change with
    every release. An exact name (any model's) wins over a pattern; patterns are tried in config order."""
    tokenizer: str
    """Tokenizer (or model) folder: local render and the token route's derender."""
    engines: Annotated[list[EngineEndpoint], Meta(min_length=1)]
    pools: dict[str, Annotated[list[EngineEndpoint], Meta(min_length=1)]] = {}
    prefill_engines: list[EngineEndpoint] = []
    route: Route | None = None
    render: Literal["local", "remote"] | None = None
    remote_url: str | None = None
    reasoning_parser: str | msgspec.UnsetType | None = msgspec.UNSET
    tool_parser: str | msgspec.UnsetType | None = msgspec.UNSET
    reasoning_field: Literal["reasoning", "reasoning_content", "both"] | None = None

    def names(self) -> list[str]:
        """The exact names this model answers to (its name and the aliases that are not patterns)."""
        return [self.name, *(alias for alias in self.aliases if not is_pattern(alias))]

    def patterns(self) -> list[str]:
        return [alias for alias in self.aliases if is_pattern(alias)]

    @property
    def parsers(self) -> tuple[str | None, str | None]:
        """The reasoning and tool parser names (`auto` not yet settled), once `served_models()`
        filled in the gateway's defaults; unset here means that has not happened."""
        reasoning, tool = self.reasoning_parser, self.tool_parser
        if isinstance(reasoning, msgspec.UnsetType) or isinstance(tool, msgspec.UnsetType):
            raise ConfigError(f"model {self.name!r}: its parsers were read before the gateway's defaults filled them")
        return reasoning, tool


def is_pattern(alias: str) -> bool:
    return any(mark in alias for mark in "*?[")


class GatewayConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    """Single-model shorthand: the model name clients send (with `tokenizer` and `engines`).
    Several models: `models` instead."""
    tokenizer: str | None = None
    """Tokenizer (or model) folder: local render and the token route's derender."""
    engines: list[EngineEndpoint] = []
    pools: dict[str, Annotated[list[EngineEndpoint], Meta(min_length=1)]] = {}
    """More engine pools, by name: a policy rule's `pool` sends its requests there
    (`engines` serves the rest). Each pool is balanced and health-checked on its own."""
    prefill_engines: list[EngineEndpoint] = []
    """Disaggregated serving: requests (each prompt of a completion) are prefilled here
    (max_tokens=1), then decoded on `engines` with the KV cache the prefill engine hands
    over. Empty: no disaggregation."""
    models: list[ModelConfig] = []
    """Several models behind one base_url, each with its own tokenizer, parsers and pools;
    the top-level route, render, remote_url and parser settings are their defaults.
    Requests for a name no model answers to get a 404."""
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    route: Route = "derender"
    """The route when no policy file is given (and the policy's last resort)."""
    policy: str | None = None
    """A policy YAML (see configs/policy.yaml): rules and a cost model pick the route per request.
    Reloaded on SIGHUP and when the file changes; an invalid file keeps the old policy."""
    policy_poll_s: Annotated[float, Meta(gt=0)] = 1.0
    """How often the policy file is checked for changes."""
    feedback_interval_s: Annotated[float, Meta(gt=0)] = 1.0
    """How often engines' /metrics are scraped for the cost model's live feedback."""
    route_header: bool = False
    """Honour an `onehop-route` request header (tests, debugging). Off unless asked for: any
    client could use it to skip the cost policy (`onehop serve`, a local tool, turns it on)."""
    policy_header: bool = False
    """Say in an `onehop-policy` response header why the route (and, with `kv_cache`
    balancing, the engine) was chosen, and in `onehop-engine` which engine (debugging). Off
    unless asked for: the cost model's reason shows the engines' live load, and engine
    URLs are internal."""
    render: Literal["local", "remote"] = "local"
    remote_url: str | None = None
    """vLLM server for remote render and the tokens-remote route."""
    reasoning_parser: str | None = "auto"
    """vLLM's `--reasoning-parser` name for the text and tokens routes; `auto` reads the
    family from the tokenizer folder. A name onehop lacks leaves chat on the derender route."""
    tool_parser: str | None = "auto"
    """vLLM's `--tool-call-parser` name; `auto` as for `reasoning_parser`."""
    reasoning_field: Literal["reasoning", "reasoning_content", "both"] = "reasoning"
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    max_body_bytes: Annotated[int, Meta(ge=1024)] = MAX_BODY_BYTES
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    """OpenTelemetry export (OTLP/HTTP); the OTEL_* variables apply where this leaves a field unset."""
    admission: Admission = msgspec.field(default_factory=Admission)
    health: Health = msgspec.field(default_factory=Health)
    balancing: Balancing = msgspec.field(default_factory=Balancing)
    limits: Limits = msgspec.field(default_factory=Limits)
    auth: Auth = msgspec.field(default_factory=Auth)
    response_store: ResponseStoreConfig = msgspec.field(default_factory=ResponseStoreConfig)
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    agents: Agents = msgspec.field(default_factory=Agents)
    tenants: dict[str, Tenant] = msgspec.field(default_factory=dict)
    """Per tenant name (the API key lines' `TENANT KEY`), and `"*"` for the others."""
    cache_salt_secret_env: str = "ONEHOP_CACHE_SALT_SECRET"
    """An environment variable whose value keys the tenants' cache salts (replicas must share
    it to share cache); unset, a fixed key is used, which is enough while clients reach
    engines only through the gateway (it replaces their salts)."""

    def tenant(self, name: str) -> Tenant:
        """The settings for tenant `name`: its own entry, else `"*"`'s, else the defaults."""
        return self.tenants.get(name) or self.tenants.get("*") or Tenant()

    def __post_init__(self) -> None:
        shorthand = [name for name in ("model", "tokenizer") if getattr(self, name) is not None]
        shorthand += [name for name in ("engines", "pools", "prefill_engines") if getattr(self, name)]
        if self.models and shorthand:
            raise ConfigError(f"models is given, so {', '.join(shorthand)} belong inside each model")
        if not self.models and (self.model is None or self.tokenizer is None or not self.engines):
            raise ConfigError("give model, tokenizer and engines (one model) or models (several)")
        seen: set[str] = set()
        for model in self.served_models():
            for name in model.names() + model.patterns():
                if name in seen:
                    raise ConfigError(f"the model name {name!r} is given twice")
                seen.add(name)
            if model.remote_url is not None:
                check_url(model.remote_url, f"model {model.name!r}: remote_url")
            needs_remote = model.render == "remote" or model.route == "tokens-remote"
            if needs_remote and not model.remote_url:
                raise ConfigError(
                    f"model {model.name!r}: remote_url is required for render: remote or route: tokens-remote"
                )

    def served_models(self) -> list[ModelConfig]:
        """Every served model, with the top-level defaults filled in."""
        if not self.models:
            assert self.model is not None and self.tokenizer is not None
            single = ModelConfig(
                name=self.model,
                tokenizer=self.tokenizer,
                engines=self.engines,
                pools=self.pools,
                prefill_engines=self.prefill_engines,
            )
            return [self._with_defaults(single)]
        return [self._with_defaults(model) for model in self.models]

    def _with_defaults(self, model: ModelConfig) -> ModelConfig:
        return msgspec.structs.replace(
            model,
            route=model.route or self.route,
            render=model.render or self.render,
            remote_url=model.remote_url or self.remote_url,
            reasoning_parser=(
                self.reasoning_parser if model.reasoning_parser is msgspec.UNSET else model.reasoning_parser
            ),
            tool_parser=self.tool_parser if model.tool_parser is msgspec.UNSET else model.tool_parser,
            reasoning_field=model.reasoning_field or self.reasoning_field,
        )


def load_config(path: str | Path) -> GatewayConfig:
    """Read and check a YAML gateway config; the error names the bad field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text: {exc}") from exc
    try:
        raw = yaml.safe_load(text)
        return msgspec.convert(raw, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_tenant_named(raw, exc)}") from exc
    except (yaml.YAMLError, ConfigError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _tenant_named(raw: object, exc: msgspec.ValidationError) -> str:
    """msgspec names a dict's entry `[...]`; for `tenants:` the message names the tenant too."""
    message = str(exc)
    tenants = raw.get("tenants") if isinstance(raw, dict) else None
    if "$.tenants[...]" not in message or not isinstance(tenants, dict):
        return message
    for name, entry in tenants.items():
        try:
            msgspec.convert(entry, Tenant)
        except msgspec.ValidationError as inner:
            where = f"$.tenants[{name!r}]"
            said = str(inner)
            return said.replace(" - at `$", f" - at `{where}", 1) if " - at `$" in said else f"{said} - at `{where}`"
    return message
