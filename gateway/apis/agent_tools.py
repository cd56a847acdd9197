"""The Responses API's tools as chat function tools, and the model's calls back as Responses items.

Coding agents declare more than function tools (Codex CLI 0.171 sends all of these by default):

- `namespace`: function or custom tools grouped under a name (`multi_agent_v1`). Each inner tool
  is one chat function named `<namespace>__<name>`: vLLM 0.33 flattens them so, and the name
  keeps to the `[A-Za-z0-9_-]{1,64}` every chat template and tool parser takes as an
  identifier (a `.` or `/` is not safe in all of them). Its description starts with the
  namespace's own. The model's call comes back as a `function_call` (or `custom_tool_call`)
  with the plain `name` and its `namespace`, which is how Codex finds the tool.
- `custom`: a tool whose input is free text (`apply_patch` with a Lark grammar). The model is
  offered a function with one string parameter, `input`; its call comes back as a
  `custom_tool_call` item with that text as `input`. A `grammar` format must compile (llguidance,
  as the engines use it) and is shown to the model in the description; a forced custom tool's
  grammar is enforced while decoding where the engines can (`forced_constraint`).
- Tools only OpenAI's servers run or answer with their own item types (`web_search`,
  `file_search`, `code_interpreter`, `image_generation`, `mcp`, `computer_use_preview`,
  `local_shell`, `shell`, `apply_patch`, ...): a self-hosted model cannot call them. They are
  left out (`agents.hosted_tools: drop`, counted by type) or refused (`refuse`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from msgspec import UNSET, Struct

from wire.grammar_limits import GrammarLimits, GrammarTooLarge, check_grammar
from wire.openai_schema import ChatTool, FunctionDefinition
from wire.protocol import Callee, StructuredOutputs
from gateway.edge.errors import InvalidRequest

HostedTools = Literal["drop", "refuse"]

HOSTED_TYPES = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "mcp", "computer", "computer_use_preview",
    "local_shell", "shell", "apply_patch", "tool_search", "programmatic_tool_calling",
})
"""OpenAI's built-in tool types (the `openai` SDK's `Tool` union): run by OpenAI's servers, or
answered by OpenAI's models with item types of their own (`local_shell_call`, ...) that a
self-hosted model does not write. Also the bounded set of `dropped_tools` metric labels."""

SEPARATOR = "__"
"""Between a namespace and its tool's name in the flattened name (vLLM 0.33's choice)."""

FREE_TEXT = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's whole input, as free text."}},
    "required": ["input"],
}
"""A custom tool's parameters as the model sees them."""


class CustomFormat(Struct, kw_only=True, omit_defaults=True):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    def __post_init__(self) -> None:
        if self.type == "grammar" and (self.syntax is None or self.definition is None):
            raise ValueError("a grammar format needs `syntax` and `definition`")


class Tool(Struct, kw_only=True, omit_defaults=True):
    """One entry of `tools`, any type; a built-in tool's other fields are not read."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: CustomFormat | None = None  # custom
    tools: list[Tool] | None = None  # namespace

    def __post_init__(self) -> None:
        if self.type not in _NAMED and self.type not in HOSTED_TYPES:
            raise ValueError(f"tools of type '{self.type}' are not supported")
        if self.type in _NAMED and not self.name:
            raise ValueError(f"a {self.type} tool needs `name`")


_NAMED = frozenset({"function", "custom", "namespace"})


@dataclass(slots=True)
class AgentTools:
    """The request's tools as the chat request offers them, and the way back."""

    chat: list[ChatTool] = field(default_factory=list)
    callees: dict[str, Callee] = field(default_factory=dict)
    """Flattened names that are not plain function names."""

    def callee(self, flat: str) -> Callee:
        return self.callees.get(flat) or Callee(flat)


def hosted_types(tools: list[Tool] | None) -> list[str]:
    """The built-in tools among `tools`, by type (each a bounded metric label)."""
    return [tool.type for tool in tools or () if tool.type in HOSTED_TYPES]


def flat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """The gateway's settings these tools follow (`agents.hosted_tools`, `limits.grammar`)."""

    hosted: HostedTools = "drop"
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    enforced: frozenset[str] = frozenset()
    """The structured-output kinds (`grammar`, `regex`) the model's engines enforce: a forced
    custom tool's grammar is then enforced while decoding (`forced_constraint`)."""


def checked_tools(tools: list[Tool] | None, policy: ToolPolicy) -> AgentTools:
    """The tools, every custom tool's grammar checked; raises InvalidRequest naming the tool
    (`tools[i]...`) that cannot be served."""
    result = agent_tools(tools, policy.hosted)
    for tool, where in _custom_tools(tools):
        form = tool.format
        if form is not None and form.type == "grammar":
            assert form.syntax is not None and form.definition is not None  # CustomFormat checks it
            check_custom_grammar(form.syntax, form.definition, f"{where}.format.definition", policy.grammar)
    return result


def _custom_tools(tools: list[Tool] | None) -> list[tuple[Tool, str]]:
    found = [(tool, f"tools[{i}]") for i, tool in enumerate(tools or ()) if tool.type == "custom"]
    for i, namespace in enumerate(tools or ()):
        if namespace.type == "namespace":
            found += [
                (tool, f"tools[{i}].tools[{j}]")
                for j, tool in enumerate(namespace.tools or ())
                if tool.type == "custom"
            ]
    return found


