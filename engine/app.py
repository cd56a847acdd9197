"""The engine's aiohttp application: wiring, lifecycle and the small endpoints.

`create_app(config, backend=...)` takes its collaborators as arguments so tests
run a real server on port 0 with any backend; `run(config)` serves it with
uvloop and handler cancellation (a client that leaves cancels its handler).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from tokenizers import Tokenizer

from engine.backends import make_backend
from engine.backends.base import Backend, PrefixCaching
from engine.backends.vllm_parsers import ParserKind, owners, vllm_parser_names
from engine.config import EngineConfig
from derender.parsers import REASONING_PARSERS, TOOL_PARSERS, UnknownParser, bind_reasoning, check_tool_markers
from derender.parsers.detect import resolve
from derender.vocab import TokenVocab, vocab_for
from engine.errors import error_middleware
from plumbing.http_server import CONNECTION_LIMITS, ConnectionLimits, new_event_loop, run_app
from engine.generate import GENERATE_PATH, constraints, handle_abort, handle_generate
from wire.openai_schema import ModelCard, ModelList
from wire.protocol import encode
from engine.state import ENGINE, EngineState
from plumbing.telemetry import Tracing
from engine.vllm_derender import FORM as VLLM_FORM

log = logging.getLogger(__name__)

ABORT_PATH = "/inference/v1/abort_requests"
LEGACY_ABORT_PATH = "/abort_requests"
CAPABILITIES_PATH = "/inference/v1/capabilities"
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"


class KVEvents(msgspec.Struct, kw_only=True):
    """Where this engine publishes its KV cache events (`wire.kv_events`), for a gateway's
    cache-aware routing: addresses a peer can connect to, the topic to subscribe to, and the
    tokens per block the events' `token_ids` come in."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int


class Capabilities(msgspec.Struct, kw_only=True):
    """What the gateway probes before routing to this engine."""

    backend: str
    model: str
    max_model_len: int
    output_modes: list[str]
    tokenizer: bool
    reasoning_parser: str | None
    tool_parser: str | None
    reasoning_field: str
    parsers: dict[str, str] = {}
    """Each configured parser name → who parses it: `onehop` (natively) or `vllm` (in-process)."""
    parser_choice: str = ""
    """How the parser names were chosen: `configured`, or what `auto` detection saw."""
    structured_outputs: list[str] = []
    """The structured-output kinds it enforces (`json`, `json_object`, `choice`, `regex`, ...)."""
    derender_forms: list[str] = []
    """The `derender` request forms served: `onehop` (`chat_request`/`completion_request`,
    streamed or not) and `vllm` (vLLM 0.33's `parse_context`, non-streaming)."""
    kv_events: KVEvents | None = None
    """Present when the engine publishes KV cache events."""


@functools.lru_cache(maxsize=4)
def load_vocab(model: str) -> TokenVocab:
    """The decode tables of a model folder's tokenizer, loaded once per process.

    `tokenizer.json` is read directly (the engine only decodes); a folder with
    only a slow tokenizer goes through transformers.
    """
    path = Path(model) / "tokenizer.json"
    if path.exists():
        return vocab_for(Tokenizer.from_file(str(path)))
    from transformers import AutoTokenizer

    return vocab_for(AutoTokenizer.from_pretrained(model))


def resolve_parsers(config: EngineConfig) -> tuple[EngineConfig, str]:
    """Settle `auto` from the model folder and check every name: an unknown parser fails
    at start with the known names, never per request. On the vllm backend a name only
    vLLM knows is vLLM's to parse (`engine.backends.vllm_parsers`). Returns the config and how."""
    if config.tokens_only:
        return msgspec.structs.replace(config, reasoning_parser=None, tool_parser=None), "tokens only"
    found = resolve(config.model, config.reasoning_parser, config.tool_parser)
    if found.reasoning is not None:
        _check_parser(found.reasoning, "reasoning", config.backend, found.why)
    if found.tool is not None:
        _check_parser(found.tool, "tool", config.backend, found.why)
    who = owners(found.reasoning, found.tool)
    log.info("engine parsers: reasoning %s, tool %s (%s); parsed by %s", found.reasoning, found.tool, found.why, who)
    return msgspec.structs.replace(config, reasoning_parser=found.reasoning, tool_parser=found.tool), found.why


def _check_parser(name: str, kind: ParserKind, backend: str, why: str) -> None:
    native = REASONING_PARSERS if kind == "reasoning" else TOOL_PARSERS
    if name in native:
        return
    known = ", ".join(sorted(native))
    if backend == "vllm":  # vLLM is there: the backend runs on it
        theirs = vllm_parser_names(kind)
        if name in theirs:
            return
        known += f"; vLLM's: {', '.join(sorted(theirs - native.keys()))}"
    raise UnknownParser(f"unknown {kind} parser {name!r} ({why}); known: {known}")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[ENGINE]
    await state.backend.start()
    if not state.config.tokens_only:
        try:
            state.vocab = await asyncio.to_thread(load_vocab, state.config.model)
            reasoning = state.config.reasoning_parser
            if reasoning in REASONING_PARSERS:  # its markers checked now: a missing one is logged at start
                bind_reasoning(state.vocab, reasoning)
            tools = state.config.tool_parser
            if tools in TOOL_PARSERS:  # a tool family the vocabulary cannot speak stops the start
                try:
                    check_tool_markers(state.vocab, tools)
                except UnknownParser as exc:
                    raise UnknownParser(f"tool parser {tools!r}: {exc}") from exc
            if "vllm" in state.parsers().values():
                _bind_vllm_parsers(state, state.vocab)
        except BaseException:
            await state.backend.close()  # a started vLLM engine core must not outlive a failed start
            raise
    state.ready = True
    yield
    state.ready = False
    await state.backend.close()
    await state.tracing.shutdown()


