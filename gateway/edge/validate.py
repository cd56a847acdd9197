"""Refuse, by name, request fields the gateway does not honour (never ignore them silently)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from msgspec import UNSET

from wire.grammar_limits import GrammarTooLarge, check_grammar
from wire.openai_schema import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest, too_deep
from wire.protocol import ProtocolError, StructuredOutputs
from gateway.config import Limits
from gateway.upstream.engine_request import structured_outputs
from gateway.edge.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest

_encode_json = msgspec.json.Encoder().encode
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
"""OpenAI's bounds of `metadata` (chat and Responses): a stored response keeps it."""

# (field, test that it asks for something unsupported, why)
_Rule = tuple[str, Callable[[Any], bool], str]

_COMMON: list[_Rule] = [
    ("use_beam_search", lambda r: r.use_beam_search, "beam search is not supported"),
    ("prompt_logprobs", lambda r: r.prompt_logprobs is not None, "prompt_logprobs are not supported"),
    ("logprob_token_ids", lambda r: r.logprob_token_ids is not None, "logprob_token_ids is not supported"),
    ("kv_transfer_params", lambda r: r.kv_transfer_params is not None, "kv_transfer_params is set by the gateway"),
    ("vllm_xargs", lambda r: r.vllm_xargs is not None, "vllm_xargs is not supported"),
    ("repetition_detection", lambda r: r.repetition_detection is not None, "repetition_detection is not supported"),
    ("thinking_token_budget", lambda r: r.thinking_token_budget is not None, "thinking_token_budget is not supported"),
]
_CHAT: list[_Rule] = [
    ("echo", lambda r: r.echo, "echo is not supported for chat"),
    ("chat_template", lambda r: r.chat_template is not None, "a per-request chat template is not accepted"),
    ("documents", lambda r: r.documents is not None, "documents are not supported"),
    ("messages", lambda r: _has_media(r), "only text message content is supported"),
    ("tool_choice", lambda r: _tool_choice_without_tools(r), "tool_choice needs tools"),
    (
        "tool_choice",
        lambda r: _named(r) and r.tool_choice.function.name not in _tool_names(r),
        "the named function is not among the tools",
    ),
    (
        "response_format",
        lambda r: _forced_call(r) and _constrained(r),
        "a forced tool call (tool_choice 'required' or named) cannot be combined with structured outputs",
    ),
    ("functions", lambda r: r.functions is not None, "the legacy functions field is not supported: send tools"),
    (
        "function_call",
        lambda r: r.function_call is not None,
        "the legacy function_call field is not supported: send tool_choice",
    ),
    ("audio", lambda r: r.audio is not None, "audio output is not supported"),
    ("modalities", lambda r: r.modalities not in (None, ["text"]), "only the text modality is supported"),
    ("prediction", lambda r: r.prediction is not None, "predicted outputs are not supported"),
    ("verbosity", lambda r: r.verbosity is not None, "verbosity is not supported"),
    ("web_search_options", lambda r: r.web_search_options is not None, "web search is not supported"),
]
_COMPLETION: list[_Rule] = [
    ("suffix", lambda r: r.suffix is not None, "suffix is not supported"),
    ("prompt_embeds", lambda r: r.prompt_embeds is not None, "prompt_embeds are not supported"),
    ("best_of", lambda r: r.best_of not in (None, 1), "best_of is not supported"),
]


def _forced_call(request: ChatCompletionRequest) -> bool:
    return bool(request.tools) and (request.tool_choice == "required" or _named(request))


def _constrained(request: ChatCompletionRequest) -> bool:
    response_format = request.response_format
    return request.structured_outputs is not None or (
        response_format is not None and response_format.get("type", "text") != "text"
    )


def _named(request: ChatCompletionRequest) -> bool:
    choice = request.tool_choice
    return choice is not UNSET and not isinstance(choice, str) and choice is not None


def _tool_names(request: ChatCompletionRequest) -> set[str]:
    return {tool.function.name for tool in request.tools or ()}


def _tool_choice_without_tools(request: ChatCompletionRequest) -> bool:
    return not request.tools and (request.tool_choice == "required" or _named(request))


