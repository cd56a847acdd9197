"""Endpoints answered without an engine: stored responses (`GET`/`DELETE /v1/responses/{id}`,
from the Responses store (`state:`); the caller's own only, another's is answered as an unknown id),
OpenAI's `POST /v1/responses/input_tokens` and Anthropic's `POST /v1/messages/count_tokens`
(the prompt the model would see, rendered as a chat request is)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from gateway.edge.auth import TENANT_KEY, owner
from wire.openai_schema import ChatCompletionRequest
from gateway.edge.context import Edge
from gateway.flow.endpoints import CHAT, RESPONSES, tolerated
from gateway.edge.errors import NotFound
from gateway.apis.messages import count_tokens_to_chat, decode_count_tokens_request
from gateway.flow.pipeline import read_body
from gateway.serving.state import GATEWAY
from gateway.edge.validate import check_text_size

_encode = msgspec.json.Encoder().encode


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class TokenCount(msgspec.Struct):
    input_tokens: int


class InputTokens(msgspec.Struct):
    input_tokens: int
    object: str = "response.input_tokens"


def _json(value: object) -> web.Response:
    return web.Response(body=_encode(value), content_type="application/json")


def _missing(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id")


async def handle_get_response(http: web.Request) -> web.Response:
    response_id = http.match_info["response_id"]
    stored = await http.app[GATEWAY].responses.get(owner(http), response_id)
    if stored is None:
        raise _missing(response_id)
    return _json(stored.response)


async def handle_delete_response(http: web.Request) -> web.Response:
    response_id = http.match_info["response_id"]
    if not await http.app[GATEWAY].responses.delete(owner(http), response_id):
        raise _missing(response_id)
    return _json(DeletedResponse(id=response_id))


async def handle_count_tokens(http: web.Request) -> web.Response:
    state = http.app[GATEWAY]
    body = await read_body(http, state.config.timeouts.client_body_s)
    chat = count_tokens_to_chat(tolerated(decode_count_tokens_request, "messages", body, state), state.config.agents)
    return _json(TokenCount(input_tokens=await _prompt_tokens(http, chat)))


async def handle_input_tokens(http: web.Request) -> web.Response:
    """A Responses request's prompt (its stored conversation included), as `responses.create`
    would render it; only the fields that shape the prompt matter."""
    state = http.app[GATEWAY]
    body = await read_body(http, state.config.timeouts.client_body_s)
    chat = (await RESPONSES.decode(body, Edge.of(http, RESPONSES.name, request_id="", deadline_s=None), state)).chat
    return _json(InputTokens(input_tokens=await _prompt_tokens(http, chat)))


async def _prompt_tokens(http: web.Request, chat: ChatCompletionRequest) -> int:
    state = http.app[GATEWAY]
    model = state.model(chat.model)
    check_text_size(CHAT.text_chars(chat), model.engines.max_model_len(), model.max_chars_per_token)
    async with state.admitted(http.get(TENANT_KEY)):  # a render is work like any other
        prompts = await CHAT.render(model, chat, _encode(chat))
    return len(prompts[0])