def _bind_vllm_parsers(state: EngineState, vocab: TokenVocab) -> None:
    """Names only vLLM parses: the vllm backend binds its parsers where `bind_parsers` looks."""
    from engine.backends.vllm import VLLMBackend

    if not isinstance(state.backend, VLLMBackend):
        raise UnknownParser(f"parsers {state.parsers()} need vLLM's, which only the vllm backend has")
    state.backend.bind_parsers(vocab, state.config.reasoning_parser, state.config.tool_parser)
    log.info("engine parsers bound to vLLM's in-process parsers: %s", state.parsers())


def create_app(config: EngineConfig, *, backend: Backend | None = None) -> web.Application:
    config, parser_choice = resolve_parsers(config)
    app = web.Application(middlewares=[error_middleware], client_max_size=config.max_body_bytes)
    app[ENGINE] = EngineState(
        config=config,
        parser_choice=parser_choice,
        backend=backend if backend is not None else make_backend(config),
        tracing=Tracing(config.tracing, "onehop-engine"),
    )
    app[CONNECTION_LIMITS] = ConnectionLimits(keepalive_s=config.keepalive_s, header_s=config.client_header_s)
    backend = app[ENGINE].backend
    if isinstance(backend, PrefixCaching):
        app[ENGINE].metrics.watch_prefix_cache(backend.prefix_cache_stats, lambda: backend.info.model)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post(GENERATE_PATH, handle_generate)
    app.router.add_post(ABORT_PATH, handle_abort)
    app.router.add_post(LEGACY_ABORT_PATH, handle_abort)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get(CAPABILITIES_PATH, handle_capabilities)
    app.router.add_post(RESET_PREFIX_CACHE_PATH, handle_reset_prefix_cache)
    return app


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode(value), status=status, content_type="application/json")


async def handle_health(http: web.Request) -> web.Response:
    state = http.app[ENGINE]
    if not state.ready:
        return _json({"status": "loading"}, status=503)
    return _json({"status": "ok"})


async def handle_models(http: web.Request) -> web.Response:
    info = http.app[ENGINE].backend.info
    return _json(ModelList(data=[ModelCard(id=info.model, root=info.model, max_model_len=info.max_model_len)]))


async def handle_metrics(http: web.Request) -> web.Response:
    body = http.app[ENGINE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def handle_capabilities(http: web.Request) -> web.Response:
    state = http.app[ENGINE]
    has_text = state.vocab is not None
    info = state.backend.info
    return _json(
        Capabilities(
            backend=info.name,
            model=info.model,
            max_model_len=info.max_model_len,
            output_modes=["tokens", "text", "derender"] if has_text else ["tokens"],
            tokenizer=has_text,
            reasoning_parser=state.config.reasoning_parser if has_text else None,
            tool_parser=state.config.tool_parser if has_text else None,
            reasoning_field=state.config.reasoning_field,
            parsers=state.parsers() if has_text else {},
            parser_choice=state.parser_choice,
            structured_outputs=sorted(constraints(state)),
            derender_forms=["onehop", VLLM_FORM] if has_text else [],
            kv_events=_kv_events(state.backend, http.url.host or state.config.host),
        )
    )


def _kv_events(backend: Backend, host: str) -> KVEvents | None:
    """The backend's KV event sockets as `host` (the address this request reached) connects to them."""
    address = backend.kv_events_address() if isinstance(backend, PrefixCaching) else None
    if address is None:
        return None
    replay = address.replay_endpoint
    return KVEvents(
        endpoint=connectable(address.endpoint, host),
        replay_endpoint=connectable(replay, host) if replay is not None else None,
        topic=address.topic,
        block_size=address.block_size,
    )


def connectable(endpoint: str, host: str) -> str:
    """A bound endpoint as another machine connects to it: a wildcard address becomes `host`."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::"):
        if endpoint.startswith(wildcard):
            shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
            return f"tcp://{shown}:{endpoint[len(wildcard):]}"
    return endpoint


async def handle_reset_prefix_cache(http: web.Request) -> web.Response:
    """vLLM's route: drop every cached block (published as `AllBlocksCleared`). A backend
    without a prefix cache has nothing to drop, which succeeds too, as in vLLM."""
    backend = http.app[ENGINE].backend
    if isinstance(backend, PrefixCaching):
        backend.reset_prefix_cache()
    return web.Response(status=200)


def run(config: EngineConfig) -> None:
    """Serve until interrupted (the `onehop engine` command)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_app(create_app(config), host=config.host, port=config.port, loop=new_event_loop())
