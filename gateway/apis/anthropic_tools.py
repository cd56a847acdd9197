"""Anthropic's tools that carry a `type`: client tools with predefined schemas, and server tools.

A client tool with a predefined schema (`bash_20250124`, `text_editor_*`, `memory_20250818`)
is run by the client like any other: only its schema is Anthropic's, and Claude models are
trained on it, so the request names no `input_schema`. A self-hosted model needs one, so it
gets a function tool with the tool's documented name and input fields; its calls come back as
`tool_use` blocks under that name, as Anthropic's do. Computer use is refused: it works from
screenshots, and media is not served.

Server tools (`web_search_*`, `web_fetch_*`, `code_execution_*`, tool search, MCP toolsets,
and any type this gateway does not know) run on Anthropic's servers; a self-hosted model cannot
call them. `agents.hosted_tools` says whether they are left out of the prompt (and counted) or
refused.
"""

from __future__ import annotations

import re
from typing import Any

_STRING = {"type": "string"}
_LINE = {"type": "integer", "description": "The line after which to insert the text (0: the start of the file)."}
_RANGE = {
    "type": "array",
    "items": {"type": "integer"},
    "minItems": 2,
    "maxItems": 2,
    "description": "The first and last line to show, from 1; a last line of -1 shows to the end.",
}

_BASH = (
    "Run a command in a persistent bash shell; its output is the result.",
    {
        "type": "object",
        "properties": {
            "command": {**_STRING, "description": "The bash command to run."},
            "restart": {"type": "boolean", "description": "Restart the shell instead of running a command."},
        },
    },
)


def _editor(commands: list[str]) -> tuple[str, dict[str, Any]]:
    return (
        "View, create and edit text files: `view` a file (with line numbers) or a directory, `create` a file, "
        "`str_replace` an exact, unique string, `insert` text after a line"
        + (", `undo_edit` the last edit." if "undo_edit" in commands else "."),
        {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": commands},
                "path": {**_STRING, "description": "The absolute path of the file or directory."},
                "file_text": {**_STRING, "description": "`create`: the new file's content."},
                "old_str": {**_STRING, "description": "`str_replace`: the text to replace, exactly as in the file."},
                "new_str": {
                    **_STRING,
                    "description": "`str_replace`: the text to put there; `insert`: the text to insert.",
                },
                "insert_line": _LINE,
                "view_range": _RANGE,
            },
            "required": ["command", "path"],
        },
    )


_MEMORY = (
    "A directory of memory files kept across conversations (under /memories): `view`, `create`, `str_replace`, "
    "`insert`, `delete` or `rename` them.",
    {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
            "path": _STRING,
            "view_range": _RANGE,
            "file_text": _STRING,
            "old_str": _STRING,
            "new_str": _STRING,
            "insert_line": _LINE,
            "insert_text": _STRING,
            "old_path": _STRING,
            "new_path": _STRING,
        },
        "required": ["command"],
    },
)

_WITH_UNDO = _editor(["view", "create", "str_replace", "insert", "undo_edit"])
_NO_UNDO = _editor(["view", "create", "str_replace", "insert"])
CLIENT_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "bash_20241022": _BASH,
    "bash_20250124": _BASH,
    "text_editor_20241022": _WITH_UNDO,  # named `str_replace_editor`
    "text_editor_20250124": _WITH_UNDO,  # named `str_replace_editor`
    "text_editor_20250429": _NO_UNDO,  # named `str_replace_based_edit_tool`
    "text_editor_20250728": _NO_UNDO,  # named `str_replace_based_edit_tool`; takes `max_characters`
    "memory_20250818": _MEMORY,
}
"""Type → (description, input schema). The names are the client's (`tools[i].name`), which
Anthropic fixes per type (`bash`, `str_replace_editor`, `str_replace_based_edit_tool`, `memory`)."""

HOSTED_FAMILIES = frozenset(
    {"web_search", "web_fetch", "code_execution", "tool_search_tool_regex", "tool_search_tool_bm25", "mcp_toolset"}
)
"""Server tools counted under their own label; any other type counts as `_other` (a bounded set)."""
OTHER = "_other"
_VERSION = re.compile(r"_\d{8}$")


def is_computer(kind: str) -> bool:
    return kind.startswith("computer_")


def hosted_label(kind: str) -> str:
    """The metric label of a server tool's type: its family (`web_search_20250305` → `web_search`)."""
    family = _VERSION.sub("", kind)
    return family if family in HOSTED_FAMILIES else OTHER
