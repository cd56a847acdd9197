"""The Kimi K2 test tokenizer and chat template, shared by the unit and the vLLM parity tests.

Kimi K2 / K2-Thinking / K2.5 ship a tiktoken vocabulary whose 256 reserved ids
(163,584 up) are all special tokens: `[BOS]`, `[EOS]`, `<|im_end|>`,
`<|im_user|>`, `<|im_assistant|>`, `<|im_system|>`, `<|im_middle|>`, the five
tool-call markers and, from K2-Thinking on, `<think>` / `</think>`. The folder
built here is the offline Qwen3 BPE with those tokens added as specials
(`tests.support.family_tokenizers`). What differs from the real tokenizer:

- the BPE is Qwen's, so ordinary text splits into other tokens and every id differs;
- `<think>`, `</think>` and `<|im_end|>` keep Qwen3's ids, and Qwen3 has the first two
  as *non-special* tokens (Kimi: special): with `skip_special_tokens` their text
  stays, where Kimi's would be skipped (onehop's parser reads either);
- the EOS is Qwen3's `<|im_end|>` (generation config: `<|im_end|>`, `<|endoftext|>`);
  Kimi's tokenizer names `[EOS]` and its generation config stops on `<|im_end|>`, so
  a stop on `<|im_end|>` reports `stop_reason` null here instead of its id;
- Qwen3's own special tokens (`<|im_start|>`, `<|endoftext|>`, ...) stay.

The chat template is written for these tests (no template text is copied): Kimi's
`<|im_user|>user<|im_middle|>...<|im_end|>` turns, the tools declared in a
`tool_declare` system turn, earlier assistant turns with an empty `<think></think>`,
and a generation prompt that pre-opens `<think>` like K2.5's, or closes it
(`<think></think>`) when `thinking` / `enable_thinking` is false (vLLM's rule: thinking
is on unless one of them is given and neither is true).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.family_tokenizers import build_family_tokenizer

SPECIALS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
)

CHAT_TEMPLATE = (
    "{%- set thinking_on = true -%}"
    "{%- if thinking is defined or enable_thinking is defined -%}"
    "{%- set thinking_on = (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) -%}"
    "{%- endif -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' -%}"
    "<|im_assistant|>assistant<|im_middle|><think></think>{{ m.content or '' }}<|im_end|>"
    "{%- else -%}<|im_system|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking_on -%}<think>{%- else -%}<think></think>{%- endif -%}{%- endif -%}"
)

# A generation turn as K2-Thinking's template opens it: the model writes `<think>` itself.
OPEN_TURN = "<|im_assistant|>assistant<|im_middle|>"


def kimi_tokenizer_dir(qwen3_tokenizer_dir: Path) -> Path:
    """The Kimi K2 test tokenizer folder, next to the Qwen3 one in the fixture cache."""
    return build_family_tokenizer(
        qwen3_tokenizer_dir.parent, "kimi-k2", [(text, True) for text in SPECIALS], chat_template=CHAT_TEMPLATE
    )
