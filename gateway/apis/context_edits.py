"""Anthropic's `context_management` edits, applied to a Messages conversation before render.

Claude Code sends `{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}` on every
request. Anthropic applies the edits server-side, in the order given, to what the model sees;
the client keeps its full history. Two kinds are served:

- `clear_thinking_20251015`: thinking blocks are dropped from all but the last `keep` assistant
  turns (`"all"` keeps every one; Anthropic's default, when `keep` is absent, is one turn).
  An assistant turn is the run of assistant messages between two other messages.
- `clear_tool_uses_20250919`: once the prompt is over `trigger` (input tokens, default 100,000,
  or a number of tool uses), the results of all but the last `keep` tool uses (default 3) are
  replaced by a placeholder, oldest first, skipping `exclude_tools`; `clear_tool_inputs` also
  empties the calls' inputs (all, or those of the named tools); with `clear_at_least`, nothing
  is cleared unless at least that many tokens would be.

Input tokens are estimated (`CHARS_PER_TOKEN` characters of text per token), not counted: the
edits change what is rendered, so they run before render, and the gateway renders a request
once; an exact count would render every long conversation twice. The estimate only decides
when the trigger fires and is what `applied_edits` reports.

Any other edit type (`compact_20260112`, one newer than this gateway) is ignored and counted
(`onehop_gateway_context_edits_ignored_total`): the request is still served, unedited by it.
A malformed edit of a known type is a 400 naming its field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

CHARS_PER_TOKEN = 4
"""The usual ratio for English text and code: the estimate the tool-use trigger is checked with."""
CLEARED = "[tool result cleared to save context]"
"""What a cleared tool result says instead: the model learns the call happened and its output was removed."""
MAX_TYPE_LABELS = 16
"""Distinct ignored edit types counted under their own label; later ones count as `_other`."""
OTHER = "_other"
_NAMED = re.compile(r"Object (contains unknown field|missing required field) `([^`]*)`")
_WORDS = {"contains unknown field": "Extra inputs are not permitted", "missing required field": "Field required"}
"""Anthropic's words for them (pydantic's)."""

_Count = Annotated[int, Meta(ge=0)]


class ContextManagement(Struct, forbid_unknown_fields=True):
    # Each edit is decoded by its `type` (`decode_edits`), so that an unknown type is ignored, not refused.
    edits: list[dict[str, Any]] = []


class _Strict(Struct, forbid_unknown_fields=True, frozen=True, tag_field="type"):
    pass


class InputTokens(_Strict, tag="input_tokens", frozen=True):
    value: _Count


class ToolUses(_Strict, tag="tool_uses", frozen=True):
    value: _Count


class ThinkingTurns(_Strict, tag="thinking_turns", frozen=True):
    value: _Count


class AllTurns(_Strict, tag="all", frozen=True):
    pass


class ClearThinking(_Strict, tag="clear_thinking_20251015", kw_only=True, frozen=True):
    keep: ThinkingTurns | AllTurns | Literal["all"] = ThinkingTurns(1)

    @property
    def keeps_all(self) -> bool:
        return self.keep == "all" or isinstance(self.keep, AllTurns)


class ClearToolUses(_Strict, tag="clear_tool_uses_20250919", kw_only=True, frozen=True):
    trigger: InputTokens | ToolUses = InputTokens(100_000)
    keep: ToolUses = ToolUses(3)
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


Edit = ClearThinking | ClearToolUses
_KINDS: dict[str, type[Edit]] = {"clear_thinking_20251015": ClearThinking, "clear_tool_uses_20250919": ClearToolUses}


class AppliedEdit(Struct, tag_field="type", omit_defaults=True):
    """One entry of the answer's `context_management.applied_edits`, as Anthropic reports it."""

    cleared_input_tokens: int


class AppliedThinking(AppliedEdit, tag="clear_thinking_20251015"):
    cleared_thinking_turns: int


class AppliedToolUses(AppliedEdit, tag="clear_tool_uses_20250919"):
    cleared_tool_uses: int