def _has_media(request: ChatCompletionRequest) -> bool:
    for message in request.messages:
        if isinstance(message.content, list):
            for part in message.content:
                if part.type not in (UNSET, "text") or part.text is UNSET:
                    return True
    return False


def _check_depths(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Every free-form JSON value of the request is at most MAX_JSON_DEPTH deep (a 400 naming it)."""
    name = too_deep(request)
    if name is not None:
        raise InvalidRequest(f"{name} nests deeper than {MAX_JSON_DEPTH} levels", param=name)


def _apply(rules: list[_Rule], request: Any) -> None:
    for name, asks, why in rules:
        if asks(request):
            raise InvalidRequest(f"{name}: {why}", param=name)


def _check_counts(n: int | None, top_logprobs: int | None) -> None:
    if n is not None and not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}", param="top_logprobs"
        )


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds, with words like OpenAI's."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"Invalid 'metadata': too many properties. Expected an object with at most {MAX_METADATA_PAIRS} "
            f"properties, but got an object with {len(metadata)} properties instead.",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequest(
                f"Invalid 'metadata': key too long. Expected keys of at most {MAX_METADATA_KEY_CHARS} characters, "
                f"but got a key of {len(key)} characters instead.",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"Invalid 'metadata.{key}': string too long. Expected a string of at most {MAX_METADATA_VALUE_CHARS} "
                f"characters, but got a string of {len(value)} characters instead.",
                param="metadata",
            )


def check_chat(request: ChatCompletionRequest) -> None:
    _check_depths(request)
    check_metadata(request.metadata)
    _apply(_COMMON + _CHAT, request)
    if not request.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    _check_counts(request.n, request.top_logprobs)
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")


def check_completion(request: CompletionRequest) -> None:
    _check_depths(request)
    _apply(_COMMON + _COMPLETION, request)
    _check_counts(request.n, request.logprobs)


def _check_max_tokens(value: int | None, field: str, limits: Limits) -> None:
    if value is not None and limits.max_tokens is not None and value > limits.max_tokens:
        raise InvalidRequest(f"{field} must be at most {limits.max_tokens} on this gateway, got {value}", param=field)


def _check_n(n: int | None, limits: Limits) -> None:
    if n is not None and n > limits.max_n:
        raise InvalidRequest(f"n must be at most {limits.max_n} on this gateway, got {n}", param="n")


def check_chat_limits(request: ChatCompletionRequest, limits: Limits) -> None:
    """The operator's limits (gateway config), on top of what the API allows."""
    _check_n(request.n, limits)
    _check_max_tokens(request.max_tokens, "max_tokens", limits)
    _check_max_tokens(request.max_completion_tokens, "max_completion_tokens", limits)
    if len(request.messages) > limits.max_messages:
        raise InvalidRequest(
            f"messages holds {len(request.messages)} messages, at most {limits.max_messages} are accepted",
            param="messages",
        )
    _check_grammar(request, limits)


def _check_grammar(request: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    """The constraint an engine would compile keeps `limits.grammar`: one past it can crash
    the engine's grammar library, so it is refused here and never sent (issue #27)."""
    given = structured_outputs(request.structured_outputs, getattr(request, "response_format", None))
    if given is None:
        return
    try:
        constraint = msgspec.convert(given, StructuredOutputs)
    except (msgspec.ValidationError, ProtocolError):
        return  # malformed: refused by name when the sampling parameters are checked
    try:
        check_grammar(constraint, limits.grammar)
    except GrammarTooLarge as exc:
        param = "response_format" if given is not request.structured_outputs else "structured_outputs"
        raise InvalidRequest(str(exc), param=param) from exc


def prompt_count(request: CompletionRequest) -> int:
    prompt = request.prompt
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


def check_completion_limits(request: CompletionRequest, limits: Limits) -> None:
    _check_n(request.n, limits)
    _check_grammar(request, limits)
    _check_max_tokens(request.max_tokens, "max_tokens", limits)
    prompts = prompt_count(request)
    if prompts > limits.max_prompts:
        raise InvalidRequest(
            f"prompt holds {prompts} prompts, at most {limits.max_prompts} are accepted", param="prompt"
        )


def check_buffered_answer(
    *, n: int | None, max_tokens: int | None, top_logprobs: int, prompts: int, max_model_len: int | None, most: int
) -> None:
    """A non-streamed answer is held whole: its size, n × max_tokens × (1 + top_logprobs) per
    prompt, is bounded before any generation (`limits.max_buffered_tokens`). Without
    max_tokens the engines' context is the bound; unknown, the answer's bytes still are."""
    tokens = max_tokens if max_tokens is not None else max_model_len
    if tokens is None:
        return
    size = prompts * (n or 1) * tokens * (1 + top_logprobs)
    if size > most:
        said = (
            f"max_tokens={max_tokens}" if max_tokens is not None else f"max_tokens (not given: the context, {tokens})"
        )
        shape = f"n={n or 1} × {said} × (1 + top_logprobs={top_logprobs})" + (
            f" × {prompts} prompts" if prompts > 1 else ""
        )
        raise InvalidRequest(
            f"a non-streamed answer of {shape} = {size} tokens is over limits.max_buffered_tokens={most}"
            " on this gateway: stream it (stream: true), or lower n, max_tokens or top_logprobs",
            param="max_tokens",
        )


def check_token_ids(sampling: dict[str, Any], vocab_size: int) -> None:
    """Token ids the request names (`logit_bias` keys, `allowed_token_ids`, `stop_token_ids`)
    exist in the model's vocabulary: a 400 naming the field, not a silent no-op."""
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        ids = sampling.get(name)
        for token_id in ids or ():
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(
                    f"{name}: token id {token_id} is not in the vocabulary (0..{vocab_size - 1})", param=name
                )


def check_text_size(chars: int, max_model_len: int | None, max_chars_per_token: int) -> None:
    """Before render: text that cannot fit the context in any tokenization is refused
    without tokenizing it (vLLM's `_text_len_check`: at most `max_model_len` tokens of the
    vocabulary's longest token each)."""
    if max_model_len is None:
        return
    most = max_model_len * max_chars_per_token
    if chars > most:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{chars} characters (more than {most} characters, which is the upper bound for {max_model_len} "
            "input tokens). Please reduce the length of the input prompt.",
            param="messages",
            code=CONTEXT_LENGTH_EXCEEDED,
        )


def chat_text_chars(request: ChatCompletionRequest) -> int:
    """Characters of text that reach the chat template: the rendered prompt holds at least
    these. Every field the template reads counts (tool names, descriptions and schemas,
    `chat_template_kwargs`; the Responses API's `instructions` and the Messages API's
    `system` arrive here as system messages): a 15 MB tool description left out once peaked
    the gateway at 2.1 GB in render."""
    total = 0
    for message in request.messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.text) for part in content if isinstance(part.text, str))
        total += _length(message.name) + _length(message.reasoning) + _length(message.tool_call_id)
        for call in message.tool_calls or ():
            total += len(call.function.name) + len(call.function.arguments or "")
    for tool in request.tools or ():
        function = tool.function
        total += len(function.name) + _length(function.description)
        if function.parameters is not None:
            total += len(_encode_json(function.parameters))
    if request.chat_template_kwargs:
        total += len(_encode_json(request.chat_template_kwargs))
    return total


def _length(text: object) -> int:
    return len(text) if isinstance(text, str) else 0


def completion_text_chars(request: CompletionRequest) -> int:
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(item) for item in prompt if isinstance(item, str))
    return 0


def check_context(prompts: list[Sequence[int]], max_model_len: int | None) -> None:
    """As vLLM 0.32 checks: a prompt that fills the model's context (as the engines report
    it) is refused, in the words OpenAI and vLLM use (clients look for them to fall back to
    a larger model); a `max_tokens` over what the prompt leaves is capped by the engine, as
    vLLM's `get_max_tokens` caps it."""
    if max_model_len is None:
        return
    for prompt in prompts:
        if len(prompt) >= max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
                f"{len(prompt)} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                param="messages",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
