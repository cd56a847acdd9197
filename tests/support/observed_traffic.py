"""Scripted traffic through a gateway with the real OpenAI and Anthropic SDKs, and a ledger of
what each client was answered: the status, the route the answer's `onehop-route` header named,
the usage it carried. What the metrics and traces say is checked against the ledger.

Every API and both modes (chat, completions, Responses, Messages; streamed and whole), tools,
fields and edits a coding agent sends that the gateway ignores, 400s, a quota's 429, a tenant
limit's 429, a client that leaves mid-stream and a stream the engine breaks mid-way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import openai
from anthropic.types import RawMessageDeltaEvent, RawMessageStartEvent
from openai.types.responses import ResponseCompletedEvent, ResponseIncompleteEvent

MODEL = "sim"
ROUTES = ("derender", "text", "tokens")
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SHARED_PREFIX = " ".join(f"Rule {i}: answer briefly and plainly." for i in range(24))
"""A system prompt of several KV blocks, sent more than once, so the engine's prefix cache serves
some prompts (the `cached` tokens)."""
LONG_STREAM = {"max_tokens": 4000, "ignore_eos": True}
"""A stream that runs for seconds (at the sim's 2 ms a token) unless its client leaves."""


@dataclass(frozen=True)
class Usage:
    """A client's view of one answer's usage, in the gateway's four kinds; `reasoning` None where
    the API does not tell the client (Messages)."""

    prompt: int
    cached: int
    completion: int
    reasoning: int | None

    def kinds(self) -> dict[str, int]:
        counts = {"prompt": self.prompt, "cached": self.cached, "completion": self.completion}
        if self.reasoning is not None:
            counts["reasoning"] = self.reasoning
        return counts


@dataclass(frozen=True)
class Sent:
    endpoint: str
    route: str
    status: int
    tenant: str
    usage: Usage | None
    trace_header: str | None
    """The answer's `traceresponse` header, as the client got it."""


@dataclass
class Ledger:
    sent: list[Sent] = field(default_factory=list)

    def requests(self) -> Counter[tuple[str, str, str]]:
        """(endpoint, route, status) → requests; a 5xx counts as `5xx` (which one is the gateway's to say)."""
        return Counter((s.endpoint, s.route, status_class(s.status)) for s in self.sent)

    def tokens(self) -> dict[tuple[str, str, str], int]:
        """(endpoint, route, kind) → tokens the clients were told of (kinds they were told of)."""
        total: Counter[tuple[str, str, str]] = Counter()
        for s in self.sent:
            if s.usage is not None:
                for kind, count in s.usage.kinds().items():
                    total[(s.endpoint, s.route, kind)] += count
        return {key: count for key, count in total.items() if count}

    def tenant_tokens(self) -> dict[tuple[str, str], int]:
        total: Counter[tuple[str, str]] = Counter()
        for s in self.sent:
            if s.usage is not None:
                for kind in ("prompt", "cached", "completion"):
                    total[(s.tenant, kind)] += s.usage.kinds()[kind]
        return {key: count for key, count in total.items() if count}

    def hidden_reasoning(self) -> set[tuple[str, str]]:
        """(endpoint, route) whose clients are not told their reasoning tokens."""
        return {(s.endpoint, s.route) for s in self.sent if s.usage is not None and s.usage.reasoning is None}


def status_class(status: int) -> str:
    return "5xx" if status >= 500 else str(status)


def _route_of(headers: Mapping[str, str]) -> str:
    return headers.get("onehop-route", "none")


def chat_usage(usage: Any) -> Usage:
    prompt_details, completion_details = usage.prompt_tokens_details, usage.completion_tokens_details
    return Usage(
        prompt=usage.prompt_tokens,
        cached=(prompt_details.cached_tokens or 0) if prompt_details is not None else 0,
        completion=usage.completion_tokens,
        reasoning=(completion_details.reasoning_tokens or 0) if completion_details is not None else 0,
    )


def responses_usage(usage: Any) -> Usage:
    return Usage(
        prompt=usage.input_tokens,
        cached=usage.input_tokens_details.cached_tokens or 0,
        completion=usage.output_tokens,
        reasoning=usage.output_tokens_details.reasoning_tokens or 0,
    )


def messages_usage(start: Any, output_tokens: int) -> Usage:
    """Anthropic counts cached prompt tokens apart: the three inputs add up to the prompt."""
    cached = start.cache_read_input_tokens or 0
    prompt = start.input_tokens + (start.cache_creation_input_tokens or 0) + cached
    return Usage(prompt=prompt, cached=cached, completion=output_tokens, reasoning=None)


class Traffic:
    """Clients of one gateway, per tenant key; each call sends one request and books its answer."""

    def __init__(self, base_url: str, keys: Mapping[str, str], stack: AsyncExitStack) -> None:
        self.base_url, self.keys, self._stack = base_url, keys, stack
        self.ledger = Ledger()
        self._openai: dict[str, openai.AsyncOpenAI] = {}
        self._anthropic: dict[str, anthropic.AsyncAnthropic] = {}
        self._session: aiohttp.ClientSession | None = None

    async def openai(self, tenant: str) -> openai.AsyncOpenAI:
        if tenant not in self._openai:
            client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.keys[tenant], max_retries=0)
            self._openai[tenant] = await self._stack.enter_async_context(client)
        return self._openai[tenant]

    async def anthropic(self, tenant: str) -> anthropic.AsyncAnthropic:
        if tenant not in self._anthropic:
            root = self.base_url.removesuffix("/v1")
            client = anthropic.AsyncAnthropic(base_url=root, api_key=self.keys[tenant], max_retries=0)
            self._anthropic[tenant] = await self._stack.enter_async_context(client)
        return self._anthropic[tenant]

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = await self._stack.enter_async_context(aiohttp.ClientSession())
        return self._session

    def book(self, endpoint: str, tenant: str, status: int, headers: Mapping[str, str], usage: Usage | None) -> Sent:
        sent = Sent(endpoint, _route_of(headers), status, tenant, usage, headers.get("traceresponse"))
        self.ledger.sent.append(sent)
        return sent

    # -- answered requests ------------------------------------------------------------------

    async def chat(
        self, tenant: str, route: str, *, stream: bool, tools: bool = False, headers: Mapping[str, str] | None = None,
        system: str | None = None,
    ) -> Sent:
        client = await self.openai(tenant)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        extra: dict[str, Any] = {"tools": [WEATHER_TOOL]} if tools else {}
        if stream:
            extra["stream_options"] = {"include_usage": True}
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=16, stream=stream,
            extra_headers={"onehop-route": route, **(headers or {})}, **extra,
        )  # fmt: skip
        usage = await _usage_of(raw.parse(), stream)
        return self.book("chat", tenant, raw.status_code, raw.headers, chat_usage(usage))

    async def completion(self, tenant: str, route: str, *, stream: bool, headers: Mapping[str, str] | None = None) -> Sent:
        client = await self.openai(tenant)
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, stream=stream,
            extra_headers={"onehop-route": route, **(headers or {})}, **extra,
        )  # fmt: skip
        usage = await _usage_of(raw.parse(), stream)
        return self.book("completions", tenant, raw.status_code, raw.headers, chat_usage(usage))

    async def response(self, tenant: str, route: str, *, stream: bool, headers: Mapping[str, str] | None = None) -> Sent:
        """A Responses request as a coding agent sends it: a hosted tool the gateway drops and a
        field newer than it, which it ignores (both counted)."""
        client = await self.openai(tenant)
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input="Plan a picnic.", max_output_tokens=16, stream=stream, store=False,
            tools=[{"type": "web_search"}],
            extra_body={"onehop_future_field": True}, extra_headers={"onehop-route": route, **(headers or {})},
        )  # fmt: skip
        answer = raw.parse()
        if stream:
            events = [event async for event in answer]  # type: ignore[union-attr]
            # `response.incomplete` when max_output_tokens ended it: usage all the same
            (done,) = [event for event in events if isinstance(event, ResponseCompletedEvent | ResponseIncompleteEvent)]
            usage = done.response.usage
        else:
            usage = answer.usage  # type: ignore[union-attr]
        return self.book("responses", tenant, raw.status_code, raw.headers, responses_usage(usage))

    async def message(self, tenant: str, route: str, *, stream: bool, headers: Mapping[str, str] | None = None) -> Sent:
        """A Messages request with a context edit of a type the gateway does not serve (ignored, counted)."""
        client = await self.anthropic(tenant)
        raw = await client.messages.with_raw_response.create(
            model=MODEL, max_tokens=16, stream=stream, messages=[{"role": "user", "content": "Name three rivers."}],
            extra_body={"context_management": {"edits": [{"type": "compact_20990101"}]}},
            extra_headers={"onehop-route": route, **(headers or {})},
        )  # fmt: skip
        answer = await raw.parse()  # Anthropic's parse is a coroutine, OpenAI's is not
        if stream:
            events = [event async for event in answer]  # type: ignore[union-attr]
            start = next(event.message.usage for event in events if isinstance(event, RawMessageStartEvent))
            output = [event.usage.output_tokens for event in events if isinstance(event, RawMessageDeltaEvent)][-1]
            usage = messages_usage(start, output)
        else:
            usage = messages_usage(answer.usage, answer.usage.output_tokens)  # type: ignore[union-attr]
        return self.book("messages", tenant, raw.http_response.status_code, raw.headers, usage)

    # -- refusals and failures --------------------------------------------------------------

    async def refused(self, endpoint: str, tenant: str, call: Callable[[], Awaitable[Any]]) -> Sent:
        """A request the gateway refuses (an SDK error with the answer's status and headers)."""
        try:
            await call()
        except (openai.APIStatusError, anthropic.APIStatusError) as error:
            return self.book(endpoint, tenant, error.status_code, error.response.headers, None)
        raise AssertionError(f"the {endpoint} request was answered, not refused")

    async def bad_chat(self, tenant: str) -> Sent:
        client = await self.openai(tenant)
        return await self.refused(
            "chat", tenant,
            lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=-1
            ),
        )  # fmt: skip

    async def bad_message(self, tenant: str) -> Sent:
        client = await self.anthropic(tenant)
        return await self.refused(
            "messages", tenant,
            lambda: client.messages.create(model=MODEL, max_tokens=-5, messages=[{"role": "user", "content": "Hi"}]),
        )

    @asynccontextmanager
    async def held_stream(self, tenant: str, route: str) -> AsyncIterator[None]:
        """A long chat stream that has sent its first bytes, cut by its client on leaving: a 499."""
        session = await self.session()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "A long story, please."}], "stream": True, **LONG_STREAM}
        headers = {"Authorization": f"Bearer {self.keys[tenant]}", "onehop-route": route}
        async with session.post(self.base_url + "/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.content.readany(), "the stream sent nothing"
            yield
            self.book("chat", tenant, 499, resp.headers, None)  # what the gateway counts a client that left as
            resp.close()

    async def broken_stream(self, tenant: str, route: str) -> tuple[Sent, bytes]:
        """A chat stream whose engine dies mid-way (armed by the caller): the client gets a 200,
        some chunks, an error event and `[DONE]`, and no usage."""
        session = await self.session()
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": "Count to twenty."}], "stream": True,
            "max_tokens": 32, "ignore_eos": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        headers = {"Authorization": f"Bearer {self.keys[tenant]}", "onehop-route": route}
        async with session.post(self.base_url + "/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            raw = await resp.read()
            # The client saw a 200 and then an error: the gateway must count it as a failure.
            return self.book("chat", tenant, 502, resp.headers, None), raw


async def _usage_of(answer: Any, stream: bool) -> Any:
    """The usage an answer carried: a whole answer's own, or a stream's last chunk that has one."""
    if not stream:
        return answer.usage
    chunks = [chunk async for chunk in answer]
    return next(chunk.usage for chunk in reversed(chunks) if chunk.usage is not None)
