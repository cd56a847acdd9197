"""Hugging Face chat templates rendered with jinja2 alone, as templates expect to be run.

Templates from a model folder are untrusted code written against what
transformers' `apply_chat_template` gives them, so this gives the same:
a sandboxed, immutable environment with `trim_blocks` and `lstrip_blocks`,
`{% break %}`/`{% continue %}`, a `{% generation %}` block (rendered as its
body: the gateway needs no assistant masks), `raise_exception`,
`strftime_now`, a `tojson` filter that keeps non-ASCII text and takes
`indent`, `separators` and `sort_keys`, and `dict`/`namespace` globals that
cannot reach object internals. The variables are `messages` (keys whose value
is null dropped; a message's reasoning offered as `reasoning_content` and
`thinking`, whichever name the template reads), `tools`, `documents`,
`add_generation_prompt`, the folder's special tokens, and the request's
`chat_template_kwargs` over them.

`continue_final_message` renders the final message with a marker after its
text and cuts the output there, so the prompt ends inside that message.

Any failure while rendering is the request's doing (a role the template
refuses, a field it needs) and is raised as `ChatTemplateError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""A message's reasoning under the names templates read; the first is the standard one."""
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "
"""Appended to the final message's text; where it lands in the output is where the prompt ends.
(transformers' own marker, so that a template sees the same text either way.)"""
RESERVED_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
        "chat_template", "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
        "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens",
    }
)  # fmt: skip
"""Render options, not template variables: `chat_template_kwargs` may not set them."""


class ChatTemplateError(Exception):
    """The template could not render these messages (or no template applies)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
    renders its body unchanged."""

    # jinja declares `tags` a plain attribute of Extension, so ClassVar would clash with its type.
    tags = {"generation"}  # noqa: RUF012

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, and nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """A `namespace()` whose attributes may not start with an underscore (no route to internals)."""

    # No `self` parameter: jinja's own signature, so `namespace(self=...)` works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; prompts need the text as written.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # `format`: the name templates call it with
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled template; `render` is safe to call from several threads at once."""

    def __init__(self, source: str) -> None:
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        special_tokens: Mapping[str, str] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        chat = _template_messages(messages)
        reserved = sorted(RESERVED_KWARGS.intersection(kwargs or {}))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        variables = {**(special_tokens or {}), **(kwargs or {})}
        final = self._mark_final(chat) if continue_final_message else None
        try:
            text = self._template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as exc:  # template code can fail any way (a raise_exception, a bad comparison, a missing key)
            raise ChatTemplateError(str(exc) or type(exc).__name__) from exc
        return text if final is None else _cut_after(text, final)

    def _mark_final(self, chat: list[dict[str, Any]]) -> str:
        """Append the marker to the final message's text; the text it was, to check for after rendering."""
        content = chat[-1].get("content")
        if content is None:
            raise ChatTemplateError("continue_final_message is set but the final message has no content to continue")
        if "content" not in self.source:
            raise ChatTemplateError("continue_final_message is set but the chat template does not read message content")
        if isinstance(content, str):
            chat[-1]["content"] = content + _CONTINUE_MARK
            return content
        for index in range(len(content) - 1, -1, -1):
            block = content[index]
            if isinstance(block, dict) and "text" in block:
                content[index] = {**block, "text": block["text"] + _CONTINUE_MARK}
                return str(block["text"])
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fresh dicts for the template: null values dropped (many templates print `None` or fail on
    them but handle a missing key), reasoning under every name a template may read."""
    if not messages:
        raise ChatTemplateError("there are no messages to render")
    chat = []
    for message in messages:
        plain = {key: _copy(value) for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in REASONING_FIELDS if plain.get(key) is not None), None)
        chat.append(plain if reasoning is None else {"thinking": reasoning, **plain, "reasoning_content": reasoning})
    return chat


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


def _cut_after(text: str, final: str) -> str:
    """The output up to the marker; if the template trimmed the message's trailing space, trimmed too."""
    mark = _CONTINUE_MARK.strip()
    if final.strip() not in text or mark not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template changed the final message's text")
    at = text.rindex(mark)
    return text[:at] if text[at : at + len(_CONTINUE_MARK)] == _CONTINUE_MARK else text[:at].rstrip()


def pick_template(templates: Mapping[str, ChatTemplate], *, tools: bool) -> ChatTemplate:
    """The template a request renders with: `tool_use` for requests with tools where the folder has one."""
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if not templates:
        raise ChatTemplateError("the model folder has no chat template")
    raise ChatTemplateError(
        f"the model folder has several chat templates and none is named default: {', '.join(sorted(templates))}"
    )
