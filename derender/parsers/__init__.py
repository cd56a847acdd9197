"""Reasoning and tool-call parsers: the interface (`base`), the families, and their registry."""

from derender.parsers.base import ParseOptions, ToolDelta, ToolSchema, UnknownParser, new_tool_call_id
from derender.parsers.choice import ChoiceParser, ParserSet, bind_parsers, bind_reasoning, check_tool_markers
from derender.parsers.registry import REASONING_PARSERS, TOOL_PARSERS, reasoning_factory, tool_factory

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChoiceParser",
    "ParseOptions",
    "ParserSet",
    "ToolDelta",
    "ToolSchema",
    "UnknownParser",
    "bind_parsers",
    "bind_reasoning",
    "check_tool_markers",
    "new_tool_call_id",
    "reasoning_factory",
    "tool_factory",
]
