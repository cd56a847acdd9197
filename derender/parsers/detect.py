"""`auto` parser names: the family read from the model folder, as vLLM users would name it.

The evidence, in the order it is trusted: the tokenizer's added tokens (a
family's markers are tokens of its own), the chat template (how it writes
calls), then `config.json`'s `model_type` and `architectures`. The names are
vLLM's `--reasoning-parser` / `--tool-call-parser` names, whether or not onehop
implements them natively (the vllm backend can serve the rest through vLLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What detection reads from a model (or tokenizer) folder."""

    model_type: str = ""
    architectures: tuple[str, ...] = ()
    added_tokens: frozenset[str] = frozenset()
    chat_template: str = ""


@dataclass(frozen=True, slots=True)
class Detected:
    reasoning: str | None
    tool: str | None
    why: str


def read_facts(folder: str | Path) -> ModelFacts:
    root = Path(folder)
    config = _json(root / "config.json")
    tokenizer_config = _json(root / "tokenizer_config.json")
    tokenizer = _json(root / "tokenizer.json")
    added = {str(t.get("content", "")) for t in tokenizer.get("added_tokens", []) if isinstance(t, dict)}
    decoder = tokenizer_config.get("added_tokens_decoder", {})
    if isinstance(decoder, dict):
        added |= {str(t.get("content", "")) for t in decoder.values() if isinstance(t, dict)}
    template = tokenizer_config.get("chat_template", "")
    if not isinstance(template, str):
        template = ""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return ModelFacts(
        model_type=str(config.get("model_type", "")),
        architectures=tuple(str(a) for a in config.get("architectures", []) or []),
        added_tokens=frozenset(added),
        chat_template=template,
    )


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def detect(facts: ModelFacts) -> Detected:
    """The (reasoning, tool) family of a model; (None, None) when nothing is recognised."""
    tokens, template, kind = facts.added_tokens, facts.chat_template, facts.model_type
    think = "<think>" in tokens and "</think>" in tokens
    if ("<|channel|>" in tokens and "<|message|>" in tokens) or kind == "gpt_oss":
        return Detected("openai_gptoss", "openai", "Harmony tokens (<|channel|>, <|message|>)")
    if "<｜tool▁calls▁begin｜>" in tokens:
        tool = "deepseek_v3" if "function<｜tool▁sep｜>" in template else "deepseek_v31"
        return Detected("deepseek_r1" if "<think>" in template else None, tool, "DeepSeek tool-call tokens")
    if "<|tool_calls_section_begin|>" in tokens or kind == "kimi_k2":
        return Detected("kimi_k2" if think else None, "kimi_k2", "Kimi tool-call section tokens")
    if "<minimax:tool_call>" in tokens or kind == "minimax_m2":
        return Detected("minimax_m2", "minimax_m2", "MiniMax <minimax:tool_call> token")
    if "<arg_key>" in tokens or kind in ("glm4_moe", "glm4_moe_lite"):
        return Detected("glm45" if think else None, "glm47", "GLM <arg_key> tokens")
    if "[TOOL_CALLS]" in tokens:
        return Detected("mistral" if "[THINK]" in tokens else None, "mistral", "Mistral [TOOL_CALLS] token")
    if kind == "llama4":
        return Detected(None, "llama4_pythonic", "model_type llama4")
    if kind == "llama" and "<|python_tag|>" in tokens:
        return Detected(None, "llama3_json", "Llama 3 <|python_tag|> token")
    reasoning = "qwen3" if think else None
    if "<tool_call>" in tokens and "<function=" in template:
        return Detected(reasoning, "qwen3_coder", "<tool_call> token and a <function=...> chat template")
    if "<tool_call>" in tokens:
        return Detected(reasoning, "hermes", "<tool_call> token with JSON calls in the chat template")
    return Detected(reasoning, None, "<think> tokens" if think else "no known parser markers")


def resolve(folder: str | Path, reasoning: str | None, tool: str | None) -> Detected:
    """Replace `auto` in either name by what the folder shows; explicit names stay."""
    if reasoning != AUTO and tool != AUTO:
        return Detected(reasoning, tool, "configured")
    found = detect(read_facts(folder))
    return Detected(
        found.reasoning if reasoning == AUTO else reasoning,
        found.tool if tool == AUTO else tool,
        f"auto {' and '.join(k for k, v in (('reasoning', reasoning), ('tool', tool)) if v == AUTO)}: {found.why}",
    )
