"""The gateway's aiohttp application: OpenAI routes, lifecycle, the small endpoints.

`create_app(config)` wires everything through `AppKey`s and `cleanup_ctx`;
`serve(config)` runs it with uvloop and handler cancellation.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import logging
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgspec
from aiohttp import web
from opentelemetry.trace import Span, SpanKind

from plumbing.http_server import CONNECTION_LIMITS, ERROR_BODY, ConnectionLimits, new_event_loop, run_app
from derender.vocab import TokenVocab, vocab_for
from derender.parsers import REASONING_PARSERS, TOOL_PARSERS, UnknownParser, bind_reasoning, check_tool_markers
from derender.parsers.detect import resolve
from wire.openai_schema import ModelCard, ModelList
from plumbing.telemetry import Tracing, extract, traceresponse
from gateway.edge.access_log import AccessLogger
from gateway.edge.admission import Gate
from gateway.edge.shared_fairness import SharedFairness
from gateway.edge.shared_slots import SharedSlots
from gateway.render.chat_template import ChatTemplateError
from gateway.edge.auth import OWNER_KEY, TENANT_KEY, check_key, keys_from_env, load_key_file, needs_key
from gateway.config import ConfigError, EngineEndpoint, GatewayConfig, Limits, ModelConfig
from gateway.upstream.engine_client import ABORT_TIMEOUT_S, EngineClient, EngineMismatch, Expected
from gateway.edge.errors import (
    ERROR_BODIES,
    ErrorBody,
    ERROR_KEY,
    Handler,
    RouteNotFound,
    gateway_error_middleware,
    status_error_json,
)
from gateway.edge.quota_headers import quota_headers
from gateway.routing.feedback import EngineFeedback
from gateway.edge.context import OUTCOME_KEY, QUOTA_KEY, SPAN_KEY, STARTED_KEY, TALLY_KEY
from gateway.observe.spans import OPERATIONS, describe_arrival, describe_outcome
from gateway.observe.outcome import CLIENT_GONE, Outcome, Tally
from gateway.serving.memory import freeze_start_heap, release_freed_memory
from gateway.flow.lookups import handle_count_tokens, handle_delete_response, handle_get_response, handle_input_tokens
from gateway.apis.messages import error_body as messages_error_body
from gateway.flow.pipeline import handle_chat, handle_completion, handle_messages, handle_responses
from gateway.apis.shared_responses import response_storage
from gateway.serving.runtime import ModelRuntime
from gateway.observe.metrics import GatewayMetrics
from gateway.routing.policy import Policy, policy_for
from gateway.upstream.kv_events import KVSubscriber
from gateway.routing.datastore import EndpointStore
from gateway.routing.picker import Mode, Picker
from gateway.routing.kv_index import KVIndex
from gateway.serving.reload import WatchedFile
from gateway.render.local import LocalRenderer
from gateway.render.tokenizer_folder import TokenizerFolderError
from gateway.serving.state import GATEWAY, GatewayState
from gateway.serving.supervisor import Supervisor
from gateway.serving.worker_env import WORKER_HEADER, worker_index, worker_port

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
ROUTE_RESPONSE_HEADER = "onehop-route"
POLICY_RESPONSE_HEADER = "onehop-policy"
"""Why the route was chosen: the rule, the cost comparison, or the override."""
ENGINE_RESPONSE_HEADER = "onehop-engine"
"""With `policy_header`: the engine routing chose (its URL), beside why."""
REQUEST_ID_HEADER = "X-Request-Id"
"""The answer's id on every chat and completions response, errors included (as vLLM's
`--enable-request-id-headers` sends it)."""
TRACERESPONSE_HEADER = "traceresponse"
"""With tracing on, every API answer (errors and streams included) names its trace and server
span (W3C Trace Context Level 2), so a client can find the trace of its request."""


@dataclass(frozen=True)
class _ModelPlan:
    """A model's settings (parsers settled) and pool clients; its runtime is built at start."""

    config: ModelConfig
    parses_locally: bool
    engines: EngineClient
    pools: dict[str, EngineClient]
    prefill: EngineClient | None

    def clients(self) -> list[EngineClient]:
        out = [self.engines, *self.pools.values()]
        return out if self.prefill is None else [*out, self.prefill]


def _longest_token(vocab: TokenVocab) -> int:
    """The most text one token can stand for (bytes of byte-level pieces, else characters)."""
    pieces = vocab.token_bytes if vocab.byte_level else vocab.backend.get_vocab()
    return max(1, max(map(len, pieces), default=1), *map(len, vocab.added_text.values()))