class EditError(ValueError):
    """A malformed edit: `param` names the field (`context_management.edits[0].keep`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def decode_edits(config: ContextManagement) -> tuple[list[Edit], list[str]]:
    """The edits this gateway serves that change something, in order, and the types of those
    it ignores. Claude Code's (`clear_thinking_20251015` keeping all) changes nothing: left out,
    so its every request costs no edit pass."""
    edits: list[Edit] = []
    ignored: list[str] = []
    for i, raw in enumerate(config.edits):
        where = f"context_management.edits[{i}]"
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise EditError(f"{where}.type: Field required", f"{where}.type")
        if kind not in _KINDS:
            ignored.append(kind)
            continue
        try:
            edit = msgspec.convert(raw, _KINDS[kind])
        except msgspec.ValidationError as exc:
            text, _, at = str(exc).partition(" - at `$")
            path = where + at.rstrip("`")
            named = _NAMED.match(text)  # an unknown or missing field: the param is that field
            if named is not None:
                path, text = f"{path}.{named.group(2)}", _WORDS[named.group(1)]
            raise EditError(f"{path}: {text}", path) from exc
        if not (isinstance(edit, ClearThinking) and edit.keeps_all):
            edits.append(edit)
    return edits, ignored


@dataclass(frozen=True, slots=True)
class Plain:
    """What an edit needs of a block, without knowing the Messages structs (`gateway.apis.messages`
    adapts its blocks to this): the kind, the text it holds, and for tool blocks their link."""

    kind: Literal["thinking", "tool_use", "tool_result", "other"]
    chars: int = 0
    tool_id: str = ""
    name: str = ""


@dataclass
class Plan:
    """What to change: thinking dropped from these turns, these tool results (and inputs) cleared."""

    thinking_turns: set[int] = field(default_factory=set)
    cleared_results: set[str] = field(default_factory=set)
    cleared_inputs: set[str] = field(default_factory=set)
    applied: list[AppliedEdit] = field(default_factory=list)


def plan(edits: list[Edit], turns: list[tuple[str, list[Plain]]], other_chars: int) -> Plan:
    """The changes `edits` make to `turns` (role, blocks), in order; `other_chars` is the text
    outside the turns (system prompt, tool schemas) the trigger's estimate counts too."""
    result = Plan()
    for edit in edits:
        if isinstance(edit, ClearThinking):
            _clear_thinking(edit, turns, result)
        else:
            _clear_tool_uses(edit, turns, other_chars, result)
    return result


def tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)


def _clear_thinking(edit: ClearThinking, turns: list[tuple[str, list[Plain]]], result: Plan) -> None:
    keep = edit.keep
    if isinstance(keep, str | AllTurns):  # every turn's kept
        return
    assistant = [i for i, (role, _) in enumerate(turns) if role == "assistant"]
    older = assistant[: max(len(assistant) - keep.value, 0)]
    cleared = [i for i in older if i not in result.thinking_turns and any(b.kind == "thinking" for b in turns[i][1])]
    if not cleared:
        return
    result.thinking_turns.update(cleared)
    chars = sum(b.chars for i in cleared for b in turns[i][1] if b.kind == "thinking")
    result.applied.append(AppliedThinking(cleared_input_tokens=tokens(chars), cleared_thinking_turns=len(cleared)))


def _clear_tool_uses(edit: ClearToolUses, turns: list[tuple[str, list[Plain]]], other_chars: int, result: Plan) -> None:
    uses = [b for role, blocks in turns if role == "assistant" for b in blocks if b.kind == "tool_use"]
    if not _triggered(edit, turns, uses, other_chars, result):
        return
    excluded = set(edit.exclude_tools or ())
    older = uses[: max(len(uses) - edit.keep.value, 0)]
    chosen = [use for use in older if use.name not in excluded and use.tool_id not in result.cleared_results]
    if not chosen:
        return
    ids = {use.tool_id for use in chosen}
    inputs = edit.clear_tool_inputs
    clear_input = {use.tool_id for use in chosen if inputs is True or (isinstance(inputs, list) and use.name in inputs)}
    chars = sum(b.chars for _, blocks in turns for b in blocks if b.kind == "tool_result" and b.tool_id in ids)
    chars += sum(use.chars for use in chosen if use.tool_id in clear_input)
    if edit.clear_at_least is not None and tokens(chars) < edit.clear_at_least.value:
        return  # Anthropic: nothing is cleared unless at least this much can be
    result.cleared_results |= ids
    result.cleared_inputs |= clear_input
    result.applied.append(AppliedToolUses(cleared_input_tokens=tokens(chars), cleared_tool_uses=len(chosen)))


def _triggered(
    edit: ClearToolUses, turns: list[tuple[str, list[Plain]]], uses: list[Plain], other_chars: int, result: Plan
) -> bool:
    if isinstance(edit.trigger, ToolUses):
        return len(uses) > edit.trigger.value
    chars = other_chars
    for i, (_, blocks) in enumerate(turns):  # what earlier edits cleared no longer counts
        for block in blocks:
            if block.kind == "thinking" and i in result.thinking_turns:
                continue
            if block.kind == "tool_result" and block.tool_id in result.cleared_results:
                continue
            chars += block.chars
    return tokens(chars) > edit.trigger.value


@dataclass
class IgnoredEdits:
    """Edit types ignored so far in this process, each counted under a bounded label."""

    names: set[str] = field(default_factory=set)

    def label(self, kind: str) -> str:
        if len(kind) > 64 or not kind.isprintable():
            return OTHER
        if kind in self.names or len(self.names) < MAX_TYPE_LABELS:
            self.names.add(kind)
            return kind
        return OTHER
