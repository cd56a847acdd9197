"""Talking to engines: one shared `ClientSession`, explicit timeouts, aborts.

`generate()` opens a request and hands back the response once the engine has
answered (status and headers). Streams: the first event must come within
`first_token_s` (`first_event`), then each read within `idle_s`. Non-streaming
requests are bounded as a whole by `request_s`. A non-200 answer is turned
into the matching gateway error with the engine's own message.

What an engine serves is probed once: a onehop engine lists its output modes
(`/inference/v1/capabilities`); stock vLLM has no such document (404) and
serves text and tokens, plus its own non-streaming derender form from 0.33 on
(its `/version` tells). A stock vLLM without `--enable-scale-out` answers 403
on the generate API: it is healthy (its circuit stays as it is) but serves no
route, so it is not picked again until `ROUTES_OFF_RECHECK_S` have passed.

What it learns (capabilities, health, its own outstanding requests) it writes to the
pool's datastore (`gateway.routing.datastore`); which engine serves a request is the
picker's (`gateway.routing.picker`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import aiohttp
import msgspec
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from yarl import URL

from wire.protocol import CONSTRAINT_KINDS, EngineSummary, ProtocolError, decode_abort_answer, public_request_id
from plumbing.telemetry import Tracing, inject, record_error
from gateway.flow.session import SESSION_HEADER
from gateway.upstream.kv_events import KVSubscriber
from gateway.config import ConfigError, EngineEndpoint, Health, Route, Timeouts
from gateway.upstream.engine_stream import EngineAnswer, StreamPool
from gateway.edge.errors import (
    ClientGone,
    EngineDied,
    EngineFailed,
    EngineTimeout,
    EngineRoutesOff,
    EngineUnavailable,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    Unprocessable,
    with_context_code,
)
from gateway.routing.datastore import ROUTES_OFF_RECHECK_S, Breaker, Endpoint, EndpointStore
from gateway.routing.picker import NO_FACTS, Choice, Picker, RequestFacts
from gateway.upstream.vllm_derender import serves_derender

log = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
CAPABILITIES_PATH = "/inference/v1/capabilities"
VERSION_PATH = "/version"
PROBE_TIMEOUT_S = 5.0
ABORT_PATH = "/inference/v1/abort_requests"
ABORT_TIMEOUT_S = 5.0
# Below uvicorn's default keep-alive (5 s, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and aiohttp servers' (75 s).
KEEPALIVE_S = 4.0


class _ErrorView(msgspec.Struct):
    message: str = ""


class _ErrorBody(msgspec.Struct):
    error: _ErrorView | str | None = None
    detail: str | None = None  # FastAPI's shape, from stock vLLM


_ERROR_DECODER = msgspec.json.Decoder(_ErrorBody)
_STATUS_ERRORS: dict[int, type[GatewayError]] = {
    400: InvalidRequest,
    404: ModelNotFound,
    413: PayloadTooLarge,
    422: Unprocessable,
}


def engine_error(status: int, body: bytes, retry_after: str | None = None) -> GatewayError:
    """The gateway error for an engine's non-200 answer, keeping its message (and a 429's
    `Retry-After`: the engine is busy, which the client should hear as such, not as a 502)."""
    try:
        parsed = _ERROR_DECODER.decode(body)
        error = parsed.error
        message = error.message if isinstance(error, _ErrorView) else (error or parsed.detail or "")
    except msgspec.DecodeError:
        message = body[:500].decode("utf-8", "replace")
    message = _first_line(message)
    if status == 403:  # stock vLLM with its scale-out endpoints off, in its own words
        return EngineRoutesOff(f"the engine does not serve the generate API (403): {message}")
    if status == 429:
        busy = RateLimited(f"the engine is at capacity: {message or 'retry later'}")
        if retry_after is not None and retry_after.strip().isdigit():
            busy.headers = {"Retry-After": retry_after.strip()}
        return busy
    kind = _STATUS_ERRORS.get(status)
    if kind is not None:
        return with_context_code(
            kind(message or f"the engine refused the request ({status})", status=status if status != 422 else None)
        )
    return EngineFailed(f"the engine failed ({status}): {message}")


ENGINE_MESSAGE_CHARS = 500
"""An engine's error message as the gateway passes it on and logs it: its first line, cut to
this length (a backend's 77-line Rust backtrace once reached clients: issue #27)."""


def _first_line(message: str) -> str:
    """The first line of an engine's message; what was cut is named by a hash and size, to
    find in the engine's own log, not repeated here."""
    text = message.strip()
    first = text.split("\n", 1)[0][:ENGINE_MESSAGE_CHARS]
    if first == text:
        return first
    tag = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{first} (engine detail {tag}: {len(text)} characters cut)"


class _KVEvents(msgspec.Struct):
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int = 0


class _Capabilities(msgspec.Struct):
    output_modes: list[str] = []
    structured_outputs: list[str] = []
    model: str | None = None
    max_model_len: int | None = None
    tokenizer: bool = False
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    kv_events: _KVEvents | None = None
    """Where a onehop engine publishes its KV cache events (its `--kv-events-config`)."""


_CAPABILITIES = msgspec.json.Decoder(_Capabilities)


class _Version(msgspec.Struct):
    version: str = ""


_VERSION = msgspec.json.Decoder(_Version)


class EngineMismatch(EngineUnavailable):
    """The engine serves another model, or parses with other parsers, than the gateway expects of it."""


@dataclass(frozen=True)
class Expected:
    """What every engine of a pool must serve, as its capabilities tell (onehop engines;
    stock vLLM has no capabilities document and is taken as configured)."""

    model: str
    names: frozenset[str]
    """Served names the engine may report (the model's name and aliases)."""
    reasoning_parser: str | None
    tool_parser: str | None
    parsers: bool = True
    """Compare the parsers too (not for a tokens-only prefill pool: it parses nothing)."""

    def mismatch(self, url: str, caps: _Capabilities) -> str | None:
        """Why the engine at `url` does not serve what is expected; None when it does."""
        if caps.model is not None and caps.model not in self.names:
            return (
                f"the engine at {url} serves model {caps.model!r}, but this pool is configured for model {self.model!r}"
            )
        if not (self.parsers and caps.tokenizer):
            return None
        engine = (caps.reasoning_parser, caps.tool_parser)
        gateway = (self.reasoning_parser, self.tool_parser)
        if engine != gateway:
            return (
                f"the engine at {url} parses model {self.model!r} with reasoning parser {engine[0]!r} and tool parser "
                f"{engine[1]!r}, but the gateway's config for it says {gateway[0]!r} and {gateway[1]!r}"
            )
        return None


class EngineClient:
    def __init__(
        self,
        store: EndpointStore,
        picker: Picker,
        timeouts: Timeouts,
        health: Health,
        *,
        remote: bool = False,
        expected: Expected | None = None,
        tracing: Tracing | None = None,
        on_retry: Callable[[str], None] = lambda url: None,
        subscribers: Sequence[KVSubscriber] = (),
        subscribe: Callable[[EngineEndpoint], KVSubscriber] | None = None,
    ) -> None:
        self.store = store
        self.picker = picker
        self.kv_subscribers = {subscriber.engine: subscriber for subscriber in subscribers}
        """Keep the pool's KV index current with its engines' KV events (`kv_cache` balancing):
        those configured, and those a onehop engine's capabilities name (with `subscribe`)."""
        self._subscribe = subscribe
        self.expected = expected
        self._max_model_len: int | None = None
        self._tracer = tracing.tracer if tracing is not None else trace.NoOpTracer()
        self._remote = remote
        self._timeouts = timeouts
        self._health = health
        self._on_retry = on_retry
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeouts = self._timeouts
        # No sock_read: it would also cut a first event that takes longer than idle_s; the
        # relay times each read itself (first_token_s, then idle_s).
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s)
        self._json_timeout = aiohttp.ClientTimeout(total=timeouts.request_s, connect=timeouts.connect_s)
        # Idle connections are dropped before the server drops them (vLLM's uvicorn
        # closes them after 5 s): reusing one the server is closing fails the request
        # before it is sent, most often when the gateway's loop is busy.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        # Everything else on the session (vLLM's render/derender services, probes) keeps a read bound.
        default = aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=timeouts.idle_s)
        self._session = aiohttp.ClientSession(timeout=default, connector=connector)
        self._streams = StreamPool(timeouts.connect_s, KEEPALIVE_S)
        for subscriber in self.kv_subscribers.values():
            subscriber.start()

    async def close(self) -> None:
        for subscriber in self.kv_subscribers.values():
            await subscriber.close()
        self.kv_subscribers.clear()
        if self._session is not None:
            await self._session.close()
            self._streams.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "EngineClient.start() was not awaited"
        return self._session

    def pick(self, facts: RequestFacts = NO_FACTS) -> Choice:
        """The engine for a request, by the picker, over the datastore as it is now."""
        return self.picker.pick(self.store, facts, time.monotonic())

    async def pick_serving(self, facts: RequestFacts) -> tuple[Choice, frozenset[str]]:
        """An engine, and the routes it serves. One whose capabilities cannot be read (it
        never answered since the gateway started) counts as a failure, and another is
        picked, as a request that fails before its answer is retried elsewhere. With a
        constraint (a structured-output kind), an engine found not to enforce it when first
        probed is passed over (not a failure), and with none left a 400 says so."""
        choice = self.pick(facts)
        failures = 0
        while True:
            endpoint = choice.endpoint
            try:
                routes = await self.routes(endpoint.url)
            except EngineUnavailable as exc:
                self.store.failed(endpoint, time.monotonic())
                failures += 1
                facts = replace(facts, tried=facts.tried | {endpoint.url})
                if failures > self._health.retries:
                    raise
                other = self._another(facts)
                if other is None:
                    raise
                log.warning("engine %s cannot be probed (%s); picking %s", endpoint.url, exc, other.endpoint.url)
                self._on_retry(endpoint.url)
                choice = other
                continue
            if routes and (facts.constraint is None or facts.constraint in endpoint.constraints):
                return choice, routes
            # Its generate API is off (a 403), or it lacks the constraint: not a failure, just
            # not this one; the picker's filters now know it, and say why when none is left.
            facts = replace(facts, tried=facts.tried | {endpoint.url})
            choice = self._next(facts, endpoint)

    def _next(self, facts: RequestFacts, refused: Endpoint) -> Choice:
        """The next engine after one that serves no route or lacks the constraint; when none
        is left, the picker's reason, asked with that engine back in (its filters drop it
        for what it is: routes off, or the constraint)."""
        try:
            return self.pick(facts)
        except (EngineUnavailable, InvalidRequest):
            self.pick(replace(facts, tried=facts.tried - {refused.url}))  # raises, naming why
            raise

    def _another(self, facts: RequestFacts) -> Choice | None:
        """An engine not tried yet, if any (with none left the last failure is the answer,
        naming its cause, rather than "every circuit is open")."""
        try:
            return self.pick(facts)
        except (EngineUnavailable, InvalidRequest):
            return None

    @asynccontextmanager
    async def open(
        self,
        first: Choice,
        body: bytes,
        *,
        stream: bool,
        request_id: str,
        parent: Span | None = None,
        session: str | None = None,
        facts: RequestFacts = NO_FACTS,
    ) -> AsyncIterator[tuple[str, EngineAnswer]]:
        """`generate` on `first`, or on other engines of the pool if it fails before answering.

        Nothing has reached the client yet when an engine refuses the connection,
        times out before its headers or answers 5xx, so the request is retried
        elsewhere (up to `health.retries` times); each failure counts against
        that engine's circuit. A 429 (the engine is busy) is tried elsewhere too but is
        not a failure: with no other engine, the client gets the 429. Any other 4xx is
        the client's and is not retried. Another engine is picked for `facts`, less the
        engines tried.
        Yields the URL that answered (aborts go there) and its response.
        """
        tried: set[str] = set()
        choice = first
        while True:
            answered = False
            current = choice.endpoint
            prefill = choice.prefill_tokens
            current.outstanding += 1
            current.prefill_tokens += prefill
            current.breaker.started()
            try:
                async with self.generate(
                    current.url, body, stream=stream, request_id=request_id, parent=parent, session=session
                ) as response:
                    self.store.succeeded(current)
                    answered = True
                    yield current.url, response
                return
            except EngineRoutesOff as exc:
                if answered:
                    raise
                # It answered: healthy, so its circuit is left closed; it serves nothing of ours.
                self.store.succeeded(current)
                self._turned_off(current, exc)
                tried.add(current.url)
                other = self._another(replace(facts, tried=frozenset(tried)))
                if other is None:
                    raise
                choice = other
                self._on_retry(current.url)
            except RateLimited:
                if answered:
                    raise
                self.store.succeeded(current)  # it answered: busy, not broken
                tried.add(current.url)
                other = None
                if len(tried) <= self._health.retries:
                    other = self._another(replace(facts, tried=frozenset(tried)))
                if other is None:
                    raise
                choice = other
                self._on_retry(current.url)
            except EngineDied as exc:
                # The request may be what killed it: it is not replayed on another engine.
                self.store.failed(current, time.monotonic())
                log.warning(
                    "engine %s failed while serving request %s (%s); not retried",
                    current.url,
                    public_request_id(request_id),
                    exc,
                )
                raise
            except (EngineUnavailable, EngineFailed) as exc:
                if answered:
                    raise  # it failed after answering: not a reason to try another engine
                self.store.failed(current, time.monotonic())
                tried.add(current.url)
                if len(tried) > self._health.retries:
                    raise
                other = self._another(replace(facts, tried=frozenset(tried)))
                if other is None:
                    raise
                choice = other
                log.warning(
                    "engine %s failed before answering (%s); retrying on %s", current.url, exc, other.endpoint.url
                )
                self._on_retry(current.url)
            finally:
                current.outstanding -= 1
                current.prefill_tokens -= prefill

    @asynccontextmanager
    async def generate(
        self,
        url: str,
        body: bytes,
        *,
        stream: bool,
        request_id: str,
        parent: Span | None = None,
        session: str | None = None,
    ) -> AsyncIterator[EngineAnswer]:
        """One engine request, inside an `engine.generate` client span (a child of `parent`)
        whose context travels as `traceparent`; the span ends when the caller is done reading.
        `session`: the client's conversation (`gateway.flow.session`), sent as vLLM's `X-Session-ID`."""
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = self._tracer.start_span("engine.generate", context=context, kind=SpanKind.CLIENT)
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers[SESSION_HEADER] = session
        if span.is_recording():
            target = URL(url)
            span.set_attributes(
                {
                    "http.request.method": "POST",
                    "url.full": url + GENERATE_PATH,
                    "server.address": target.host or "",
                    "server.port": target.port or 80,
                    "onehop.request_id": public_request_id(request_id),
                    "onehop.stream": stream,
                }
            )
            inject(headers, span)
        limit = self._timeouts.first_token_s if stream else self._timeouts.request_s
        try:
            try:
                async with asyncio.timeout(limit):
                    if stream and StreamPool.serves(url):  # read in the socket's callbacks (engine_stream)
                        response: EngineAnswer = await self._streams.post(url + GENERATE_PATH, body, headers)
                    else:
                        response = await self.session.post(
                            url + GENERATE_PATH,
                            data=body,
                            headers=headers,
                            timeout=self._stream_timeout if stream else self._json_timeout,
                        )
            except aiohttp.ConnectionTimeoutError as exc:  # a TimeoutError too: caught first
                raise EngineUnavailable(f"cannot connect to the engine within {self._timeouts.connect_s} s") from exc
            except TimeoutError as exc:
                raise EngineTimeout(f"the engine did not answer within {limit} s") from exc
            except aiohttp.ClientConnectorError as exc:
                raise EngineUnavailable(f"cannot reach the engine: {exc}") from exc
            except aiohttp.ClientError as exc:  # sent, then the connection closed or broke
                raise EngineDied(
                    f"the engine failed while serving this request ({exc or type(exc).__name__});"
                    " it is not retried on another engine"
                ) from exc
            span.set_attribute("http.response.status_code", response.status)
            try:
                if response.status != 200:
                    # "retry-after" lower-case: either kind of headers finds it.
                    raise engine_error(response.status, await response.read(), response.headers.get("retry-after"))
                yield response
            finally:
                response.release()
                response.close()
        except (asyncio.CancelledError, ClientGone):
            span.set_attribute("onehop.client_disconnected", True)
            raise
        except Exception as exc:
            record_error(span, exc)
            raise
        finally:
            span.end()

    @property
    def timeouts(self) -> Timeouts:
        return self._timeouts

    async def routes(self, url: str) -> frozenset[str]:
        """Routes this engine can serve, probed once: a onehop engine lists its output modes;
        a stock vLLM server (no capabilities endpoint) serves text and tokens, and from 0.33 on
        derender in its own form (`derender_form`). None while its generate API is off."""
        endpoint = self._endpoint(url)
        if endpoint.off_at is not None:
            if endpoint.off(time.monotonic()):
                return frozenset()
            endpoint.off_at = None
            endpoint.routes = None  # probed again: it may have been restarted
        if endpoint.routes is not None:
            return endpoint.routes
        modes, constraints, vllm_form = await self._probe(url)
        routes = (
            {"tokens"} | ({"text"} if "text" in modes else set()) | ({"derender"} if "derender" in modes else set())
        )
        if self._remote:
            routes.add("tokens-remote")
        endpoint.constraints, endpoint.vllm_derender = constraints, vllm_form
        endpoint.routes = frozenset(routes)
        return endpoint.routes

    def _endpoint(self, url: str) -> Endpoint:
        """The datastore's record of `url`; an engine outside the pool (probed directly) gets
        a record of its own, not kept."""
        known = self.store.endpoints.get(url)
        if known is not None:
            return known
        return Endpoint(url, Breaker(self._health.failure_threshold, self._health.open_s))

    def enforces(self, constraint: str) -> bool:
        """Whether an engine read so far (at start, or when first picked) enforces this
        structured-output kind; no probe is made, so an engine not read yet counts as not."""
        return any(e.routes and constraint in e.constraints for e in self.store.endpoints.values())

    def derender_form(self, url: str) -> str:
        """How the engine at `url` takes the derender route: `vllm` (stock vLLM ≥ 0.33's
        non-streaming `parse_context` form) or `onehop` (the client's request, streamed or not)."""
        known = self.store.endpoints.get(url)
        return "vllm" if known is not None and known.vllm_derender else "onehop"

    def _turned_off(self, endpoint: Endpoint, exc: EngineRoutesOff) -> None:
        now = time.monotonic()
        if not endpoint.off(now):
            log.warning("engine %s is left out for %g s: %s", endpoint.url, ROUTES_OFF_RECHECK_S, exc.message)
        endpoint.off_at = now

    async def _probe(self, url: str) -> tuple[set[str], frozenset[str], bool]:
        """The engine's output modes, the structured-output kinds it enforces, and whether its
        derender is stock vLLM's form."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                async with self.session.get(url + CAPABILITIES_PATH) as response:
                    if response.status == 404:  # stock vLLM: its grammar backends enforce every kind
                        modes, vllm_form = await self._stock_modes(url)
                        return modes, frozenset(CONSTRAINT_KINDS), vllm_form
                    body = await response.read()
                    if response.status != 200:
                        raise EngineUnavailable(f"the engine's capabilities answer was {response.status}")
        except TimeoutError as exc:
            raise EngineUnavailable(f"the engine's capabilities did not come within {PROBE_TIMEOUT_S} s") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"cannot reach the engine: {exc or type(exc).__name__}") from exc
        try:
            caps = _CAPABILITIES.decode(body)
        except msgspec.DecodeError as exc:
            raise EngineFailed("the engine sent an invalid capabilities document") from exc
        why = self.expected.mismatch(url, caps) if self.expected is not None else None
        if why is not None:
            log.error("%s: the engine is not used", why)
            raise EngineMismatch(why)
        if caps.max_model_len is not None:
            self._max_model_len = caps.max_model_len
        if caps.kv_events is not None:
            self._subscribe_to(url, caps.kv_events)
        return set(caps.output_modes), frozenset(caps.structured_outputs), False

    def _subscribe_to(self, url: str, published: _KVEvents) -> None:
        """Subscribe to the KV events a onehop engine's capabilities name, unless its config
        names them (that wins) or the pool keeps no index (not `kv_cache` balancing)."""
        if self._subscribe is None or url in self.kv_subscribers:
            return
        index = self.store.index
        if index is not None and published.block_size not in (0, index.block_size):
            log.warning(
                "engine %s publishes KV events in blocks of %d tokens, the index keeps %d: not subscribed"
                " (set balancing.kv_index.block_size to the engines' --block-size)",
                url, published.block_size, index.block_size,
            )
            return
        try:
            member = EngineEndpoint(
                url=url, kv_events=published.endpoint, kv_replay=published.replay_endpoint, kv_topic=published.topic
            )
        except ConfigError as exc:  # the engine's document, not ours: it is routed without its events
            log.warning("engine %s names KV event sockets the gateway cannot use: %s", url, exc)
            return
        subscriber = self._subscribe(member)
        self.kv_subscribers[url] = subscriber
        subscriber.start()
        log.info("engine %s: subscribed to its KV events at %s", url, published.endpoint)

    async def _unsubscribe_gone(self) -> None:
        """Engines that left the pool (DNS): their subscription ends and the index forgets them."""
        for url in [url for url in self.kv_subscribers if url not in self.store.endpoints]:
            await self.kv_subscribers.pop(url).close()
            if self.store.index is not None:
                self.store.index.forget(url)

    async def _stock_modes(self, url: str) -> tuple[set[str], bool]:
        """A stock vLLM's output modes: text and tokens, and derender (its own form) from 0.33 on."""
        async with self.session.get(url + VERSION_PATH) as response:
            body = await response.read() if response.status == 200 else b"{}"
        try:
            version = _VERSION.decode(body).version
        except msgspec.DecodeError:
            version = ""
        if not serves_derender(version):
            return {"tokens", "text"}, False
        log.info("engine %s is vLLM %s: its own derender form serves non-streaming chat", url, version)
        return {"tokens", "text", "derender"}, True

    def max_model_len(self) -> int | None:
        """The context length the pool's engines reported (None until one did, or from stock vLLM)."""
        return self._max_model_len

    async def check_engines(self, *, strict: bool) -> None:
        """Read the capabilities of every engine not read yet. `strict` (at start): a mismatch
        raises `EngineMismatch`, and the gateway does not start; otherwise (new addresses
        after a DNS change) it is logged, and the engine is never used. An engine that does
        not answer yet is checked when it is first picked."""
        for url in self.store.urls():
            try:
                await self.routes(url)
            except EngineMismatch:
                if strict:
                    raise
            except (EngineUnavailable, EngineFailed) as exc:
                log.warning("engine %s not checked yet (%s): it will be when first picked", url, exc.message)

    async def watch_dns(self, interval: float) -> None:
        """Look `resolve: true` host names up again every `interval`, and check new engines."""
        if not self.store.resolves():
            return
        while True:
            await asyncio.sleep(interval)
            await self.store.resolve()
            await self._unsubscribe_gone()
            await self.check_engines(strict=False)

    async def abort(self, url: str, request_id: str) -> EngineSummary | None:
        """Best effort: the engine also aborts when the stream's connection closes. Returns what
        the request used, when the engine says (an onehop engine does; vLLM does not)."""
        try:
            async with asyncio.timeout(ABORT_TIMEOUT_S):
                async with self.session.post(url + ABORT_PATH, json={"request_ids": [request_id]}) as response:
                    body = await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("abort of %s at %s failed: %s", public_request_id(request_id), url, exc)
            return None
        if response.status != 200 or not body:
            return None
        try:
            return decode_abort_answer(body).usage.get(request_id)
        except ProtocolError:
            return None  # an engine whose abort answers something else: its usage is unknown

    async def watch_health(self) -> None:
        """Active checks: a failing /health counts against the circuit, a passing one closes it."""
        while True:
            await asyncio.sleep(self._health.interval_s)
            await asyncio.gather(*(self._check(e) for e in list(self.store.endpoints.values())))

    async def _check(self, endpoint: Endpoint) -> None:
        try:
            async with asyncio.timeout(self._health.check_timeout_s):
                async with self.session.get(endpoint.url + "/health") as response:
                    healthy = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            healthy = False
        if healthy:
            self.store.succeeded(endpoint)
        else:
            self.store.failed(endpoint, time.monotonic())


@dataclass(frozen=True)
class Target:
    """Where a request goes: its route, its pool's client, the engine picked in it (and the
    prompt tokens it is expected to prefill), and the request's facts (for a retry's pick)."""

    route: Route
    engines: EngineClient
    choice: Choice
    facts: RequestFacts = NO_FACTS

    @property
    def endpoint(self) -> Endpoint:
        return self.choice.endpoint