async def _runtime(plan: _ModelPlan, limits: Limits, metrics: GatewayMetrics) -> ModelRuntime:
    """Load what serving the model needs (off the loop: tokenizer files are large)."""
    config = plan.config
    try:
        renderer = await asyncio.to_thread(
            functools.partial(
                LocalRenderer,
                config.tokenizer,
                large_chars=limits.large_render_chars,
                large_workers=limits.large_render_workers,
                cache_bytes=limits.render_cache_bytes,
                on_cache=metrics.render_cache,
            )
        )
    except (TokenizerFolderError, ChatTemplateError) as exc:
        raise ConfigError(f"model {config.name}: {exc}") from exc
    # One tokenizer for render and derender: each copy of a 151k-token vocabulary is ~45 MB.
    vocab = await asyncio.to_thread(vocab_for, renderer.tokenizer)
    if config.reasoning_parser in REASONING_PARSERS:  # its markers checked now: a missing one is logged at start
        bind_reasoning(vocab, config.reasoning_parser)
    if config.tool_parser in TOOL_PARSERS:
        try:
            await asyncio.to_thread(check_tool_markers, vocab, config.tool_parser)
        except UnknownParser as exc:
            raise ConfigError(f"model {config.name}: tool parser {config.tool_parser!r}: {exc}") from exc
    # served_models() filled in the defaults.
    assert config.route is not None and config.render is not None and config.reasoning_field is not None
    return ModelRuntime(
        name=config.name,
        renderer=renderer,
        vocab=vocab,
        max_chars_per_token=_longest_token(vocab),
        reasoning_parser=config.parsers[0],
        tool_parser=config.parsers[1],
        reasoning_field=config.reasoning_field,
        parses_locally=plan.parses_locally,
        render=config.render,
        remote_url=config.remote_url,
        fixed_policy=Policy(default=config.route),
        engines=plan.engines,
        pools=plan.pools,
        prefill=plan.prefill,
    )


async def _start(state: GatewayState, plans: list[_ModelPlan], loops: Supervisor) -> None:
    """Everything before the first request: engines resolved and checked, files loaded,
    each model's runtime built, background loops running."""
    config = state.config
    try:
        for engines in state.clients:
            await engines.store.resolve()
            await engines.check_engines(strict=True)
    except EngineMismatch as exc:
        raise ConfigError(f"refusing to start: {exc.message}") from exc
    if config.policy is not None:
        pools = {name for plan in plans for name in plan.pools}
        policy = await asyncio.to_thread(WatchedFile, config.policy, lambda path: policy_for(path, pools), "policy")
        state.policy_file = policy
        loops.start("policy_file", lambda: policy.watch(config.policy_poll_s))
    if config.auth.api_keys_file is not None:
        keys = await asyncio.to_thread(WatchedFile, config.auth.api_keys_file, load_key_file, "API keys")
        state.key_file = keys
        loops.start("key_file", lambda: keys.watch(config.auth.poll_s))
    for plan in plans:
        runtime = await _runtime(plan, config.limits, state.metrics)
        for name in plan.config.names():
            state.models[name] = runtime
        state.patterns += [(re.compile(fnmatch.translate(alias)), runtime) for alias in plan.config.patterns()]
    release_freed_memory()
    for engines in state.clients:
        loops.start("health", engines.watch_health)
        loops.start("dns", functools.partial(engines.watch_dns, config.health.dns_interval_s))
    loops.start("feedback", lambda: state.feedback.run(state.clients[0].session))
    shared = state.gate.shared
    if shared is not None:
        loops.start("admission_leases", shared.renew)
    if state.gate.fairness is not None:
        loops.start("admission_fairness", state.gate.fairness.run)


def shared_slots(config: GatewayConfig) -> SharedSlots | None:
    """Slots counted in Redis where the state is there and a limit needs counting."""
    limited = config.admission.max_concurrency is not None or any(
        tenant.max_concurrency is not None for tenant in config.tenants.values()
    )
    return SharedSlots(config.state) if config.state.backend == "redis" and limited else None


def shared_fairness(config: GatewayConfig, slots: SharedSlots | None, metrics: GatewayMetrics) -> SharedFairness | None:
    """The fair queue's counters in Redis where the slots are (a queue needs a limit) and
    sharing them is not turned off; a round the server missed is counted."""
    if slots is None or config.state.fairness_sync_s is None:
        return None
    missed = metrics.quota_unavailable.labels("fairness_local")
    return SharedFairness(config.state, config.tenants, missed.inc)


