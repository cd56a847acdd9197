"""The one place that knows the whole flow of an OpenAI request through the gateway.

    decode (msgspec) → refuse unsupported fields → check the model → render
    once → pick the route → engine request → relay or derender → respond

A client that leaves cancels the handler: the engine stream is closed by its
`async with`, and an abort is sent to the engine as well (in the background,
bounded), so nothing keeps generating.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from aiohttp import web
from opentelemetry import trace

from engine.derender.chat import ChatDerender, ChatOptions, forced_tool_prefix
from engine.derender.parsers import bind_parsers
from engine.openai_schema import (
    CHAT_COMPLETION_REQUEST_DECODER,
    COMPLETION_REQUEST_DECODER,
    ChatCompletionRequest,
    CompletionRequest,
)
from gateway import remote
from gateway.completions import serve_completion
from gateway.config import ROUTES, Route
from gateway.auth import TENANT_KEY
from gateway.disagg import prefill
from gateway.engine_client import EngineClient, Target
from gateway.engine_request import chat_sampling, generate_body
from gateway.errors import EngineUnavailable, InvalidRequest, ModelNotFound
from gateway.observe import SPAN_KEY, describe_request, measured
from gateway.policy import EngineState, NoRoute, RequestFeatures, decide
from gateway.relay import (
    ClientGone,
    derender_json,
    derender_stream,
    relay_json,
    relay_stream,
    remote_error,
    remote_json,
    remote_stream,
)
from gateway.state import GATEWAY, GatewayState
from gateway.validate import check_chat, check_chat_limits, check_completion, check_completion_limits

ROUTE_HEADER = "onehop-route"
GATEWAY_PARSED = frozenset({"text", "tokens"})
"""Routes on which the gateway itself parses reasoning and tool calls."""
"""Request header that picks the route (when the config allows it); the response names the route taken."""
ROUTE_KEY = web.RequestKey("onehop_route", str)
REASON_KEY = web.RequestKey("onehop_policy_reason", str)


def _decode(decoder: msgspec.json.Decoder, body: bytes, what: str) -> object:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid {what} request: {exc}") from exc


async def choose_route(
    state: GatewayState, http: web.Request, features: RequestFeatures, prompt: Sequence[int]
) -> Target:
    """The route and engine for this request, in a `policy` span; the decision goes on the
    server span too. A rule that names a pool moves the request there (and the route is
    decided again against what that pool's engines serve)."""
    with measured(state, "policy", http[SPAN_KEY]) as span:
        engines = state.engines
        endpoint = engines.pick(prompt)
        route, basis, pool = await _decide(state, http, engines, endpoint.url, features)
        if pool is not None:
            engines = state.pools[pool]
            endpoint = engines.pick(prompt)
            route, basis, _ = await _decide(state, http, engines, endpoint.url, features)
        reason = http[REASON_KEY]
        if span.is_recording():
            decision = {"onehop.route": route, "onehop.policy.rule": basis, "onehop.policy.reason": reason}
            if pool is not None:
                decision["onehop.pool"] = pool
            span.set_attributes(decision)
            http[SPAN_KEY].set_attributes({**decision, "onehop.engine.endpoint": endpoint.url})
    state.metrics.policy_decisions.labels(route, basis).inc()
    return Target(route, engines, endpoint)


async def _decide(
    state: GatewayState, http: web.Request, engines: EngineClient, url: str, features: RequestFeatures
) -> tuple[Route, str, str | None]:
    """The override header if allowed, else the policy's decision; with its basis (rule name,
    `cost`, `default` or `header`), a bounded label for metrics, and the rule's pool."""
    available = await engines.routes(url)
    if features.endpoint == "chat" and not state.parses_locally:
        available = available - GATEWAY_PARSED  # a capability fallback: the engine must parse
    wanted = http.headers.get(ROUTE_HEADER)
    if wanted and state.config.route_header:
        if wanted not in ROUTES:
            raise InvalidRequest(f"{ROUTE_HEADER} must be one of {', '.join(ROUTES)}", param=ROUTE_HEADER)
        if wanted not in available:
            raise InvalidRequest(f"route {wanted!r} is not available on this engine", param=ROUTE_HEADER)
        http[ROUTE_KEY], http[REASON_KEY] = wanted, f"{ROUTE_HEADER} header"
        return wanted, "header", None  # type: ignore[return-value]
    load = state.feedback.load(url) if state.feedback is not None else None
    engine = EngineState(routes=available)
    if load is not None:
        engine = EngineState(routes=available, output_cpu_cores=load.output_cpu_cores, in_flight=load.in_flight)
    policy = state.policy
    try:
        decision = decide(policy, features, engine)
    except NoRoute as exc:
        raise EngineUnavailable(str(exc)) from exc
    http[ROUTE_KEY], http[REASON_KEY] = decision.route, decision.reason
    basis = decision.rule if decision.rule is not None else ("cost" if policy.default == "cost" else "default")
    pool = decision.pool if decision.pool is not None and state.pools.get(decision.pool) is not engines else None
    return decision.route, basis, pool


def _text_route_sampling(state: GatewayState, sampling: dict[str, Any]) -> dict[str, Any]:
    """On the text route the gateway finds markers in text: families whose markers are
    special tokens (Kimi, Harmony, DeepSeek) need the engine to keep special tokens' text,
    as vLLM's renderer asks its engine for those parsers."""
    vocab = state.vocab
    parsers = bind_parsers(vocab, state.config.reasoning_parser, state.config.tool_parser) if vocab else None
    if parsers is None or sampling.get("skip_special_tokens") is False or vocab is None:
        return sampling
    if any(token_id in vocab.special_ids for token_id in parsers.atomic_ids):
        return {**sampling, "skip_special_tokens": False}
    return sampling


def chat_features(request: ChatCompletionRequest, prompt_tokens: int, http: web.Request) -> RequestFeatures:
    kwargs = request.chat_template_kwargs or {}
    return RequestFeatures(
        endpoint="chat",
        model=request.model or "",
        stream=bool(request.stream),
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
        n=request.n or 1,
        max_tokens=request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens,
        prompt_tokens=prompt_tokens,
        tools=bool(request.tools),
        reasoning=bool(kwargs.get("enable_thinking", True)),
        headers={k.lower(): v for k, v in http.headers.items()},
        tenant=http.get(TENANT_KEY),
    )


def completion_features(request: CompletionRequest, prompts: list[list[int]], http: web.Request) -> RequestFeatures:
    return RequestFeatures(
        endpoint="completions",
        model=request.model or "",
        stream=bool(request.stream),
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
        n=(request.n or 1) * len(prompts),
        max_tokens=request.max_tokens,
        prompt_tokens=sum(len(p) for p in prompts),
        headers={k.lower(): v for k, v in http.headers.items()},
        tenant=http.get(TENANT_KEY),
    )


def check_model(state: GatewayState, model: str | None) -> None:
    if model is not None and model != state.config.model:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")


async def guard_disconnect(
    state: GatewayState, urls: Callable[[], list[str]], request_id: str, work: Callable[[], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Run `work`; if the client leaves mid-way, abort the engine requests too (on the engines
    `urls()` names: those that answered, after any retries; prefill and decode)."""
    try:
        return await work()
    except asyncio.CancelledError:
        for url in urls():
            state.abort(url, request_id)
        raise
    except ClientGone as gone:  # it left between two writes, before its cancellation arrived
        for url in urls():
            state.abort(url, request_id)
        trace.get_current_span().set_attribute("onehop.client_disconnected", True)  # the server span
        return gone.response


async def handle_chat(http: web.Request) -> web.StreamResponse:
    state = http.app[GATEWAY]
    body = await http.read()
    request = _decode(CHAT_COMPLETION_REQUEST_DECODER, body, "chat completion")
    assert isinstance(request, ChatCompletionRequest)
    check_chat(request)
    check_chat_limits(request, state.config.limits)
    check_model(state, request.model)
    sampling = chat_sampling(request)
    assert state.renderer is not None
    server = http[SPAN_KEY]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = bool(request.stream)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    describe_request(
        server, max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
        n=request.n, seed=request.seed, stream=stream,
    )
    server.set_attribute("gen_ai.response.id", request_id)
    if state.tracing.record_content and server.is_recording():
        server.set_attribute("gen_ai.input.messages", _raw_field(body, _Messages))
    with measured(state, "render", server) as span:
        prompt = await render_chat(state, request, body)
        forced = forced_tool_prefix(request, state.config.tool_parser)
        if forced is not None:
            prompt = prompt + state.renderer.encode(forced)
        span.set_attribute("onehop.prompt_tokens", len(prompt))
    target = await choose_route(state, http, chat_features(request, len(prompt), http), prompt)
    route, engines, endpoint = target.route, target.engines, target.endpoint
    options = request.stream_options
    engines_used = [endpoint.url]

    async def work() -> web.StreamResponse:
        kv = None
        if state.prefill is not None:
            kv = await prefill(state.prefill, state.tracing.tracer, prompt, request_id, server, engines_used.append)
        engine_body = generate_body(
            request_id=request_id,
            model=None,
            prompt_ids=prompt,
            sampling=_text_route_sampling(state, sampling) if route == "text" else sampling,
            route=route,
            stream=stream,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
            chat_request=body,
            kv_transfer_params=kv,
        )
        first = engines.first_event_timeout()
        async with engines.open(endpoint, engine_body, stream=stream, request_id=request_id, parent=server) as (
            engines_used[0],
            engine,
        ):
            if route == "derender":
                response = await (relay_stream(http, engine, first, request_id) if stream else relay_json(http, engine))
            elif route == "tokens-remote":
                remote = _remote_derender(state, body, prompt)
                response = await (remote_stream(http, engine, remote, first, request_id) if stream else remote_json(engine, remote))
            else:
                derender = _chat_derender(state, request, prompt, request_id)
                mode = "tokens" if route == "tokens" else "text"
                response = await (
                    derender_stream(http, engine, derender, mode, first, request_id) if stream else derender_json(http, engine, derender, mode)
                )
        return response

    return await guard_disconnect(state, lambda: engines_used, request_id, work)


async def render_chat(state: GatewayState, request: ChatCompletionRequest, body: bytes) -> list[int]:
    """Local chat template, or vLLM's /render when the config says so."""
    if state.config.render == "local":
        assert state.renderer is not None
        return await state.renderer.chat(request)
    assert state.config.remote_url is not None
    try:
        rendered = await remote.render_chat(state.engines.session, state.config.remote_url, body)
    except remote.RemoteServiceError as exc:
        raise remote_error(exc) from exc
    return rendered.token_ids


def _remote_derender(state: GatewayState, body: bytes, prompt: list[int]) -> remote.RemoteChatDerender:
    if state.config.remote_url is None:
        raise InvalidRequest("the tokens-remote route needs remote_url in the gateway config", param=ROUTE_HEADER)
    return remote.RemoteChatDerender(
        state.engines.session, state.config.remote_url, model=state.config.model, chat_request=body, prompt_token_ids=prompt
    )


def _chat_derender(state: GatewayState, request: ChatCompletionRequest, prompt: list[int], request_id: str) -> ChatDerender:
    # The text options come from the same request fields the engine's sampling params were built from.
    assert state.vocab is not None
    options = ChatOptions.from_request(
        request,
        reasoning_parser=state.config.reasoning_parser,
        tool_parser=state.config.tool_parser,
        reasoning_field=state.config.reasoning_field,
    )
    stream_options = request.stream_options
    include_usage = bool(stream_options and stream_options.include_usage)
    return ChatDerender(
        state.vocab,
        options,
        model=request.model or state.config.model,
        n=request.n or 1,
        prompt_token_ids=prompt,
        response_id=request_id,
        created=int(time.time()),
        include_usage=include_usage,
        continuous_usage=bool(stream_options and stream_options.continuous_usage_stats),
    )


async def handle_completion(http: web.Request) -> web.StreamResponse:
    state = http.app[GATEWAY]
    body = await http.read()
    request = _decode(COMPLETION_REQUEST_DECODER, body, "completion")
    assert isinstance(request, CompletionRequest)
    check_completion(request)
    check_completion_limits(request, state.config.limits)
    check_model(state, request.model)
    assert state.renderer is not None
    server = http[SPAN_KEY]
    describe_request(
        server, max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
        n=request.n, seed=request.seed, stream=bool(request.stream),
    )
    if state.tracing.record_content and server.is_recording():
        server.set_attribute("gen_ai.input.messages", _raw_field(body, _Prompt))
    with measured(state, "render", server) as span:
        prompts = await state.renderer.completion_prompts(request)
        span.set_attribute("onehop.prompt_tokens", sum(len(p) for p in prompts))
    target = await choose_route(state, http, completion_features(request, prompts, http), prompts[0])
    return await serve_completion(http, state, request, body, prompts, target)



class _Messages(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"[]")


class _Prompt(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.Raw(b'""')


def _raw_field(body: bytes, kind: type[_Messages] | type[_Prompt]) -> str:
    """The request's messages or prompt as sent, for `record_content` only."""
    value = msgspec.json.decode(body, type=kind)
    raw = value.messages if isinstance(value, _Messages) else value.prompt
    return bytes(raw).decode("utf-8", "replace")
