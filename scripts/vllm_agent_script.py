"""A scripted agent model for stock vLLM: a logits processor (`--logits-processors
vllm_agent_script:AgentScript`, this folder on PYTHONPATH) that makes any Qwen3-format model
write one agent turn and end it, as onehop's sim backend does in agent mode:

- a prompt whose last user turn holds tool results: an answer quoting the last result;
- else, a prompt declaring one of the tools in $ONEHOP_AGENT_SCRIPT_CALLS (JSON: tool name ->
  arguments, tried in order): a Hermes `<tool_call>` of the first such tool;
- else a one-line answer.

Each turn is a short thinking block, then the text, then `<|im_end|>`. A random-weight model
never ends its answers (the agent CLIs ask up to 32000 tokens), so without this vLLM's answers
only show whether a request was accepted, not whether the CLI's next request (its tool
results) is. scripts/agent_compat.py uses it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import AutoTokenizer
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

CALLS_ENV = "ONEHOP_AGENT_SCRIPT_CALLS"
THINK = "<think>\nScripted turn.\n</think>\n\n"
END = "<|im_end|>"


def plan_text(prompt: str, calls: dict[str, dict[str, Any]]) -> str:
    """The turn's text (after the thinking block) for a rendered Qwen3 prompt."""
    last_user = prompt.rsplit("<|im_start|>user", 1)[-1]
    if "<tool_response>" in last_user:
        result = last_user.rsplit("<tool_response>", 1)[1].split("</tool_response>", 1)[0].strip()
        return f"The command printed: {result}"
    for name, arguments in calls.items():
        if f'"name": "{name}"' in prompt:
            call = json.dumps({"name": name, "arguments": arguments})
            return f"<tool_call>\n{call}\n</tool_call>"
    return "Scripted answer."


class _Turn:
    """One request's forced tokens, planned from its prompt on its first step."""

    def __init__(self, owner: AgentScript) -> None:
        self.owner = owner
        self.plan: list[int] | None = None

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.plan is None:
            self.plan = self.owner.plan(prompt_ids)
        step = len(output_ids)
        token = self.plan[step] if step < len(self.plan) else self.owner.end
        logits.fill_(float("-inf"))
        logits[token] = 0.0
        return logits


class AgentScript(AdapterLogitsProcessor):  # type: ignore[misc]  # vLLM has no type information here
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        end = self.tokenizer.convert_tokens_to_ids(END)
        assert isinstance(end, int), end
        self.end = end
        self.calls: dict[str, dict[str, Any]] = json.loads(os.environ.get(CALLS_ENV, "{}"))

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> _Turn:
        return _Turn(self)

    def plan(self, prompt_ids: list[int]) -> list[int]:
        prompt = self.tokenizer.decode(prompt_ids)
        assert isinstance(prompt, str)
        text = THINK + plan_text(prompt, self.calls)
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.end]