async def _lifecycle(app: web.Application, plans: list[_ModelPlan]) -> AsyncIterator[None]:
    state = app[GATEWAY]
    loops = Supervisor(lambda name: state.metrics.background_restarts.labels(name).inc())
    for engines in state.clients:
        await engines.start()
    try:
        await _start(state, plans, loops)
    except BaseException:
        await loops.stop()
        for engines in state.clients:
            await engines.close()
        for model in state.served():
            model.renderer.close()
        await state.responses.close()
        await state.quotas.close()
        await state.gate.close()
        raise
    yield
    await loops.stop()
    # Aborts still in flight need the engine session: let them finish (they are
    # bounded by ABORT_TIMEOUT_S) before it closes.
    pending = list(state.background)
    if pending:
        await asyncio.wait(pending, timeout=ABORT_TIMEOUT_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for engines in state.clients:
        await engines.close()
    for model in state.served():
        model.renderer.close()
    await state.responses.close()
    await state.quotas.close()
    await state.gate.close()
    await state.tracing.shutdown()


_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[GATEWAY]
    auth = state.config.auth
    if auth.enabled and needs_key(request, auth.protect_metrics):
        headers = request.headers
        caller = check_key(headers.get("Authorization"), state.api_keys(), headers.get("x-api-key"))
        if caller.tenant is not None:
            request[TENANT_KEY] = caller.tenant
        request[OWNER_KEY] = caller.owner
    return await handler(request)


@web.middleware
async def observe_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The server span of every API request (named per the GenAI conventions), and its outcome event."""
    endpoint = _ENDPOINTS.get(request.path)
    if endpoint is None:
        return await handler(request)
    state = request.app[GATEWAY]
    operation = OPERATIONS[endpoint]
    request[STARTED_KEY] = started = time.perf_counter()
    request[TALLY_KEY] = tally = Tally()
    in_flight = state.metrics.child(state.metrics.in_flight, endpoint)
    in_flight.inc()
    status = CLIENT_GONE
    with state.tracing.tracer.start_as_current_span(
        operation,  # `{operation} {model}` once the model is known
        kind=SpanKind.SERVER,
        context=extract(request.headers),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        request[SPAN_KEY] = span
        describe_arrival(span, operation, request.method, request.path)
        try:
            response = await handler(request)
            if not tally.client_gone:  # one that left mid-stream did not get the 200 it was sent
                status = response.status
            if tally.content is not None and isinstance(response, web.Response) and isinstance(response.body, bytes):
                tally.content.append(response.body)  # a whole answer (a stream's frames were kept as sent)
            return response
        finally:
            in_flight.dec()
            outcome = _outcome(request, endpoint, status, time.perf_counter() - started, span)
            request[OUTCOME_KEY] = outcome
            state.outcomes.emit(outcome)


def _outcome(request: web.Request, endpoint: str, status: int, duration_s: float, span: Span) -> Outcome:
    answered = request[TALLY_KEY]
    error = request.get(ERROR_KEY)
    broken = answered.stream_error if status != CLIENT_GONE else None
    if broken is not None:  # its headers said 200; its answer ended in an error event
        status, error = broken
    return Outcome(
        request_id=answered.request_id,
        endpoint=endpoint,
        model=answered.model,
        tenant=request.get(TENANT_KEY),
        route=answered.route or "none",
        status=status,
        error=error,
        stream_error=broken is not None,
        finish_reasons=answered.finish_reasons,
        tokens=answered.tokens,
        duration_s=duration_s,
        content=b"".join(answered.content) if answered.content is not None else None,
        span=span,
        cut=answered.cut,
    )


async def _answer_headers(request: web.Request, response: web.StreamResponse) -> None:
    tally = request.get(TALLY_KEY)
    if tally is None:
        return
    trace = traceresponse(request[SPAN_KEY])
    if trace is not None:
        response.headers[TRACERESPONSE_HEADER] = trace
    if tally.request_id is not None:
        response.headers[REQUEST_ID_HEADER] = tally.request_id
    if tally.route is not None:
        response.headers[ROUTE_RESPONSE_HEADER] = tally.route
    quota = request.get(QUOTA_KEY)
    if quota is not None:
        response.headers.update(quota_headers(quota, anthropic=request.path.startswith("/v1/messages")))
    reason = tally.reason
    if reason is not None and request.app[GATEWAY].config.policy_header:
        response.headers[POLICY_RESPONSE_HEADER] = ascii_header(reason)
        if tally.engine is not None:
            response.headers[ENGINE_RESPONSE_HEADER] = ascii_header(tally.engine)


def ascii_header(value: str) -> str:
    """A header value clients accept: HTTP headers are ASCII, so anything else is escaped."""
    return value if value.isascii() else value.encode("ascii", "backslashreplace").decode("ascii")


def resolve_parsers(model: ModelConfig) -> tuple[ModelConfig, bool]:
    """Settle `auto` from the tokenizer folder; also whether the gateway can parse these
    families itself (if not, chat only takes routes where the engine parses)."""
    found = resolve(model.tokenizer, *model.parsers)
    local = (found.reasoning is None or found.reasoning in REASONING_PARSERS) and (
        found.tool is None or found.tool in TOOL_PARSERS
    )
    log.info(
        "model %s parsers: reasoning %s, tool %s (%s)%s",
        model.name,
        found.reasoning,
        found.tool,
        found.why,
        "" if local else "; onehop lacks one of them, so chat takes only engine-parsed routes",
    )
    return msgspec.structs.replace(model, reasoning_parser=found.reasoning, tool_parser=found.tool), local


def create_app(config: GatewayConfig, *, also_metrics: Sequence[Callable[[], bytes]] = ()) -> web.Application:
    """The gateway for `config`; `also_metrics` are served on its /metrics after its own (an
    engine in the same process, whose own port is private)."""
    # Outermost first: every answer (401 and 429 included) is observed and in OpenAI's shape.
    middlewares = [observe_middleware, gateway_error_middleware, auth_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[ERROR_BODY] = status_error_json  # the HTTP parser's own refusals, in OpenAI's shape too
    app[CONNECTION_LIMITS] = ConnectionLimits(
        keepalive_s=config.timeouts.keepalive_s, header_s=config.timeouts.client_header_s
    )
    tracing = Tracing(config.tracing, "onehop-gateway")
    metrics = GatewayMetrics(tenants=frozenset(config.tenants) - {"*"}, also=tuple(also_metrics))

    def client(
        model: ModelConfig, members: list[EngineEndpoint], *, prefill: bool = False, mode: Mode | None = None
    ) -> EngineClient:
        # A pool whose engines publish KV events keeps an index of their blocks; each
        # worker process subscribes itself (ZMQ's PUB fans out to every subscriber).
        balancing = config.balancing
        kv = balancing.kv_index
        # kv_cache keeps an index of the pool's blocks, fed by the events of the engines
        # configured with `kv_events` and of onehop engines whose capabilities name theirs.
        by_cache = (mode or balancing.mode) == "kv_cache"
        indexed = by_cache or (mode is None and any(member.kv_events is not None for member in members))
        index = KVIndex(kv.block_size, kv.max_blocks, on_ignored=metrics.kv_ignored) if indexed else None

        def subscribe(member: EngineEndpoint) -> KVSubscriber:
            assert index is not None
            return KVSubscriber.of(member, index, metrics=metrics, replay_timeout_s=kv.replay_timeout_s)

        subscribers = [subscribe(member) for member in members if member.kv_events is not None and index is not None]
        store = EndpointStore(
            members, config.health, on_circuit=metrics.circuit, index=index, max_sessions=balancing.kv_sessions
        )
        return EngineClient(
            store,
            Picker(balancing, mode),
            config.timeouts,
            config.health,
            remote=model.remote_url is not None,
            expected=Expected(
                model=model.name,
                names=frozenset(model.names()),
                reasoning_parser=model.parsers[0],
                tool_parser=model.parsers[1],
                parsers=not prefill,
            ),
            tracing=tracing,
            on_retry=lambda url: metrics.engine_retries.labels(url).inc(),
            subscribers=subscribers,
            subscribe=subscribe if by_cache else None,
        )

    plans = []
    for served in config.served_models():
        model, parses_locally = resolve_parsers(served)
        # With P/D the KV cache that matters is the prefill pool's: the decode engine gets
        # the prompt's KV handed over, so kv_cache balancing weighs only its load.
        decode: Mode | None = "load" if model.prefill_engines and config.balancing.mode == "kv_cache" else None
        plans.append(
            _ModelPlan(
                config=model,
                parses_locally=parses_locally,
                engines=client(model, model.engines, mode=decode),
                pools={name: client(model, members) for name, members in model.pools.items()},
                prefill=client(model, model.prefill_engines, prefill=True) if model.prefill_engines else None,
            )
        )
    slots = shared_slots(config)
    gate = Gate(config.admission, metrics.admission, slots, shared_fairness(config, slots, metrics))
    metrics.admission.in_use(0, config.admission.max_concurrency)
    clients = [engines for plan in plans for engines in plan.clients()]
    feedback = EngineFeedback(lambda: [engines.store for engines in clients], config.feedback_interval_s)
    stored = config.response_store if config.auth.enabled else config.response_store.one_tenant()
    state = GatewayState(
        config=config, gate=gate, clients=clients, feedback=feedback, tracing=tracing, metrics=metrics,
        responses=response_storage(config.state, stored),
    )
    app[GATEWAY] = state
    state.outcomes.subscribe(describe_outcome)
    state.outcomes.subscribe(metrics.record)
    state.outcomes.subscribe(metrics.record_tenant)
    state.outcomes.subscribe(state.quotas.on_outcome)
    if config.auth.api_keys_env is not None:
        state.env_keys = keys_from_env(config.auth.api_keys_env)
        if not state.env_keys and config.auth.api_keys_file is None:
            raise ConfigError(f"auth.api_keys_env names {config.auth.api_keys_env}, which holds no key")
    app.cleanup_ctx.append(lambda app: _lifecycle(app, plans))
    app.on_response_prepare.append(_answer_headers)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/v1/completions", handle_completion)
    app.router.add_post("/v1/responses", handle_responses)
    app.router.add_post("/v1/responses/input_tokens", handle_input_tokens)
    app.router.add_get("/v1/responses/{response_id}", handle_get_response)
    app.router.add_delete("/v1/responses/{response_id}", handle_delete_response)
    app.router.add_post("/v1/messages", handle_messages)
    app.router.add_post("/v1/messages/count_tokens", handle_count_tokens)
    own_shapes: dict[str, ErrorBody] = {"/v1/messages": messages_error_body}
    app[ERROR_BODIES] = own_shapes
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model}", handle_model)
    for path in NOT_SERVED:
        app.router.add_post(path, handle_not_served)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/", handle_root)  # HEAD too: Claude Code probes `HEAD /` before its first request
    return app


async def handle_metrics(http: web.Request) -> web.Response:
    body = http.app[GATEWAY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _card(model: ModelRuntime, created: int) -> ModelCard:
    return ModelCard(id=model.name, root=model.name, created=created, max_model_len=model.engines.max_model_len())


async def handle_models(http: web.Request) -> web.Response:
    now = int(time.time())
    body = ModelList(data=[_card(model, now) for model in http.app[GATEWAY].served()])
    return web.Response(body=_encode(body), content_type="application/json")


async def handle_model(http: web.Request) -> web.Response:
    model = http.app[GATEWAY].model(http.match_info["model"])
    return web.Response(body=_encode(_card(model, int(time.time()))), content_type="application/json")


NOT_SERVED = {
    "/v1/embeddings": "embeddings",
    "/v1/audio/transcriptions": "audio transcription",
    "/v1/audio/speech": "speech",
    "/v1/images/generations": "image generation",
    "/v1/moderations": "moderation",
}
"""OpenAI endpoints a client may try first: each gets a 404 that says why, not a bare "Not Found"."""


async def handle_not_served(http: web.Request) -> web.Response:
    what = NOT_SERVED[http.path]
    raise RouteNotFound(
        f"{http.path} is not served by this gateway: its models are served for chat and completions, not {what}"
    )


async def handle_root(http: web.Request) -> web.Response:
    """What this is and where its APIs are, without a key: a client's reachability probe
    (Claude Code sends `HEAD /`) and a person opening the URL both get a 200."""
    origin = str(http.url.origin())
    body = {"service": "onehop", "openai_base_url": f"{origin}/v1", "anthropic_base_url": origin}
    return web.Response(body=_encode(body), content_type="application/json")


async def handle_health(http: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


def serve(config: GatewayConfig) -> None:
    """`onehop gateway`: the gateway alone, against the engines in its config (one process,
    or one worker of `--workers N`: see `gateway.serving.workers`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    app.on_startup.append(_reload_on_sighup)
    app.on_startup.append(_freeze_start_heap)  # last: after everything start-up builds
    index = worker_index()
    if index is not None:
        app.on_response_prepare.append(_worker_header(str(index)))
    run_app(
        app,
        host=config.host,
        port=worker_port(config.port),
        loop=new_event_loop(),
        reuse_port=index is not None,
        access_log_class=AccessLogger,
    )


def _worker_header(index: str) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    async def name_worker(http: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = index

    return name_worker


async def _freeze_start_heap(app: web.Application) -> None:
    freeze_start_heap()


async def _reload_on_sighup(app: web.Application) -> None:
    def reload() -> None:
        state = app[GATEWAY]
        for watched in (state.policy_file, state.key_file):
            if watched is not None:
                state.spawn(asyncio.to_thread(watched.reload))  # file reads stay off the loop

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
