"""What differs between OpenAI endpoints, as small adapters the one pipeline drives.

An `Endpoint` decodes and checks its request, renders it to prompts (one for
chat, one per prompt for completions), turns it into sampling parameters and
the engine's derender-route fields, and makes the stateful derender of the
text and tokens routes. The flow itself (`gateway.flow.pipeline`) is the same for
every endpoint; a new endpoint is one more adapter here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import msgspec
from derender.chat import ChatDerender, ChatOptions, forced_tool_prefix
from derender.completion import CompletionDerender, CompletionOptions
from derender.parsers import bind_parsers
from wire.openai_schema import (
    CHAT_COMPLETION_CHUNK_DECODER,
    CHAT_COMPLETION_DECODER,
    CHAT_COMPLETION_REQUEST_DECODER,
    COMPLETION_CHUNK_DECODER,
    COMPLETION_DECODER,
    COMPLETION_REQUEST_DECODER,
    ChatCompletionRequest,
    CompletionRequest,
)
from gateway.upstream import remote
from gateway.config import Limits, Route
from gateway.edge.context import Edge, RequestContext
from gateway.upstream.engine_request import chat_sampling, completion_sampling, constraint_kind
from gateway.edge.errors import InvalidRequest
from gateway.routing.policy import RequestFeatures
from gateway.relay.engine import remote_error
from gateway.apis.messages import ContextManagementResponse, MessagesPresenter, MessagesRequest
from gateway.apis.messages import decode_request as decode_messages_request
from gateway.apis.messages import translate as translate_messages
from gateway.apis.agent_tools import GRAMMAR_KINDS, ToolPolicy, hosted_types
from gateway.apis.responses import ResponsesPresenter, ResponsesRequest, forced_custom
from gateway.apis.responses import decode_request as decode_responses_request
from gateway.apis.responses import to_chat as responses_to_chat
from gateway.serving.runtime import ModelRuntime
from gateway.serving.state import GatewayState
from gateway.apis.translate import Presenter, Turn, turn
from gateway.edge.unknown_fields import Decoded
from gateway.edge.validate import (
    chat_text_chars,
    check_chat,
    check_chat_limits,
    check_completion,
    check_completion_limits,
    completion_text_chars,
    prompt_count,
)

R = TypeVar("R")
F = TypeVar("F")
RemoteDerender = remote.RemoteChatDerender | remote.RemoteCompletionDerender


@dataclass(frozen=True, slots=True)
class Described:
    """A request's settings as the trace records them (GenAI conventions)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    n: int | None
    seed: int | None
    stream: bool
    top_logprobs: int = 0
    prompts: int = 1
    """Engine requests it makes (completions: one per prompt), each of `n` choices."""
    priority: int = 0
    """vLLM's `priority` field, as sent (0: not sent, or the default)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What every engine request of one client request shares: ids, usage wishes, the model."""

    model: ModelRuntime
    model_name: str
    """The name the answer carries (the client's, which may be an alias)."""
    response_id: str
    created: int
    include_usage: bool
    continuous_usage: bool
    keep_answer: bool = True
    """The whole answer is built at the end (not streamed): derenders keep every delta for it."""


class CompletionsDerender(CompletionDerender):
    """CompletionDerender with the chat-derender surface the relay expects (no role chunks)."""

    def start(self) -> list[Any]:
        return []


