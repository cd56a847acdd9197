"""Clients for vLLM's render and stateless derender services.

The `tokens-remote` route and remote render talk to a stock vLLM 0.32 server
started with `--enable-scale-out`:

    POST /v1/chat/completions/render    OpenAI chat body → one GenerateRequest
    POST /v1/completions/render         OpenAI completion body → [GenerateRequest], one per prompt
    POST /v1/chat/completions/derender  stream: {generate_chunk, stream_state, ...} → {chunk, stream_state}
                                        whole:  {generate_response, ...} → ChatCompletion
    POST /v1/completions/derender       the same; whole takes one generate response per prompt

Streaming derender is stateless: one POST per SSE chunk of the engine, each
carrying the chat request, the whole prompt and a `stream_state` that grows
with the output, while vLLM replays every earlier token through a fresh parser
(O(n²) parser calls; see DESIGN.md). This is the upstream design onehop
replaces, kept for existing deployments and as the benchmark peer, so the
client side is as cheap as it can be: request bodies are byte concatenations
of pieces encoded once, the engine's chunk and vLLM's `stream_state` travel
as opaque bytes, and only the few keys that decide something are decoded.

Errors:

    RemoteServiceError              vLLM answered non-200: its status and message
    ├── RemoteUnavailable     503   no answer: the connection failed or a session timeout ran out
    └── RemoteProtocolError   502   a 200 answer that is not the shape vLLM 0.32 sends
    InvalidChunk (ValueError)       a generate payload that is not a tokens-mode chunk

Timeouts are the session's (`connect`, `sock_read`): callers pass the
gateway's one upstream session.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import msgspec
from msgspec import Raw, Struct

from gateway.render.token_ids import json_ids

__all__ = [
    "InvalidChunk",
    "RemoteChatDerender",
    "RemoteCompletionDerender",
    "RemoteProtocolError",
    "RemoteServiceError",
    "RemoteUnavailable",
    "RenderedChat",
    "derender_completions",
    "render_chat",
    "render_completion",
]

CHAT_RENDER_PATH = "/v1/chat/completions/render"
COMPLETION_RENDER_PATH = "/v1/completions/render"
CHAT_DERENDER_PATH = "/v1/chat/completions/derender"
COMPLETION_DERENDER_PATH = "/v1/completions/derender"
_HEADERS = {"Content-Type": "application/json"}
_ERROR_BODY_CHARS = 500
_NULL = b"null"


class RemoteServiceError(Exception):
    """vLLM's render or derender service answered with an error."""

    def __init__(self, status: int, message: str, *, error_type: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type


class RemoteUnavailable(RemoteServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(503, message, error_type="ServiceUnavailableError")


class RemoteProtocolError(RemoteServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(502, message, error_type="BadGatewayError")


class InvalidChunk(ValueError):
    """A generate payload without the `choices` of a tokens-mode chunk."""


# ------------------------------------------------------------ wire views, codecs built once


class RenderedChat(Struct):
    """One GenerateRequest from vLLM's render service (chat, or one prompt of a completion)."""

    request_id: str
    token_ids: list[int]
    sampling_params: Raw
    generate_request: Raw
    """The whole GenerateRequest as vLLM sent it, for callers that forward it verbatim."""


class _RenderView(Struct):
    request_id: str
    token_ids: list[int]
    sampling_params: Raw


class _ErrorInfoView(Struct):
    message: str = ""
    type: str | None = None


class _ErrorView(Struct):
    error: _ErrorInfoView | str | None = None
    detail: str | list[Raw] | None = None  # FastAPI's own shape (unknown route, ...)


class _IndexView(Struct):
    index: int


class _GenerateChunkView(Struct):
    choices: list[_IndexView]


class _StreamAnswer(Struct):
    chunk: Raw = Raw(_NULL)
    stream_state: Raw = Raw(_NULL)


class _ChatDeltaView(Struct):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[Raw] | None = None


class _ChatChoiceView(Struct):
    delta: _ChatDeltaView = msgspec.field(default_factory=_ChatDeltaView)
    logprobs: Raw = Raw(_NULL)
    finish_reason: str | None = None
    token_ids: Raw = Raw(_NULL)


class _ChatChunkView(Struct):
    choices: list[_ChatChoiceView] = []
    usage: Raw = Raw(_NULL)


class _CompletionChoiceView(Struct):
    text: str = ""
    logprobs: Raw = Raw(_NULL)
    finish_reason: str | None = None
    token_ids: Raw = Raw(_NULL)


class _CompletionChunkView(Struct):
    choices: list[_CompletionChoiceView] = []
    usage: Raw = Raw(_NULL)


_encode = msgspec.json.Encoder().encode
_RENDER = msgspec.json.Decoder(_RenderView)
_RAW_LIST = msgspec.json.Decoder(list[Raw])
_ERROR = msgspec.json.Decoder(_ErrorView)
_GENERATE_CHUNK = msgspec.json.Decoder(_GenerateChunkView)
_STREAM_ANSWER = msgspec.json.Decoder(_StreamAnswer)
_CHAT_CHUNK = msgspec.json.Decoder(_ChatChunkView)
_COMPLETION_CHUNK = msgspec.json.Decoder(_CompletionChunkView)


# ------------------------------------------------------------ HTTP


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> bytes:
    """POST JSON and return the 200 body; anything else becomes a RemoteServiceError.

    A connection that breaks before the answer is retried once, on a fresh
    connection: render and derender are pure functions of the body, and a
    pooled keep-alive connection the server has just closed (uvicorn closes
    idle ones after 5 s) fails exactly like this.
    """
    for attempt in range(2):
        try:
            async with session.post(url, data=body, headers=_HEADERS) as response:
                data = await response.read()
                status = response.status
            break
        except TimeoutError as exc:  # aiohttp's timeouts are TimeoutErrors too
            raise RemoteUnavailable(f"no answer from {url} in time") from exc
        except aiohttp.ClientConnectionError as exc:
            if attempt == 0:
                continue
            raise RemoteUnavailable(f"cannot reach {url}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise RemoteUnavailable(f"cannot reach {url}: {exc}") from exc
    if status != 200:
        raise _service_error(status, data)
    return data


def _service_error(status: int, body: bytes) -> RemoteServiceError:
    try:
        view = _ERROR.decode(body)
    except msgspec.DecodeError:
        return RemoteServiceError(status, body[:_ERROR_BODY_CHARS].decode("utf-8", "replace"))
    if isinstance(view.error, _ErrorInfoView):
        return RemoteServiceError(status, view.error.message, error_type=view.error.type)
    detail = view.detail if isinstance(view.detail, str) else None
    return RemoteServiceError(status, view.error or detail or f"HTTP {status}")


def _decode_render(data: bytes | Raw, url: str) -> RenderedChat:
    try:
        view = _RENDER.decode(data)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"{url} answered with no GenerateRequest: {exc}") from exc
    raw = data if isinstance(data, Raw) else Raw(data)
    return RenderedChat(view.request_id, view.token_ids, view.sampling_params, raw)


# ------------------------------------------------------------ render


async def render_chat(session: aiohttp.ClientSession, base_url: str, chat_request: bytes) -> RenderedChat:
    """The prompt token ids and sampling params vLLM renders for an OpenAI chat body."""
    url = base_url.rstrip("/") + CHAT_RENDER_PATH
    return _decode_render(await _post(session, url, chat_request), url)


async def render_completion(
    session: aiohttp.ClientSession, base_url: str, completion_request: bytes
) -> list[RenderedChat]:
    """One rendered GenerateRequest per prompt of an OpenAI completion body, in prompt order."""
    url = base_url.rstrip("/") + COMPLETION_RENDER_PATH
    data = await _post(session, url, completion_request)
    try:
        items = _RAW_LIST.decode(data)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"{url} answered with no GenerateRequest list: {exc}") from exc
    return [_decode_render(item, url) for item in items]


# ------------------------------------------------------------ derender


def _is_null(raw: Raw) -> bool:
    # Length first: a stream_state grows with the output and is never copied to be compared.
    return len(raw) == len(_NULL) and bytes(raw) == _NULL


def _chat_chunk_visible(chunk: Raw) -> bool:
    view = _CHAT_CHUNK.decode(chunk)
    if not _is_null(view.usage):
        return True
    for choice in view.choices:
        delta = choice.delta
        if choice.finish_reason is not None or delta.role or delta.content or delta.tool_calls:
            return True
        if delta.reasoning or delta.reasoning_content:
            return True
        if not (_is_null(choice.logprobs) and _is_null(choice.token_ids)):
            return True
    return False


def _completion_chunk_visible(chunk: Raw) -> bool:
    view = _COMPLETION_CHUNK.decode(chunk)
    if not _is_null(view.usage):
        return True
    for choice in view.choices:
        if choice.text or choice.finish_reason is not None:
            return True
        if not (_is_null(choice.logprobs) and _is_null(choice.token_ids)):
            return True
    return False


class _StatelessDerender:
    """One request's stream through a stateless derender endpoint: one `stream_state` per choice."""

    _path: str
    _request_key: bytes

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        model: str,
        request: Raw | bytes,
        prompt_token_ids: Sequence[int],
    ) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + self._path
        self._model = _encode(model)
        self._prompt_count = len(prompt_token_ids)
        self._prompt_tokens = str(self._prompt_count).encode()
        self._prompt_ids = _encode(json_ids(prompt_token_ids))
        self._request = bytes(request)
        # Everything but the chunk and the state, encoded once for the request's life.
        self._head = b"".join(
            (
                b'{"stream":true,"model":',
                self._model,
                b',"prompt_tokens":',
                self._prompt_tokens,
                b',"prompt_token_ids":',
                self._prompt_ids,
                b',"',
                self._request_key,
                b'":',
                self._request,
                b',"stream_state":',
            )
        )
        self._states: dict[int, Raw] = {}
        self.posts = 0
        self.bytes_sent = 0
        """Request bytes sent so far: the transport cost of the stateless protocol."""

    @staticmethod
    def _visible(chunk: Raw) -> bool:
        raise NotImplementedError

    def _whole_body(self, generate_response: bytes) -> bytes:
        raise NotImplementedError

    async def chunk(self, generate_chunk: bytes) -> bytes | None:
        """Derender one tokens-mode SSE payload of `/inference/v1/generate`.

        Returns the OpenAI chunk as JSON bytes, or None when it carries nothing
        a client would see (a marker token the parser swallowed, say). Hot
        path, once per engine chunk: the body is spliced from bytes, and of
        the answer only the chunk is looked into.
        """
        index = _choice_index(generate_chunk)
        # A usage-only chunk (no choices) touches no choice's state: send none, keep none.
        state = self._states.get(index) if index is not None else None
        body = b"".join((self._head, _NULL if state is None else state, b',"generate_chunk":', generate_chunk, b"}"))
        answer = self._decode_answer(await self._send(body))
        if index is not None:
            self._states[index] = answer.stream_state
        if _is_null(answer.chunk) or not self._checked_visible(answer.chunk):
            return None
        return bytes(answer.chunk)

    async def whole(self, generate_response: bytes) -> bytes:
        """Derender a complete non-streaming tokens-mode generate response; the OpenAI body as bytes."""
        return await self._send(self._whole_body(generate_response))

    async def _send(self, body: bytes) -> bytes:
        self.posts += 1
        self.bytes_sent += len(body)
        return await _post(self._session, self._url, body)

    def _decode_answer(self, data: bytes) -> _StreamAnswer:
        try:
            answer = _STREAM_ANSWER.decode(data)
        except msgspec.DecodeError as exc:
            raise RemoteProtocolError(f"{self._url} answered with no chunk and stream_state: {exc}") from exc
        if _is_null(answer.stream_state):
            raise RemoteProtocolError(f"{self._url} answered without a stream_state")
        return answer

    def _checked_visible(self, chunk: Raw) -> bool:
        try:
            return self._visible(chunk)
        except msgspec.DecodeError as exc:
            raise RemoteProtocolError(f"{self._url} answered with a malformed chunk: {exc}") from exc


def _choice_index(generate_chunk: bytes) -> int | None:
    """The choice a generate chunk belongs to (None: a usage-only chunk); the engine sends one per chunk."""
    try:
        choices = _GENERATE_CHUNK.decode(generate_chunk).choices
    except msgspec.DecodeError as exc:
        raise InvalidChunk(f"not a tokens-mode generate chunk: {exc}") from exc
    if len(choices) > 1:
        raise InvalidChunk(f"a generate chunk carries one choice, got {len(choices)}")
    return choices[0].index if choices else None


class RemoteChatDerender(_StatelessDerender):
    """One chat request's output through vLLM's `/v1/chat/completions/derender`."""

    _path = CHAT_DERENDER_PATH
    _request_key = b"chat_request"
    _visible = staticmethod(_chat_chunk_visible)

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        model: str,
        chat_request: Raw | bytes,
        prompt_token_ids: Sequence[int],
    ) -> None:
        super().__init__(session, base_url, model=model, request=chat_request, prompt_token_ids=prompt_token_ids)


    def _whole_body(self, generate_response: bytes) -> bytes:
        return b"".join(
            (
                b'{"model":',
                self._model,
                b',"prompt_tokens":',
                self._prompt_tokens,
                b',"prompt_token_ids":',
                self._prompt_ids,
                b',"chat_request":',
                self._request,
                b',"generate_response":',
                generate_response,
                b"}",
            )
        )


