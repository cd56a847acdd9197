"""The one place that knows the whole flow of an OpenAI request through the gateway.

    read → decode → check → model → admit → render once → choose route and
    engine → one engine request per prompt (prefill first when disaggregated)
    → relay or derender → merge → respond

Each endpoint is an adapter (`gateway.endpoints`) for the steps that differ;
everything else happens here, once: the fan-out of several prompts (bounded,
at the client's pace), aborts for a client that leaves, tracing. Retries
before the first byte live in `EngineClient.open`; answers go out through
`gateway.relay`'s responder.

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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from msgspec import UNSET

from engine.openai_schema import Usage
from engine.protocol import ABORT_HANDLE_SEPARATOR
from gateway import vllm_derender
from gateway.disagg import prefill
from gateway.endpoints import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Answer, Endpoint
from gateway.engine_client import Target
from gateway.engine_request import generate_body
from gateway.engine_stream import EngineAnswer
from gateway.errors import (
    REQUEST_ID_KEY,
    ClientGone,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.observe import (
    GONE_KEY,
    MODEL_KEY,
    SPAN_KEY,
    DerenderWork,
    describe_model,
    describe_request,
    measured,
    tally,
)
from gateway.outcome import Tokens
from gateway.relay import (
    derender_answer,
    derendered,
    derendered_stream,
    encoded,
    read_answer,
    relay_json,
    relay_stream,
    relayed_answer,
    relayed_chunks,
    remote_chunks,
    remote_json,
    remote_stream,
    remote_whole,
    respond_stream,
)
from gateway.routing import choose_route
from gateway.session import session_key
from gateway.runtime import ModelRuntime
from gateway.state import GATEWAY, GatewayState
from gateway.translate import Presented
from gateway.validate import check_buffered_answer, check_context, check_text_size, check_token_ids

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
    state = http.app[GATEWAY]
    http[REQUEST_ID_KEY] = response_id = f"{endpoint.id_prefix}{uuid.uuid4().hex}"
    body = await read_body(http, state.config.timeouts.client_body_s)
    request = endpoint.decode(body, http)
    server = http[SPAN_KEY]
    describe_model(server, endpoint.name, request.model)
    session = session_key(http, request)
    if session is not None:
        server.set_attribute("session.id", session)
    endpoint.check(request, state.config.limits)
    sampling = endpoint.sampling(request)
    model = state.model(request.model)
    check_token_ids(sampling, model.vocab.size)
    check_text_size(endpoint.text_chars(request), model.engines.max_model_len(), model.max_chars_per_token)
    http[MODEL_KEY] = model.name
    described = endpoint.describe(request)
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
    server.set_attribute("gen_ai.response.id", response_id)
    if state.tracing.record_content and server.is_recording():
        server.set_attribute("gen_ai.input.messages", endpoint.content(body))
    async with state.admitted():
        with measured(state, "render", server) as span:
            prompts = await endpoint.render(model, request, body)
            span.set_attribute("onehop.prompt_tokens", sum(len(p) for p in prompts))
        check_context(prompts, model.engines.max_model_len())
        features = endpoint.features(request, model.name, prompts, http, sampling)
        target = await choose_route(state, model, http, features, prompts[0])
        forwarded = endpoint.forwarded(request, body)
        exchange = Exchange(
            http, state, model, endpoint, request, forwarded, prompts, sampling, target, response_id, session
        )
        return await guard_disconnect(http, state, model, exchange.legs, exchange.run)


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


def with_abort_handle(request_id: str) -> str:
    """`request_id#<128 random bits>`: the engine request id only this gateway can abort."""
    return f"{request_id}{ABORT_HANDLE_SEPARATOR}{secrets.token_hex(16)}"


@dataclass
class Leg:
    """One engine request: one prompt's generation (all its `n` choices)."""

    index: int
    request_id: str
    """The engine request's id: the answer's id, then `#` and an abort handle drawn here
    (`engine.protocol.ABORT_HANDLE_SEPARATOR`): only the whole id aborts it, and the gateway
    logs only the answer's id, so whoever reads the logs or the answer cannot."""
    prompt: list[int]
    sent_to: str
    """The engine that holds the generation (after any retries): aborts go there."""
    prefilled_on: list[str] = field(default_factory=list)
    """The prefill engine, when disaggregated: aborts go there too."""
    kv: dict[str, Any] | None = None

    def engines(self) -> list[str]:
        return [self.sent_to, *self.prefilled_on]


