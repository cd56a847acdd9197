"""Who parses which name: onehop natively, or vLLM in-process on the vllm backend only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.app import create_app, resolve_parsers
from engine.backends.vllm_parsers import owners
from engine.config import EngineConfig
from derender.parsers import REASONING_PARSERS, TOOL_PARSERS, UnknownParser
from engine.state import ENGINE


def test_a_tool_name_onehop_lacks_is_refused_at_start_on_the_sim_backend(qwen3_tokenizer_dir: Path) -> None:
    config = EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir), reasoning_parser="qwen3", tool_parser="qwen3_json")
    with pytest.raises(UnknownParser) as refused:
        create_app(config)
    message = str(refused.value)
    assert "unknown tool parser 'qwen3_json' (configured)" in message
    assert f"known: {', '.join(sorted(TOOL_PARSERS))}" in message
    assert "vLLM" not in message  # only the vllm backend can fall back to vLLM's parsers


def test_a_reasoning_name_onehop_lacks_is_refused_at_start_on_the_hf_backend(qwen3_tokenizer_dir: Path) -> None:
    config = EngineConfig(backend="hf", model=str(qwen3_tokenizer_dir), reasoning_parser="step3", tool_parser=None)
    with pytest.raises(UnknownParser, match=f"known: {', '.join(sorted(REASONING_PARSERS))}$"):
        resolve_parsers(config)


def test_native_names_on_the_vllm_backend_do_not_import_vllm(qwen3_tokenizer_dir: Path) -> None:
    config = EngineConfig(backend="vllm", model=str(qwen3_tokenizer_dir), reasoning_parser="qwen3", tool_parser="hermes")
    resolved, why = resolve_parsers(config)
    assert (resolved.reasoning_parser, resolved.tool_parser, why) == ("qwen3", "hermes", "configured")
    assert "vllm" not in sys.modules


def test_capabilities_name_onehop_for_native_parsers(qwen3_tokenizer_dir: Path) -> None:
    app = create_app(EngineConfig(backend="sim", model=str(qwen3_tokenizer_dir)))
    assert app[ENGINE].parsers() == {"qwen3": "onehop", "hermes": "onehop"}


@pytest.mark.parametrize(
    ("reasoning", "tool", "expected"),
    [
        ("qwen3", "hermes", {"qwen3": "onehop", "hermes": "onehop"}),
        # onehop's reasoning stage, vLLM's tool parser after it
        ("qwen3", "qwen3_json", {"qwen3": "onehop", "qwen3_json": "vllm"}),
        (None, "granite", {"granite": "vllm"}),
        # vLLM's reasoning: vLLM parses the pair, onehop's tool parsers need marker ids
        ("step3", "hermes", {"step3": "vllm", "hermes": "vllm"}),
        ("ernie45", None, {"ernie45": "vllm"}),
        (None, None, {}),
    ],
)
def test_owners(reasoning: str | None, tool: str | None, expected: dict[str, str]) -> None:
    assert owners(reasoning, tool) == expected
