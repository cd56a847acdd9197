"""vLLM 0.33's `output_mode: "derender"`: a `parse_context` in, a `GenerateDerenderResponse` out.

A vLLM 0.33 `/render` sends the slim `parse_context` (tools, tool_choice,
include_reasoning, chat_template_kwargs, ...) instead of the chat request, and
its clients read the parsed assistant message beside the generate fields.
Here that context becomes a message-less chat request, as vLLM's own
`ParseContext.to_chat_request` does, so the choices run through the very same
per-choice derender (`derender.chat`) as onehop's own derender form;
only the answer is shaped as vLLM's.

Non-streaming only, as in vLLM 0.33 (the contract refuses `stream: true`).
"""

from __future__ import annotations

import time
from typing import Any

from engine.backends.base import BackendOutput
from derender.chat import ChatChoiceState, ChatDerender, ChatOptions
from derender.text import TextParams
from derender.usage import derender_summary, open_choices
from engine.errors import BadRequest
from wire.openai_schema import ChatCompletionRequest, NamedToolChoice
from wire.protocol import (
    EngineSummary,
    GenerateDerenderChoice,
    GenerateDerenderResponse,
    GenerateRequest,
    ParseContext,
    encode,
)
from engine.writer_context import DataFrames, WriterContext, note_cached

FORM = "vllm"
"""The name of this derender form in the engine's capabilities (onehop's own is `onehop`)."""


def chat_request(context: ParseContext, logprobs: int | None) -> ChatCompletionRequest:
    """The message-less chat request the parsers read, as vLLM builds it from `parse_context`.

    Raises BadRequest (vLLM's words) for a named `tool_choice` that matches no tool, and for
    `required` or a named tool: onehop forces those by a call opening the gateway appends to
    the prompt, which a prompt from vLLM's `/render` does not have.
    """
    choice = context.tool_choice
    if isinstance(choice, NamedToolChoice) and not any(
        tool.function.name == choice.function.name for tool in context.tools or ()
    ):
        raise BadRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice) or choice == "required":
        raise BadRequest(
            "this engine parses tool_choice 'auto' and 'none' in vLLM's derender form; use onehop's"
            " chat_request form, or output_mode 'text', for 'required' or a named tool",
            param="tool_choice",
        )
    return ChatCompletionRequest(
        messages=[],
        tools=context.tools,
        # vLLM reads a null tool_choice as "not auto": no calls are kept.
        tool_choice=choice if choice is not None else "none",
        parallel_tool_calls=context.parallel_tool_calls,
        include_reasoning=context.include_reasoning,
        chat_template_kwargs=context.chat_template_kwargs,
        logprobs=logprobs is not None,
        top_logprobs=max(logprobs or 0, 0),
    )


def template_kwargs(request: GenerateRequest, context: ParseContext) -> dict[str, Any]:
    """`parse_context`'s template kwargs; /render's parser kwargs win, as in onehop's form."""
    kwargs = dict(context.chat_template_kwargs)
    if request.reasoning_parser_kwargs is not None:
        kwargs.update(request.reasoning_parser_kwargs.chat_template_kwargs)
    return kwargs


class VllmDerenderWriter(DataFrames):
    """The engine's writer for vLLM's derender form: nothing streams, the body is vLLM's answer."""

    def __init__(self, request: GenerateRequest, context: WriterContext, text: TextParams) -> None:
        assert context.vocab is not None
        self._request = request
        self._model = context.model
        parse = request.parse_context
        parsers = context.reasoning_parser is not None or context.tool_parser is not None
        if parse is None and parsers:
            raise BadRequest(  # vLLM 0.33's words
                "output_mode='derender' requires parse_context on a server with a tool or reasoning parser."
                " Use the one returned by /render.",
                param="parse_context",
            )
        sampling = request.sampling_params
        chat = chat_request(parse or ParseContext(), sampling.logprobs)
        options = ChatOptions.from_request(
            chat,
            reasoning_parser=context.reasoning_parser if parse is not None else None,
            tool_parser=context.tool_parser if parse is not None else None,
            reasoning_field="reasoning",  # vLLM's ChatMessage has only this one
            text=text,
            template_kwargs=template_kwargs(request, parse or ParseContext()),
        )
        self._include_reasoning = chat.include_reasoning
        self._derender = ChatDerender(
            context.vocab, options, model=context.model, n=sampling.n, prompt_token_ids=request.token_ids
        )
        self._kv_transfer_params: dict[str, Any] | None = None

    def head(self) -> list[bytes]:
        return []

    def open_choices(self) -> list[int]:
        return open_choices(self._derender)

    def summary(self) -> EngineSummary:
        return derender_summary(self._derender)

    def step(self, output: BackendOutput) -> bytes | None:
        if output.kv_transfer_params is not None:
            self._kv_transfer_params = output.kv_transfer_params
        note_cached(output, self._derender)
        if not self._derender.choices[output.index].finished:
            self._derender.step(
                output.index,
                output.token_ids,
                output.logprobs,
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
        return None  # nothing is streamed in this form

    def tail(self) -> list[bytes]:
        return []

    def body(self) -> bytes:
        request = self._request
        return encode(
            GenerateDerenderResponse(
                request_id=request.request_id,
                model=self._model,
                created=int(time.time()),
                usage=self._derender.usage(),
                choices=[self._choice(state) for state in self._derender.choices],
                prompt_token_ids=list(request.token_ids) if request.return_token_ids else None,
                kv_transfer_params=self._kv_transfer_params,
            )
        )

    def _choice(self, state: ChatChoiceState) -> GenerateDerenderChoice:
        made = state.choice()
        # As in vLLM: with the reasoning hidden, per-token data would reveal it.
        shown = self._include_reasoning
        logprobs = made.logprobs if self._request.sampling_params.logprobs is not None else None
        return GenerateDerenderChoice(
            index=made.index,
            message=made.message,
            logprobs=logprobs if shown else None,
            finish_reason=made.finish_reason or "stop",
            stop_reason=made.stop_reason,
            token_ids=state.token_ids if shown else None,
        )
