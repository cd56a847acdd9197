"""The one place that knows the whole flow of an OpenAI request through the gateway.

    read → decode → check → model → admit → render once → choose route and
    engine → one engine request per prompt (prefill first when disaggregated)
    → relay or derender → merge → respond

Each endpoint is an adapter (`gateway.flow.endpoints`) for the steps that differ;
everything else happens here, once: the fan-out of several prompts (bounded,
at the client's pace), aborts for a client that leaves, tracing. Retries
before the first byte live in `EngineClient.open`; each route's answer is made
by its object (`gateway.relay.routes`) and goes out through `gateway.relay.responder`.

The aiohttp request is read only here, at the edge (`serve`): every step after
takes the request's context (`gateway.edge.context`).

A client that leaves cancels the handler: the engine streams are closed by
their `async with`, and an abort goes to every engine that holds one of the
request's generations (in the background, bounded), so nothing keeps
generating.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from msgspec import UNSET

from wire.openai_schema import Usage
from wire.protocol import ABORT_HANDLE_SEPARATOR, EngineSummary
from gateway.upstream import vllm_derender
from gateway.edge.context import QUOTA_KEY, Edge, RequestContext
from gateway.edge.priority import asked, effective
from gateway.upstream.disagg import prefill
from gateway.flow.endpoints import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Answer, Endpoint
from gateway.upstream.engine_request import generate_body
from gateway.upstream.engine_client import Target
from gateway.upstream.engine_stream import EngineAnswer
from gateway.edge.errors import (
    REQUEST_ID_KEY,
    ClientGone,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.edge.quota import Decision
from gateway.edge.quota_check import request_tokens
from gateway.observe.spans import DerenderWork, describe_model, describe_request, measured
from gateway.observe.outcome import Tokens
from gateway.relay.engine import Presenting, encoded
from gateway.relay.responder import Responder
from gateway.relay.routes import EngineRoute, Leg, Open, Parsed, Relayed, Remote, Upstream, VllmForm
from gateway.routing.choose import choose_route
from gateway.flow.session import session_key
from gateway.serving.state import GATEWAY, GatewayState
from gateway.apis.translate import Presented
from gateway.edge.validate import check_buffered_answer, check_context, check_text_size, check_token_ids

T = TypeVar("T")
_encode = msgspec.json.Encoder().encode


async def handle_chat(http: web.Request) -> web.StreamResponse:
    return await serve(http, CHAT)


async def handle_completion(http: web.Request) -> web.StreamResponse:
    return await serve(http, COMPLETIONS)


async def handle_responses(http: web.Request) -> web.StreamResponse:
    return await serve(http, RESPONSES)


async def handle_messages(http: web.Request) -> web.StreamResponse:
    return await serve(http, MESSAGES)


async def serve(http: web.Request, endpoint: Endpoint[Any]) -> web.StreamResponse:
    """The edge: the aiohttp request becomes a context; everything after works on the context."""
    state = http.app[GATEWAY]
    http[REQUEST_ID_KEY] = response_id = f"{endpoint.id_prefix}{uuid.uuid4().hex}"
    edge = Edge.of(http, endpoint.name, response_id, state.config.timeouts.stream_deadline_s)
    edge.tally.request_id = response_id
    body = await read_body(http, state.config.timeouts.client_body_s)
    request = await endpoint.decode(body, edge, state)
    ctx, sampling = checked(state, edge, endpoint, request, body)
    async with state.admitted(ctx.tenant, ctx.priority, ctx.tally):
        prompts, ctx = await prepare(state, ctx, endpoint, request, body, sampling)
        quota = await reserve_quota(state, ctx, endpoint, request, prompts)
        if quota is not None:
            http[QUOTA_KEY] = quota
        exchange = Exchange(http, state, ctx, endpoint, request, endpoint.forwarded(request, body), prompts, sampling)
        return await exchange.guarded()


def checked(
    state: GatewayState, edge: Edge, endpoint: Endpoint[Any], request: Any, body: bytes
) -> tuple[RequestContext, dict[str, Any]]:
    """The checks that cost little, before an admission slot is taken: the request's context
    and its engine sampling parameters."""
    server = edge.span
    describe_model(server, request.model)
    session = session_key(edge.headers, request)
    if session is not None:
        server.set_attribute("session.id", session)
    endpoint.check(request, state.config.limits)
    model = state.model(request.model)
    described = endpoint.describe(request)
    priority = effective(state.config.tenant(edge.tenant or "*"), asked(edge.headers, described.priority))
    ctx = RequestContext.decoded(edge, model, request.model, session, priority)
    sampling = endpoint.sampling(request)
    check_token_ids(sampling, model.vocab.size)
    check_text_size(endpoint.text_chars(request), model.engines.max_model_len(), model.max_chars_per_token)
    if not described.stream:
        check_buffered_answer(
            n=described.n,
            max_tokens=described.max_tokens,
            top_logprobs=described.top_logprobs,
            prompts=described.prompts,
            max_model_len=model.engines.max_model_len(),
            most=state.config.limits.max_buffered_tokens,
        )
    describe_request(
        server, max_tokens=described.max_tokens, temperature=described.temperature, top_p=described.top_p,
        n=described.n, seed=described.seed, stream=described.stream,
    )
    server.set_attribute("gen_ai.response.id", ctx.request_id)
    if state.tracing.record_content and server.is_recording():
        server.set_attribute("gen_ai.input.messages", endpoint.content(body))
        ctx.tally.content = []  # the answer is kept as sent, for `gen_ai.output.messages`
    return ctx, sampling


async def prepare(
    state: GatewayState,
    ctx: RequestContext,
    endpoint: Endpoint[Any],
    request: Any,
    body: bytes,
    sampling: dict[str, Any],
) -> tuple[list[Sequence[int]], RequestContext]:
    """Render once, then route: the prompts and the routed context."""
    model = ctx.model
    with measured(state, "render", ctx.span) as span:
        prompts = await endpoint.render(model, request, body)
        span.set_attribute("onehop.prompt_tokens", sum(len(p) for p in prompts))
    check_context(prompts, model.engines.max_model_len())
    features = endpoint.features(request, ctx, prompts, sampling)
    return prompts, await choose_route(state, ctx, features, prompts[0])


async def reserve_quota(
    state: GatewayState, ctx: RequestContext, endpoint: Endpoint[Any], request: Any, prompts: list[Sequence[int]]
) -> Decision | None:
    """The tenant's quota, once the exact prompt is known and before any engine request: its
    tokens and completion budget reserved (settled from the outcome), or a 429."""
    quotas = state.quotas
    if not quotas.limits(ctx.tenant):
        return None
    described = endpoint.describe(request)
    tokens = request_tokens(prompts, described.n or 1, described.max_tokens, ctx.model.engines.max_model_len())
    prompt = sum(map(len, prompts))
    return await quotas.reserve(ctx.tenant, ctx.request_id, tokens, prompt=prompt, anthropic=endpoint is MESSAGES)


JSON_TYPE = "application/json"


async def read_body(http: web.Request, limit_s: float) -> bytes:
    """The request body, within `limit_s`: a client that trickles it holds a connection
    and a buffer, so it gets a 408 (no admission slot is taken before the body is in)."""
    check_json_type(http)
    declared, most = http.content_length, http.app[GATEWAY].config.max_body_bytes
    if declared is not None and declared > most:  # said in the headers: no need to wait for the body
        error = PayloadTooLarge(f"the request body is {declared} bytes; at most max_body_bytes={most} are accepted")
        error.close_connection = True  # its body is never read
        raise error
    try:
        async with asyncio.timeout(limit_s):
            return await http.read()
    except TimeoutError as exc:
        raise RequestTimeout(f"the request body did not arrive within client_body_s={limit_s} s") from exc


def check_json_type(http: web.Request) -> None:
    """Only `application/json` (UTF-8, the only charset JSON has): a browser sends a form or
    `text/plain` cross-site without asking first, and a JSON API must not read those."""
    charset = http.charset
    if http.content_type != JSON_TYPE or (charset is not None and charset.lower().replace("-", "") != "utf8"):
        sent = http.headers.get("Content-Type", "none")
        raise UnsupportedMediaType(f"the body must be JSON (Content-Type: application/json), not {sent[:100]}")


def open_leg(target: Target, ctx: RequestContext, stream: bool) -> Open:
    """Sends a leg's engine request (its body made by then) to the engine routing chose.

    Not a method of the exchange: the route holds it, and a route holding its exchange is a
    reference cycle, which leaves every request's objects (the aiohttp request, its buffers,
    the answer) to the cyclic collector instead of freeing them when the request ends."""

    @asynccontextmanager
    async def opened(leg: Leg) -> AsyncIterator[EngineAnswer]:
        async with target.engines.open(
            target.choice,
            leg.body,
            stream=stream,
            request_id=leg.request_id,
            parent=ctx.span,
            session=ctx.session,
            facts=target.facts,
        ) as (url, response):
            leg.sent_to = url
            yield response

    return opened


def with_abort_handle(request_id: str) -> str:
    """`request_id#<128 random bits>`: the engine request id only this gateway can abort."""
    return f"{request_id}{ABORT_HANDLE_SEPARATOR}{secrets.token_hex(16)}"


class Exchange:
    """The engine side of one client request, on its route: its legs (one engine request per
    prompt), the route object that turns each leg's answer into the client's, and the shape of
    the answer: one leg as the route makes it, several merged, or presented in another API's shape."""

    def __init__(
        self,
        http: web.Request,
        state: GatewayState,
        ctx: RequestContext,
        endpoint: Endpoint[Any],
        request: Any,
        body: bytes,
        prompts: list[Sequence[int]],
        sampling: dict[str, Any],
    ) -> None:
        target = ctx.routed
        if target.route == "tokens-remote" and len(prompts) > 1:
            raise InvalidRequest("the tokens-remote route serves one prompt per request", param="prompt")
        self.state, self.ctx, self.endpoint, self.request, self.body = state, ctx, endpoint, request, body
        self.target = target
        self.stream = bool(request.stream)
        options = request.stream_options if self.stream else None
        self.client_usage = bool(options and options.include_usage)
        several = len(prompts) > 1
        self.presenter = endpoint.presenter(request, ctx, state)
        self.answer = Answer(
            model=ctx.model,
            model_name=ctx.model_name,
            response_id=ctx.request_id,
            created=int(time.time()),
            # several answers: usage is summed here; a presenter reports it in its own shape
            include_usage=self.client_usage or several or self.presenter is not None,
            continuous_usage=self.client_usage and bool(options and options.continuous_usage_stats),
            keep_answer=not self.stream,
        )
        self.sampling = endpoint.route_sampling(sampling, ctx.model, target.route)
        rid = ctx.request_id
        self.legs = [
            Leg(i, with_abort_handle(rid if not several else f"{rid}-{i}"), prompt, target.endpoint.url)
            for i, prompt in enumerate(prompts)
        ]
        # A stock vLLM ≥ 0.33 takes the derender route in its own form (routing picks it
        # only for a non-streaming chat): parse_context in, GenerateDerenderResponse out.
        self.vllm_form = target.route == "derender" and target.engines.derender_form(target.endpoint.url) == "vllm"
        self.presenting = self._presenting()
        self.route = self._route()
        self.responder = Responder(http, ctx, state.config.timeouts, state.metrics)

    def _presenting(self) -> Presenting | None:
        """On the derender route, the engine assembles another API's answer itself (one leg)."""
        presenter = self.presenter
        if presenter is None or self.target.route != "derender" or self.vllm_form:
            return None
        meta, request = self._presented(self.legs[0]), self.request
        return Presenting(presenter.final_events, lambda final: presenter.relayed(request, meta, final))

    def _route(self) -> EngineRoute:
        route, endpoint, answer, body = self.target.route, self.endpoint, self.answer, self.body
        limits, engines = self.state.config.limits, self.target.engines
        opener = open_leg(self.target, self.ctx, self.stream)
        upstream = Upstream(opener, engines.timeouts, limits.max_answer_bytes, self.ctx.tally)
        if route == "derender" and self.vllm_form:
            chat = endpoint.chat_request(self.request)
            return VllmForm(upstream, answer, bool(chat is not None and chat.return_token_ids))
        if route == "derender":
            return Relayed(upstream, endpoint, self.presenting)
        if route == "tokens-remote":
            return Remote(upstream, endpoint, lambda leg: endpoint.remote_derender(answer, body, leg.prompt))
        work = DerenderWork(self.ctx, self.state, route)
        request = self.request
        return Parsed(
            upstream, route, lambda leg: endpoint.derender(request, answer, leg.prompt, leg.index), work, len(self.legs)
        )

    async def guarded(self) -> web.StreamResponse:
        """The answer; if the client leaves mid-way, every leg's engine requests are aborted too."""
        try:
            return await self.run()
        except asyncio.CancelledError:
            self._abort()
            raise
        except ClientGone as gone:  # it left between two writes, before its cancellation arrived
            self._abort()
            self.ctx.tally.client_gone = True
            self.ctx.span.set_attribute("onehop.client_disconnected", True)
            return gone.response

    def _abort(self) -> None:
        engines = self.ctx.model.engines
        answers = [[self.state.abort(engines, url, leg.request_id) for url in leg.engines()] for leg in self.legs]
        if answers:
            self.ctx.tally.cut = asyncio.ensure_future(_cut_usage(answers))

    async def run(self) -> web.StreamResponse:
        await self._prefill()
        for leg in self.legs:  # each leg's engine request, now that its prefill's KV hand-off is known
            leg.body = self._engine_body(leg)
        try:
            return await (self._respond_stream() if self.stream else self._respond_json())
        finally:
            self.route.finish()

    # ------------------------------------------------------------ engine requests

    def _engine_body(self, leg: Leg) -> bytes:
        return generate_body(
            request_id=leg.request_id,
            model=None,
            prompt_ids=leg.prompt,
            sampling=self.sampling,
            route=self.target.route,
            stream=self.stream,
            include_usage=self.answer.include_usage,
            continuous_usage=self.answer.continuous_usage,
            derender_fields=self._derender_fields(leg),
            kv_transfer_params=leg.kv,
            cache_salt=self.target.facts.cache_salt,
            priority=self.target.facts.priority,
        )

    def _derender_fields(self, leg: Leg) -> dict[str, Any]:
        if self.presenting is not None:
            assert self.presenter is not None
            present = self.presenter.present(self.request, self._presented(leg))
            return {**self.endpoint.engine_fields(self.body, leg.index), "present": present}
        if not self.vllm_form:
            return self.endpoint.engine_fields(self.body, leg.index)
        chat = self.endpoint.chat_request(self.request)
        assert chat is not None  # routing offers vLLM's form to chat requests only
        return {"parse_context": vllm_derender.parse_context(chat)}

    async def _prefill(self) -> None:
        """Disaggregated: every prompt is prefilled (concurrently), then decoded with its KV hand-off."""
        pool = self.ctx.model.prefill
        if pool is None:
            return
        tracer, server, facts = self.state.tracing.tracer, self.ctx.span, self.target.facts
        handovers = await all_of(
            [
                prefill(
                    pool, tracer, replace(facts, prompt=leg.prompt), leg.request_id, server, leg.prefilled_on.append
                )
                for leg in self.legs
            ]
        )
        for leg, kv in zip(self.legs, handovers, strict=True):
            leg.kv = kv

    # ------------------------------------------------------------ the answer's shape

    def _presented(self, leg: Leg) -> Presented:
        answer = self.answer
        return Presented(answer.response_id, answer.model_name, answer.created, len(leg.prompt))

    async def _respond_stream(self) -> web.StreamResponse:
        route, responder, presenter, presenting = self.route, self.responder, self.presenter, self.presenting
        if presenter is not None and presenting is not None:  # the engine wrote the API's events
            frames = route.frames(self.legs[0])
            return await responder.stream(frames, done=False, end=lambda e: presenter.error_frame(e, presenting.events))
        if presenter is not None:  # one prompt, one choice: the API's own events from the chat chunks
            leg = self.legs[0]
            frames = presenter.stream(self.request, self._presented(leg), self._tallied(route.chunks(leg)))
            return await responder.stream(frames, done=False, end=presenter.error_frame)
        if len(self.legs) > 1:
            return await responder.stream(encoded(self._merged(merged([route.chunks(leg) for leg in self.legs]))))
        return await responder.stream(route.frames(self.legs[0]), done=not route.ends_itself)

    async def _respond_json(self) -> web.Response:
        route, tally = self.route, self.ctx.tally
        if self.presenter is not None and self.presenting is None:
            leg = self.legs[0]
            answer = await route.answer(leg)
            tally.record([choice.finish_reason for choice in answer.choices], Tokens.of_usage(answer.usage))
            return Responder.json(_encode(await self.presenter.whole(self.request, self._presented(leg), answer)))
        if len(self.legs) > 1:
            return self._merged_answer(await all_of([route.answer(leg) for leg in self.legs]))
        return Responder.json(await route.body(self.legs[0]))

    async def _tallied(self, chunks: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """`chunks` as they come; their finish reasons and usage recorded for the request's outcome."""
        reasons: dict[int, str] = {}
        async with aclosing(chunks):
            async for chunk in chunks:
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        reasons[choice.index] = choice.finish_reason
                if chunk.usage not in (None, UNSET):
                    self.ctx.tally.record([reasons[i] for i in sorted(reasons)], Tokens.of_usage(chunk.usage))
                yield chunk

    async def _merged(self, chunks: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """Several legs' chunks as one stream: one id, usage summed into one last chunk."""
        rid, created = self.answer.response_id, self.answer.created
        usages: list[Usage] = []
        last_usage: Any = None
        reasons: dict[int, str | None] = {}
        async with aclosing(chunks):
            async for chunk in chunks:
                if not chunk.choices:
                    if chunk.usage not in (None, UNSET):
                        usages.append(chunk.usage)
                        last_usage = chunk
                    continue
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        reasons[choice.index] = choice.finish_reason
                chunk.id, chunk.created = rid, created
                yield chunk
        if usages:
            total = sum_usage(usages)
            self.ctx.tally.record([reasons[i] for i in sorted(reasons)], Tokens.of_usage(total))
            if self.client_usage:
                yield msgspec.structs.replace(last_usage, id=rid, created=created, usage=total)

    def _merged_answer(self, answers: list[Any]) -> web.Response:
        merged_answer = msgspec.structs.replace(
            answers[0],
            id=self.answer.response_id,
            created=self.answer.created,
            choices=[choice for answer in answers for choice in answer.choices],
            usage=sum_usage([answer.usage for answer in answers]),
        )
        reasons = [choice.finish_reason for choice in merged_answer.choices]
        self.ctx.tally.record(reasons, Tokens.of_usage(merged_answer.usage))
        return Responder.json(_encode(merged_answer))


def sum_usage(usages: Sequence[Usage]) -> Usage:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens or 0 for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


_END = object()


async def merged(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """The items of several streams as they come, at the reader's pace: the queue holds at
    most one item per stream, so a stream whose item is unread waits (and so does its
    engine, through TCP). The first failure of any stream ends the whole, and stops the rest."""
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=len(streams))

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put(item)
        except Exception as exc:  # handed to the reader, which raises it in its own task
            await queue.put(_Failed(exc))
            return
        await queue.put(_END)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def all_of(work: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, in order; the first failure cancels the rest and is raised as itself."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            failure = task.exception() if task.done() else None
            if failure is not None:
                raise failure
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _cut_usage(legs: Sequence[Sequence[Awaitable[EngineSummary | None]]]) -> Tokens | None:
    """What the aborted legs used, from their engines' abort answers (for each leg the engine
    holding its generation first, then its prefill engine); None when one leg's is unknown."""
    total = Tokens()
    for answers in legs:
        said = [summary for summary in await asyncio.gather(*answers) if summary is not None]
        if not said:
            return None
        total += Tokens.of_summary(said[0])
    return total
