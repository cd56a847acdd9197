"""The derender route on a stock vLLM ≥ 0.33 engine: its own non-streaming derender form.

vLLM 0.33's `/inference/v1/generate` parses the output itself when asked
`output_mode: "derender"` with the `parse_context` its `/render` fills, and
answers a `GenerateDerenderResponse` (the parsed message per choice, beside
the generate fields). It never streams that form (`stream: true` is a 400),
so streaming requests to such an engine keep the text and tokens routes.

Here the gateway, which renders itself, fills `parse_context` as vLLM's
`/render` would from the same chat request, and turns the answer into the
OpenAI `ChatCompletion` the client gets (its id, model name and time).
"""

from __future__ import annotations

import re
from typing import Any

from msgspec import UNSET

from derender.chat import ReasoningField
from wire.openai_schema import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    Usage,
)
from wire.protocol import (
    EngineError,
    GenerateDerenderChoice,
    ParseContext,
    ProtocolError,
    decode_generate_derender_response,
)
from gateway.edge.errors import EngineFailed
from gateway.routing.policy import RequestFeatures

SINCE = (0, 33)
"""The first vLLM release whose generate API serves `output_mode: "derender"`."""
_VERSION = re.compile(r"(\d+)\.(\d+)")


def serves_derender(version: str) -> bool:
    """Whether a vLLM server that reports `version` (its `/version`) has the derender form.
    A version that does not read as a release (`dev`) is taken as older: the text and tokens
    routes work on every vLLM with scale-out."""
    found = _VERSION.match(version)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= SINCE


def serves(features: RequestFeatures) -> bool:
    """Whether vLLM's derender form can answer this request: a chat, not streamed, whose
    tool choice is not forced (onehop forces a call with an opening appended to the prompt,
    which vLLM's parser would not know to expect)."""
    return features.endpoint == "chat" and not features.stream and not features.forced_tool


def parse_context(request: ChatCompletionRequest) -> ParseContext:
    """`parse_context` as vLLM 0.33's `/render` builds it from the chat request."""
    return ParseContext(
        tools=request.tools,
        tool_choice=request.effective_tool_choice(),
        parallel_tool_calls=request.parallel_tool_calls,
        include_reasoning=request.include_reasoning,
        chat_template_kwargs=template_kwargs(request),
        history_tool_call_cnt=history_tool_calls(request),
    )


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """The kwargs the gateway rendered the prompt with, in vLLM's merge: the request's own,
    then the request fields vLLM passes to the template (a null one is left out). No
    `enable_thinking` is derived from `reasoning_effort`: the gateway's render does not."""
    kwargs = dict(request.chat_template_kwargs or {})
    kwargs["add_generation_prompt"] = request.add_generation_prompt
    kwargs["continue_final_message"] = request.continue_final_message
    if request.documents is not None:
        kwargs["documents"] = request.documents
    return kwargs


def history_tool_calls(request: ChatCompletionRequest) -> int:
    """Tool calls the assistant already made in the conversation (vLLM numbers new ids after them)."""
    return sum(len(m.tool_calls or ()) for m in request.messages if m.role == "assistant")


def chat_completion(
    raw: bytes,
    *,
    response_id: str,
    model: str,
    created: int,
    reasoning_field: ReasoningField,
    return_token_ids: bool,
) -> ChatCompletion:
    """The engine's `GenerateDerenderResponse` as the client's `ChatCompletion`."""
    try:
        answer = decode_generate_derender_response(raw)
    except (EngineError, ProtocolError) as exc:
        raise EngineFailed(f"the engine sent an invalid derender answer: {exc}") from exc
    prompt = answer.usage.prompt_tokens if answer.usage is not None else 0
    completion = sum(len(c.token_ids or ()) for c in answer.choices)
    usage = answer.usage or Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return ChatCompletion(
        id=response_id,
        created=created,
        model=model,
        choices=[_choice(c, reasoning_field, return_token_ids) for c in answer.choices],
        usage=usage,
        prompt_token_ids=answer.prompt_token_ids,
        kv_transfer_params=answer.kv_transfer_params,
    )


def _choice(
    choice: GenerateDerenderChoice, reasoning_field: ReasoningField, return_token_ids: bool
) -> ChatCompletionChoice:
    return ChatCompletionChoice(
        index=choice.index,
        message=_message(choice.message, reasoning_field),
        logprobs=choice.logprobs,
        finish_reason=choice.finish_reason or "stop",
        stop_reason=choice.stop_reason,
        token_ids=choice.token_ids if return_token_ids else None,
    )


def _message(message: ChatCompletionMessage, reasoning_field: ReasoningField) -> ChatCompletionMessage:
    """vLLM's message, with the reasoning under the name this model's clients read."""
    reasoning = message.reasoning if isinstance(message.reasoning, str) else None
    if reasoning_field != "reasoning":
        message.reasoning_content = reasoning
        if reasoning_field == "reasoning_content":
            message.reasoning = UNSET
    if not message.tool_calls:
        message.tool_calls = UNSET
    return message