async def guard_disconnect(
    http: web.Request,
    state: GatewayState,
    model: ModelRuntime,
    legs: Sequence[Leg],
    work: Callable[[], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Run `work`; if the client leaves mid-way, abort every leg's engine requests too."""
    try:
        return await work()
    except asyncio.CancelledError:
        _abort(state, model, legs)
        raise
    except ClientGone as gone:  # it left between two writes, before its cancellation arrived
        _abort(state, model, legs)
        http[GONE_KEY] = True
        http[SPAN_KEY].set_attribute("onehop.client_disconnected", True)
        return gone.response


def _abort(state: GatewayState, model: ModelRuntime, legs: Sequence[Leg]) -> None:
    for leg in legs:
        for url in leg.engines():
            state.abort(model.engines, url, leg.request_id)


class Exchange:
    """The engine side of one client request, on the route the policy chose."""

    def __init__(
        self,
        http: web.Request,
        state: GatewayState,
        model: ModelRuntime,
        endpoint: Endpoint[Any],
        request: Any,
        body: bytes,
        prompts: list[list[int]],
        sampling: dict[str, Any],
        target: Target,
        response_id: str,
        session: str | None = None,
    ) -> None:
        self.http = http
        self.session = session
        self.state = state
        self.endpoint = endpoint
        self.request = request
        self.body = body
        self.target = target
        self.route = target.route
        self.stream = bool(request.stream)
        options = request.stream_options if self.stream else None
        self.client_usage = bool(options and options.include_usage)
        continuous = self.client_usage and bool(options and options.continuous_usage_stats)
        several = len(prompts) > 1
        self.presenter = endpoint.presenter(http, request)
        self.answer = Answer(
            model=model,
            model_name=request.model or model.name,
            response_id=response_id,
            created=int(time.time()),
            # several answers: usage is summed here; a presenter reports it in its own shape
            include_usage=self.client_usage or several or self.presenter is not None,
            continuous_usage=continuous,
            keep_answer=not self.stream,
        )
        self.sampling = endpoint.route_sampling(sampling, model, target.route)
        self.legs = [
            Leg(i, with_abort_handle(response_id if not several else f"{response_id}-{i}"), prompt, target.endpoint.url)
            for i, prompt in enumerate(prompts)
        ]
        self.mode = "tokens" if target.route in ("tokens", "tokens-remote") else "text"
        # A stock vLLM ≥ 0.33 takes the derender route in its own form (routing picks it
        # only for a non-streaming chat): parse_context in, GenerateDerenderResponse out.
        self.vllm_form = target.route == "derender" and target.engines.derender_form(target.endpoint.url) == "vllm"
        self.work = DerenderWork(http, self.route) if target.route in ("text", "tokens") else None
        self._derender: Any = None
        if self.route == "tokens-remote" and several:
            raise InvalidRequest("the tokens-remote route serves one prompt per request", param="prompt")

    # ------------------------------------------------------------ engine requests

    def _engine_body(self, leg: Leg) -> bytes:
        return generate_body(
            request_id=leg.request_id,
            model=None,
            prompt_ids=leg.prompt,
            sampling=self.sampling,
            route=self.route,
            stream=self.stream,
            include_usage=self.answer.include_usage,
            continuous_usage=self.answer.continuous_usage,
            derender_fields=self._derender_fields(leg),
            kv_transfer_params=leg.kv,
        )

    def _derender_fields(self, leg: Leg) -> dict[str, Any]:
        if not self.vllm_form:
            return self.endpoint.engine_fields(self.body, leg.index)
        chat = self.endpoint.chat_request(self.request)
        assert chat is not None  # routing offers vLLM's form to chat requests only
        return {"parse_context": vllm_derender.parse_context(chat)}

    def _from_vllm(self, raw: bytes) -> Any:
        """vLLM's derender answer as the client's ChatCompletion (its outcome on the server span)."""
        answer, chat = self.answer, self.endpoint.chat_request(self.request)
        completion = vllm_derender.chat_completion(
            raw,
            response_id=answer.response_id,
            model=answer.model_name,
            created=answer.created,
            reasoning_field=answer.model.reasoning_field,
            return_token_ids=bool(chat is not None and chat.return_token_ids),
        )
        reasons = [choice.finish_reason for choice in completion.choices]
        tally(self.http).record(reasons, Tokens.of_usage(completion.usage))
        return completion

    @asynccontextmanager
    async def _open(self, leg: Leg) -> AsyncIterator[EngineAnswer]:
        engines, server = self.target.engines, self.http[SPAN_KEY]
        body = self._engine_body(leg)
        async with engines.open(
            self.target.endpoint,
            body,
            stream=self.stream,
            request_id=leg.request_id,
            parent=server,
            session=self.session,
        ) as (url, response):
            leg.sent_to = url
            yield response

    async def _prefill(self) -> None:
        """Disaggregated: every prompt is prefilled (concurrently), then decoded with its KV hand-off."""
        pool = self.answer.model.prefill
        if pool is None:
            return
        tracer, server = self.state.tracing.tracer, self.http[SPAN_KEY]
        handovers = await all_of(
            [prefill(pool, tracer, leg.prompt, leg.request_id, server, leg.prefilled_on.append) for leg in self.legs]
        )
        for leg, kv in zip(self.legs, handovers, strict=True):
            leg.kv = kv

    async def run(self) -> web.StreamResponse:
        await self._prefill()
        try:
            return await (self._respond_stream() if self.stream else self._respond_json())
        finally:
            if self.work is not None:
                self.work.finish(self._derender if len(self.legs) == 1 else None)

    # ------------------------------------------------------------ one engine request

    def _new_derender(self, leg: Leg) -> Any:
        derender = self.endpoint.derender(self.request, self.answer, leg.prompt, leg.index)
        if len(self.legs) == 1:
            self._derender = derender  # describes the outcome on the server span
        return derender

    def _presented(self, leg: Leg) -> Presented:
        answer = self.answer
        return Presented(answer.response_id, answer.model_name, answer.created, len(leg.prompt))

    async def _respond_stream(self) -> web.StreamResponse:
        http, first, rid = self.http, self.target.engines.timeouts, self.answer.response_id
        if self.presenter is not None:  # one prompt, one choice: the API's own events from the chat chunks
            leg = self.legs[0]
            frames = self.presenter.stream(self.request, self._presented(leg), self._tallied(self._chunks(leg)))
            return await respond_stream(http, self.route, rid, frames, done=False, end=self.presenter.error_frame)
        if len(self.legs) > 1:
            frames = encoded(self._merged(merged([self._chunks(leg) for leg in self.legs])))
            return await respond_stream(http, self.route, rid, frames)
        leg = self.legs[0]
        async with self._open(leg) as engine:
            if self.route == "derender":
                return await relay_stream(http, engine, first, rid)
            if self.route == "tokens-remote":
                remote = self.endpoint.remote_derender(self.answer, self.body, leg.prompt)
                return await remote_stream(http, engine, remote, first, rid)
            assert self.work is not None
            derender = self._new_derender(leg)
            return await derendered_stream(http, self.route, engine, derender, self.mode, first, self.work, rid)

    async def _respond_json(self) -> web.Response:
        if self.presenter is not None:
            leg = self.legs[0]
            answer = await self._answer(leg)
            tally(self.http).record([choice.finish_reason for choice in answer.choices], Tokens.of_usage(answer.usage))
            whole = self.presenter.whole(self.request, self._presented(leg), answer)
            return web.Response(body=_encode(whole), content_type="application/json")
        if len(self.legs) > 1:
            return self._merged_answer(await all_of([self._answer(leg) for leg in self.legs]))
        leg = self.legs[0]
        async with self._open(leg) as engine:
            if self.vllm_form:
                raw = await read_answer(engine, self.state.config.limits.max_answer_bytes)
                return web.Response(body=_encode(self._from_vllm(raw)), content_type="application/json")
            if self.route == "derender":
                return await relay_json(self.http, engine)
            if self.route == "tokens-remote":
                remote = self.endpoint.remote_derender(self.answer, self.body, leg.prompt)
                return await remote_json(engine, remote, self.state.config.limits.max_answer_bytes)
            raw = await read_answer(engine, self.state.config.limits.max_answer_bytes)
        assert self.work is not None
        body = _encode(derender_answer(raw, self._new_derender(leg), self.mode, self.work))
        return web.Response(body=body, content_type="application/json")

    # ------------------------------------------------------------ several engine requests

    async def _chunks(self, leg: Leg) -> AsyncGenerator[Any, None]:
        """One leg's OpenAI chunk objects (its usage chunk included), for merging or presenting."""
        first = self.target.engines.timeouts
        async with self._open(leg) as engine:
            if self.route == "derender":
                chunks = relayed_chunks(engine, first, self.endpoint.chunk_decoder)
            elif self.route == "tokens-remote":
                remote = self.endpoint.remote_derender(self.answer, self.body, leg.prompt)
                chunks = remote_chunks(engine, remote, first, self.endpoint.chunk_decoder)
            else:
                assert self.work is not None
                chunks = derendered(engine, self._new_derender(leg), self.mode, first, self.work)
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield chunk

    async def _tallied(self, chunks: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """`chunks` as they come; their finish reasons and usage recorded for the request's outcome."""
        reasons: dict[int, str] = {}
        async with aclosing(chunks):
            async for chunk in chunks:
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        reasons[choice.index] = choice.finish_reason
                if chunk.usage not in (None, UNSET):
                    tally(self.http).record([reasons[i] for i in sorted(reasons)], Tokens.of_usage(chunk.usage))
                yield chunk

    async def _answer(self, leg: Leg) -> Any:
        async with self._open(leg) as engine:
            raw = await read_answer(engine, self.state.config.limits.max_answer_bytes)
        if self.vllm_form:
            return self._from_vllm(raw)
        if self.route == "derender":
            return relayed_answer(raw, self.endpoint.answer_decoder)
        if self.route == "tokens-remote":
            remote = self.endpoint.remote_derender(self.answer, self.body, leg.prompt)
            return relayed_answer(await remote_whole(raw, remote), self.endpoint.answer_decoder)
        assert self.work is not None
        return derender_answer(raw, self._new_derender(leg), self.mode, self.work)

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
            tally(self.http).record([reasons[i] for i in sorted(reasons)], Tokens.of_usage(total))
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
        tally(self.http).record(reasons, Tokens.of_usage(merged_answer.usage))
        return web.Response(body=_encode(merged_answer), content_type="application/json")


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
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