class RemoteCompletionDerender(_StatelessDerender):
    """One prompt's output through vLLM's `/v1/completions/derender`.

    A multi-prompt request needs one per prompt, each with its own generate
    stream; vLLM numbers each stream's choices from 0 (its coupled
    `/v1/completions` numbers them `prompt_index * n + i`). For one
    non-streaming answer over all prompts, use `derender_completions`.
    """

    _path = COMPLETION_DERENDER_PATH
    _request_key = b"completion_request"
    _visible = staticmethod(_completion_chunk_visible)

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        model: str,
        completion_request: Raw | bytes,
        prompt_token_ids: Sequence[int],
    ) -> None:
        super().__init__(session, base_url, model=model, request=completion_request, prompt_token_ids=prompt_token_ids)


    def _whole_body(self, generate_response: bytes) -> bytes:
        return _completions_body(
            self._model, self._request, [self._prompt_ids], [self._prompt_count], [generate_response]
        )


def _completions_body(
    model: bytes,
    request: bytes,
    prompt_ids: Sequence[bytes],
    prompt_tokens: Sequence[int],
    generate_responses: Sequence[bytes],
) -> bytes:
    return b"".join(
        (
            b'{"model":',
            model,
            b',"prompt_tokens":',
            _encode(list(prompt_tokens)),
            b',"prompt_token_ids":[',
            b",".join(prompt_ids),
            b'],"completion_request":',
            request,
            b',"generate_responses":[',
            b",".join(generate_responses),
            b"]}",
        )
    )


async def derender_completions(
    session: aiohttp.ClientSession,
    base_url: str,
    *,
    model: str,
    completion_request: Raw | bytes,
    prompt_token_ids: Sequence[Sequence[int]],
    generate_responses: Sequence[bytes],
) -> bytes:
    """One non-streaming Completion over every prompt: one generate response per prompt, in order."""
    if len(prompt_token_ids) != len(generate_responses):
        raise ValueError(
            f"{len(prompt_token_ids)} prompts but {len(generate_responses)} generate responses"
        )
    body = _completions_body(
        _encode(model),
        bytes(completion_request),
        [_encode(json_ids(ids)) for ids in prompt_token_ids],
        [len(ids) for ids in prompt_token_ids],
        generate_responses,
    )
    return await _post(session, base_url.rstrip("/") + COMPLETION_DERENDER_PATH, body)