class Endpoint(Protocol[R]):
    name: str
    """The endpoint's label (metrics, the policy's `endpoint`)."""
    id_prefix: str
    """The answer id's prefix, separator included (`chatcmpl-`, `resp_`)."""
    chunk_decoder: msgspec.json.Decoder[Any]
    answer_decoder: msgspec.json.Decoder[Any]

    async def decode(self, body: bytes, edge: Edge, state: GatewayState) -> R: ...

    def forwarded(self, request: R, body: bytes) -> bytes:
        """The body engines and vLLM's services see: the client's, or the chat request it runs as."""
        ...

    def presenter(self, request: R, edge: Edge, state: GatewayState) -> Presenter[Any] | None:
        """None: the answer is the chat or completion objects themselves; else what presents
        them in this API's shape."""
        ...

    def check(self, request: R, limits: Limits) -> None: ...

    def describe(self, request: R) -> Described: ...

    def text_chars(self, request: R) -> int:
        """Characters of text the request carries, counted before any render."""
        ...

    def content(self, body: bytes) -> str:
        """The request's input as sent, for `record_content` only."""
        ...

    async def render(self, model: ModelRuntime, request: R, body: bytes) -> list[Sequence[int]]: ...

    def features(
        self, request: R, ctx: RequestContext, prompts: list[Sequence[int]], sampling: dict[str, Any]
    ) -> RequestFeatures:
        """What the policy looks at (the model by its served name: an alias resolved)."""
        ...

    def sampling(self, request: R) -> dict[str, Any]:
        """The engine's sampling parameters, checked (before anything costly is done)."""
        ...

    def route_sampling(self, sampling: dict[str, Any], model: ModelRuntime, route: Route) -> dict[str, Any]:
        """`sampling` as the chosen route needs it."""
        ...

    def engine_fields(self, body: bytes, index: int) -> dict[str, Any]:
        """What the derender route's engine request carries besides the prompt (the client's request)."""
        ...

    def chat_request(self, request: R) -> ChatCompletionRequest | None:
        """The chat request this runs as (what vLLM's derender form is filled from); None for completions."""
        ...

    def derender(self, request: R, answer: Answer, prompt: Sequence[int], index: int) -> Any: ...

    def remote_derender(self, answer: Answer, body: bytes, prompt: Sequence[int]) -> RemoteDerender:
        """vLLM's stateless derender of this endpoint (the tokens-remote route)."""
        ...


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.*)`")
"""msgspec's words for a field the request struct lacks (at the top level: no `- at $...`)."""


def decode(decoder: msgspec.json.Decoder[Any], body: bytes, what: str) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        unknown = _UNKNOWN_FIELD.fullmatch(str(exc))
        if unknown is not None:  # OpenAI's words and code for it
            name = unknown.group(1)
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter"
            ) from exc
        raise InvalidRequest(f"invalid {what} request: {exc}") from exc
    except RecursionError as exc:  # msgspec's own bound, far deeper than any we accept
        raise InvalidRequest(f"invalid {what} request: JSON nested too deeply") from exc


class _Messages(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"[]")


class _Prompt(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.Raw(b'""')


def _headers(ctx: Edge) -> dict[str, str]:
    return {k.lower(): v for k, v in ctx.headers.items()}


class Chat:
    name = "chat"
    id_prefix = "chatcmpl-"
    chunk_decoder = CHAT_COMPLETION_CHUNK_DECODER
    answer_decoder = CHAT_COMPLETION_DECODER

    async def decode(self, body: bytes, edge: Edge, state: GatewayState) -> ChatCompletionRequest:
        request: ChatCompletionRequest = decode(CHAT_COMPLETION_REQUEST_DECODER, body, "chat completion")
        return request

    def forwarded(self, request: ChatCompletionRequest, body: bytes) -> bytes:
        return body

    def presenter(self, request: ChatCompletionRequest, edge: Edge, state: GatewayState) -> None:
        return None

    def check(self, request: ChatCompletionRequest, limits: Limits) -> None:
        check_chat(request)
        check_chat_limits(request, limits)

    def describe(self, request: ChatCompletionRequest) -> Described:
        return Described(
            _max_tokens(request), request.temperature, request.top_p, request.n, request.seed, bool(request.stream),
            top_logprobs=request.top_logprobs or 0, priority=request.priority,
        )

    def content(self, body: bytes) -> str:
        return bytes(msgspec.json.decode(body, type=_Messages).messages).decode("utf-8", "replace")

    def text_chars(self, request: ChatCompletionRequest) -> int:
        return chat_text_chars(request)

    async def render(self, model: ModelRuntime, request: ChatCompletionRequest, body: bytes) -> list[Sequence[int]]:
        """Local chat template or vLLM's /render, then the forced tool-call opening, if any."""
        forced = forced_tool_prefix(request, model.tool_parser)
        if model.render == "local":
            return [await model.renderer.chat(request, suffix=forced)]
        try:
            rendered = await remote.render_chat(model.engines.session, _remote_url(model), body)
        except remote.RemoteServiceError as exc:
            raise remote_error(exc) from exc
        suffix = await model.renderer.encode(forced) if forced is not None else ()
        return [rendered.token_ids + list(suffix)]

    def features(
        self,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        prompts: list[Sequence[int]],
        sampling: dict[str, Any],
    ) -> RequestFeatures:
        kwargs = request.chat_template_kwargs or {}
        return RequestFeatures(
            endpoint="chat",
            model=ctx.model.name,
            stream=bool(request.stream),
            logprobs=bool(request.logprobs),
            top_logprobs=request.top_logprobs or 0,
            n=request.n or 1,
            max_tokens=_max_tokens(request),
            prompt_tokens=len(prompts[0]),
            tools=bool(request.tools),
            forced_tool=bool(request.tools) and request.effective_tool_choice() not in (None, "none", "auto"),
            reasoning=bool(kwargs.get("enable_thinking", True)),
            headers=_headers(ctx),
            tenant=ctx.tenant,
            constraint=constraint_kind(sampling),
            cache_salt=request.cache_salt,
        )

    def sampling(self, request: ChatCompletionRequest) -> dict[str, Any]:
        return chat_sampling(request)

    def route_sampling(self, sampling: dict[str, Any], model: ModelRuntime, route: Route) -> dict[str, Any]:
        return _keep_special_tokens(model, sampling) if route == "text" else sampling

    def engine_fields(self, body: bytes, index: int) -> dict[str, Any]:
        return {"chat_request": msgspec.Raw(body)}

    def chat_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        return request

    def derender(
        self, request: ChatCompletionRequest, answer: Answer, prompt: Sequence[int], index: int
    ) -> ChatDerender:
        # The text options come from the same request fields the engine's sampling params were built from.
        model = answer.model
        options = ChatOptions.from_request(
            request,
            reasoning_parser=model.reasoning_parser,
            tool_parser=model.tool_parser,
            reasoning_field=model.reasoning_field,
        )
        return ChatDerender(
            model.vocab,
            options,
            model=answer.model_name,
            n=request.n or 1,
            prompt_token_ids=prompt,
            response_id=answer.response_id,
            created=answer.created,
            include_usage=answer.include_usage,
            continuous_usage=answer.continuous_usage,
            keep_answer=answer.keep_answer,
        )

    def remote_derender(self, answer: Answer, body: bytes, prompt: Sequence[int]) -> remote.RemoteChatDerender:
        model = answer.model
        return remote.RemoteChatDerender(
            model.engines.session, _remote_url(model), model=model.name, chat_request=body, prompt_token_ids=prompt
        )


class Completions:
    name = "completions"
    id_prefix = "cmpl-"
    chunk_decoder = COMPLETION_CHUNK_DECODER
    answer_decoder = COMPLETION_DECODER

    async def decode(self, body: bytes, edge: Edge, state: GatewayState) -> CompletionRequest:
        request: CompletionRequest = decode(COMPLETION_REQUEST_DECODER, body, "completion")
        return request

    def forwarded(self, request: CompletionRequest, body: bytes) -> bytes:
        return body

    def presenter(self, request: CompletionRequest, edge: Edge, state: GatewayState) -> None:
        return None

    def check(self, request: CompletionRequest, limits: Limits) -> None:
        check_completion(request)
        check_completion_limits(request, limits)

    def describe(self, request: CompletionRequest) -> Described:
        return Described(
            request.max_tokens, request.temperature, request.top_p, request.n, request.seed, bool(request.stream),
            top_logprobs=request.logprobs or 0, prompts=prompt_count(request), priority=request.priority,
        )

    def content(self, body: bytes) -> str:
        return bytes(msgspec.json.decode(body, type=_Prompt).prompt).decode("utf-8", "replace")

    def text_chars(self, request: CompletionRequest) -> int:
        return completion_text_chars(request)

    async def render(self, model: ModelRuntime, request: CompletionRequest, body: bytes) -> list[Sequence[int]]:
        if model.render == "local":
            return await model.renderer.completion_prompts(request)
        try:
            rendered = await remote.render_completion(model.engines.session, _remote_url(model), body)
        except remote.RemoteServiceError as exc:
            raise remote_error(exc) from exc
        return [item.token_ids for item in rendered]

    def features(
        self, request: CompletionRequest, ctx: RequestContext, prompts: list[Sequence[int]], sampling: dict[str, Any]
    ) -> RequestFeatures:
        return RequestFeatures(
            endpoint="completions",
            model=ctx.model.name,
            stream=bool(request.stream),
            logprobs=request.logprobs is not None,
            top_logprobs=request.logprobs or 0,
            n=(request.n or 1) * len(prompts),
            max_tokens=request.max_tokens,
            prompt_tokens=sum(len(p) for p in prompts),
            headers=_headers(ctx),
            tenant=ctx.tenant,
            constraint=constraint_kind(sampling),
            cache_salt=request.cache_salt,
        )

    def sampling(self, request: CompletionRequest) -> dict[str, Any]:
        return completion_sampling(request)

    def route_sampling(self, sampling: dict[str, Any], model: ModelRuntime, route: Route) -> dict[str, Any]:
        return sampling  # no parsers: the route changes nothing

    def engine_fields(self, body: bytes, index: int) -> dict[str, Any]:
        return {"completion_request": msgspec.Raw(body), "prompt_index": index}

    def chat_request(self, request: CompletionRequest) -> None:
        return None

    def derender(
        self, request: CompletionRequest, answer: Answer, prompt: Sequence[int], index: int
    ) -> CompletionsDerender:
        n = request.n or 1
        return CompletionsDerender(
            answer.model.vocab,
            CompletionOptions.from_request(request),
            model=answer.model_name,
            n=n,
            first_index=index * n,  # OpenAI numbers choices prompt_index * n + i
            prompt_token_ids=prompt,
            response_id=answer.response_id,
            created=answer.created,
            include_usage=answer.include_usage,
            continuous_usage=answer.continuous_usage,
            keep_answer=answer.keep_answer,
        )

    def remote_derender(self, answer: Answer, body: bytes, prompt: Sequence[int]) -> remote.RemoteCompletionDerender:
        model = answer.model
        return remote.RemoteCompletionDerender(
            model.engines.session,
            _remote_url(model),
            model=model.name,
            completion_request=body,
            prompt_token_ids=prompt,
        )


class TranslatedChat(Generic[F]):
    """An API that is another shape of a chat completion (`gateway.apis.translate`): every step runs
    the chat adapter on the chat request the client's request translates to; only decoding
    and the presentation of the answer are the API's own."""

    chunk_decoder = CHAT_COMPLETION_CHUNK_DECODER
    answer_decoder = CHAT_COMPLETION_DECODER

    def forwarded(self, request: Turn[F], body: bytes) -> bytes:
        return request.chat_body

    def check(self, request: Turn[F], limits: Limits) -> None:
        CHAT.check(request.chat, limits)

    def describe(self, request: Turn[F]) -> Described:
        return CHAT.describe(request.chat)

    def content(self, body: bytes) -> str:
        return body.decode("utf-8", "replace")

    def text_chars(self, request: Turn[F]) -> int:
        return CHAT.text_chars(request.chat)

    async def render(self, model: ModelRuntime, request: Turn[F], body: bytes) -> list[Sequence[int]]:
        return await CHAT.render(model, request.chat, request.chat_body)

    def features(
        self, request: Turn[F], ctx: RequestContext, prompts: list[Sequence[int]], sampling: dict[str, Any]
    ) -> RequestFeatures:
        return CHAT.features(request.chat, ctx, prompts, sampling)  # a chat, to the policy

    def sampling(self, request: Turn[F]) -> dict[str, Any]:
        return CHAT.sampling(request.chat)

    def route_sampling(self, sampling: dict[str, Any], model: ModelRuntime, route: Route) -> dict[str, Any]:
        return CHAT.route_sampling(sampling, model, route)

    def engine_fields(self, body: bytes, index: int) -> dict[str, Any]:
        return CHAT.engine_fields(body, index)

    def chat_request(self, request: Turn[F]) -> ChatCompletionRequest:
        return request.chat

    def derender(self, request: Turn[F], answer: Answer, prompt: Sequence[int], index: int) -> ChatDerender:
        return CHAT.derender(request.chat, answer, prompt, index)

    def remote_derender(self, answer: Answer, body: bytes, prompt: Sequence[int]) -> remote.RemoteChatDerender:
        return CHAT.remote_derender(answer, body, prompt)


class Responses(TranslatedChat[ResponsesRequest]):
    """OpenAI's Responses API; `previous_response_id` continues a conversation this replica stored."""

    name = "responses"
    id_prefix = "resp_"

    async def decode(self, body: bytes, edge: Edge, state: GatewayState) -> Turn[ResponsesRequest]:
        request = tolerated(decode_responses_request, self.name, body, state)
        history: list[Any] = []
        if request.previous_response_id is not None:
            stored = await state.responses.get(edge.owner, request.previous_response_id)
            if stored is None:
                raise InvalidRequest(  # OpenAI's answer, a 400; another tenant's id gets it too
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = stored.conversation
        policy = ToolPolicy(state.config.agents.hosted_tools, state.config.limits.grammar, _enforced(state, request))
        chat = responses_to_chat(request, history, policy)
        for kind in hosted_types(request.tools):  # left out: `refuse` raised above
            state.metrics.dropped_tools.labels(self.name, kind).inc()
        return turn(request, chat)

    def presenter(self, request: Turn[ResponsesRequest], edge: Edge, state: GatewayState) -> ResponsesPresenter:
        return ResponsesPresenter(state.responses, edge.owner)


class Messages(TranslatedChat[MessagesRequest]):
    """Anthropic's Messages API (its error shape too: `gateway.edge.errors.error_body`)."""

    name = "messages"
    id_prefix = "msg_"

    async def decode(self, body: bytes, edge: Edge, state: GatewayState) -> Turn[MessagesRequest]:
        request = tolerated(decode_messages_request, self.name, body, state)
        translated = translate_messages(request, state.config.agents)
        count_left_out(state, self.name, translated.dropped_tools, translated.ignored_edits)
        return turn(request, translated.chat, report=translated.applied)

    def presenter(self, request: Turn[MessagesRequest], edge: Edge, state: GatewayState) -> MessagesPresenter:
        applied = request.report
        assert applied is None or isinstance(applied, ContextManagementResponse)  # `decode` put it there
        return MessagesPresenter(applied)


def count_left_out(
    state: GatewayState, endpoint: str, dropped_tools: tuple[str, ...], ignored_edits: tuple[str, ...]
) -> None:
    """Server tools left out of a Messages prompt and context edits ignored, counted."""
    for kind in dropped_tools:
        state.metrics.dropped_tools.labels(endpoint, kind).inc()
    for kind in ignored_edits:
        state.metrics.context_edits_ignored.labels(state.ignored_edits.label(kind)).inc()


def _enforced(state: GatewayState, request: ResponsesRequest) -> frozenset[str]:
    """The grammar kinds the model's engines enforce, asked only when a custom tool is forced."""
    if not forced_custom(request):
        return frozenset()
    engines = state.model(request.model).engines
    return frozenset(kind for kind in GRAMMAR_KINDS.values() if engines.enforces(kind))


def tolerated(decode: Callable[..., Decoded[R]], endpoint: str, body: bytes, state: GatewayState) -> R:
    """The request, unknown top-level fields ignored (and counted) or refused as the config says."""
    decoded = decode(body, ignore_unknown=state.config.agents.unknown_fields == "ignore")
    if decoded.ignored:
        state.ignored_fields.record(endpoint, decoded.ignored, state.metrics.ignored_fields)
    return decoded.request


def _remote_url(model: ModelRuntime) -> str:
    """vLLM's render/derender service (the config refuses render: remote and routes that need
    it without one; an engine pool offers tokens-remote only with one)."""
    if model.remote_url is None:
        raise InvalidRequest("the tokens-remote route needs remote_url in the gateway config", param="onehop-route")
    return model.remote_url


def _max_tokens(request: ChatCompletionRequest) -> int | None:
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


def _keep_special_tokens(model: ModelRuntime, sampling: dict[str, Any]) -> dict[str, Any]:
    """On the text route the gateway finds markers in text: families whose markers are
    special tokens (Kimi, Harmony, DeepSeek) need the engine to keep special tokens' text,
    as vLLM's renderer asks its engine for those parsers."""
    if sampling.get("skip_special_tokens") is False:
        return sampling
    vocab = model.vocab
    parsers = bind_parsers(vocab, model.reasoning_parser, model.tool_parser)
    if parsers is not None and any(token_id in vocab.special_ids for token_id in parsers.atomic_ids):
        return {**sampling, "skip_special_tokens": False}
    return sampling


CHAT = Chat()
COMPLETIONS = Completions()
RESPONSES = Responses()
MESSAGES = Messages()