def agent_tools(tools: list[Tool] | None, hosted: HostedTools) -> AgentTools:
    """The tools as chat tools (grammars unchecked: see `checked_tools`); raises InvalidRequest
    naming the tool (`tools[i]...`) that cannot be served."""
    result = AgentTools()
    for index, tool in enumerate(tools or ()):
        where = f"tools[{index}]"
        if tool.type in HOSTED_TYPES:
            if hosted == "refuse":
                raise InvalidRequest(
                    f"tools of type '{tool.type}' run on OpenAI's servers and are not served here",
                    param=f"{where}.type",
                )
            continue  # left out; the endpoint counts it (`hosted_types`)
        if tool.type == "namespace":
            _add_namespace(result, tool, where)
        else:
            _add(result, tool, None, None, where)
    return result


def _add_namespace(result: AgentTools, namespace: Tool, where: str) -> None:
    if not namespace.tools:
        raise InvalidRequest(f"namespace '{namespace.name}' has no tools", param=f"{where}.tools")
    for index, tool in enumerate(namespace.tools):
        inner = f"{where}.tools[{index}]"
        if tool.type not in ("function", "custom"):
            raise InvalidRequest(
                f"a namespace holds function and custom tools, not '{tool.type}'", param=f"{inner}.type"
            )
        _add(result, tool, namespace.name, namespace.description, inner)


def _add(result: AgentTools, tool: Tool, namespace: str | None, about: str | None, where: str) -> None:
    assert tool.name is not None  # Tool checks it
    flat = flat_name(tool.name, namespace)
    if any(chat.function.name == flat for chat in result.chat):
        raise InvalidRequest(f"tool names must be unique: '{flat}' is given twice", param=f"{where}.name")
    custom = tool.type == "custom"
    if custom or namespace:
        result.callees[flat] = Callee(tool.name, namespace, custom)
    description = _description(tool, namespace, about)
    parameters = FREE_TEXT if custom else tool.parameters
    strict = tool.strict if tool.strict is not None and not custom else UNSET
    result.chat.append(ChatTool(function=FunctionDefinition(flat, description, parameters, strict=strict)))


def _description(tool: Tool, namespace: str | None, about: str | None) -> str | None:
    parts = [f"({namespace}: {about})" if namespace and about else None, tool.description]
    form = tool.format
    if tool.type == "custom" and form is not None and form.type == "grammar":
        parts.append(f"The input must match this {form.syntax} grammar:\n{form.definition}")
    text = "\n\n".join(part for part in parts if part)
    return text or None


def check_custom_grammar(syntax: str, definition: str, param: str, limits: GrammarLimits) -> None:
    """A custom tool's grammar must compile: bounded first (`wire.grammar_limits`: what could
    crash the library never reaches it), then llguidance, as an engine would compile it."""
    constraint = StructuredOutputs(grammar=definition) if syntax == "lark" else StructuredOutputs(regex=definition)
    try:
        check_grammar(constraint, limits)
    except GrammarTooLarge as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from exc
    if error := _compile_error(syntax, definition):
        raise InvalidRequest(f"{param}: the {syntax} grammar does not compile: {error}", param=param)


@lru_cache(maxsize=64)  # agents send the same grammar on every turn
def _compile_error(syntax: str, definition: str) -> str | None:
    from wire.grammar_compile import GrammarError, compile_grammar  # llguidance, only when a grammar comes

    constraint = StructuredOutputs(grammar=definition) if syntax == "lark" else StructuredOutputs(regex=definition)
    try:
        compile_grammar(constraint)
    except GrammarError as exc:
        return str(exc).split(": ", 1)[-1]
    return None


def custom_arguments(text: str) -> str:
    """A custom tool call sent back (`custom_tool_call` input item) as the chat call's arguments."""
    return json.dumps({"input": text}, ensure_ascii=False)


GRAMMAR_KINDS = {"lark": "grammar", "regex": "regex"}
"""A custom tool's grammar syntax → the structured-output kind that enforces it."""


def forced_constraint(
    tools: list[Tool] | None, name: str, namespace: str | None, enforced: frozenset[str]
) -> dict[str, str] | None:
    """`structured_outputs` that hold a forced custom tool's input to its grammar, when the
    engines enforce that kind; None for a tool without a grammar, or engines that do not.

    The turn is then decoded as text (the tool's input itself, after any reasoning) under
    the grammar, with no tool-call markup around it: inside a call the input would be a JSON
    string, which a Lark grammar cannot describe. The answer's text becomes the call."""
    form = _custom_format(tools, name, namespace)
    if form is None or form.type != "grammar" or form.syntax is None or form.definition is None:
        return None
    kind = GRAMMAR_KINDS[form.syntax]
    return {kind: form.definition} if kind in enforced else None


def _custom_format(tools: list[Tool] | None, name: str, namespace: str | None) -> CustomFormat | None:
    scope = tools or []
    if namespace is not None:
        scope = next((tool.tools or [] for tool in scope if tool.type == "namespace" and tool.name == namespace), [])
    return next((tool.format for tool in scope if tool.type == "custom" and tool.name == name), None)
