"""Qwen3 support built offline: the tokenizer, its chat template and a tiny test model."""

from .fixtures import cache_dir, ensure_tiny_model, ensure_tokenizer
from .vocab import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    THINK_END_ID,
    THINK_START_ID,
    TOOL_CALL_END_ID,
    TOOL_CALL_START_ID,
    build_tokenizer,
)

__all__ = [
    "ENDOFTEXT_ID",
    "IM_END_ID",
    "IM_START_ID",
    "THINK_END_ID",
    "THINK_START_ID",
    "TOOL_CALL_END_ID",
    "TOOL_CALL_START_ID",
    "build_tokenizer",
    "cache_dir",
    "ensure_tiny_model",
    "ensure_tokenizer",
]
