"""The Llama 3.x test tokenizer and chat template, shared by the unit and the vLLM parity tests.

Llama 3.1 / 3.2 / 3.3 ship a tiktoken vocabulary whose 256 reserved ids
(128,000 up) are all special tokens, among them `<|begin_of_text|>`,
`<|end_of_text|>`, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`,
`<|eom_id|>` and `<|python_tag|>` (the opening of a tool call, which the
`llama3_json` parser requires). The folder built here is the offline Qwen3 BPE
with those tokens added as specials (`tests.support.family_tokenizers`) and
`<|eot_id|>` as the EOS. What differs from the real tokenizer:

- the BPE is Qwen's, so ordinary text splits into other tokens and every id differs;
- the generation config stops on `<|eot_id|>` only; Llama 3.1's also stops on
  `<|end_of_text|>` and `<|eom_id|>` (the end of a built-in tool call), so here those
  end the output only when a request names them in `stop_token_ids`;
- Qwen3's own added tokens (`<|im_start|>`, `<|im_end|>`, `<think>`, `<tool_call>`, ...) stay.

The chat template is written for these tests (no template text is copied): Llama 3's
`<|start_header_id|>ROLE<|end_header_id|>\\n\\n...<|eot_id|>` turns, the tools declared as
JSON in a system turn with the `{"name": ..., "parameters": ...}` call shape asked
for, and a generation prompt that opens the assistant header.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.family_tokenizers import build_family_tokenizer

PYTHON_TAG = "<|python_tag|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOM,
    EOT,
    PYTHON_TAG,
    "<|finetune_right_pad_id|>",
)
# The generation prompt: the assistant header, after which the model writes its answer.
OPEN_TURN = "<|start_header_id|>assistant<|end_header_id|>\n\n"

CHAT_TEMPLATE = (
    "<|begin_of_text|>"
    "{%- if tools -%}<|start_header_id|>system<|end_header_id|>\n\n"
    "Answer with a JSON call {\"name\": NAME, \"parameters\": {ARGUMENTS}} of one of these functions: "
    "{{ tools | tojson }}<|eot_id|>{%- endif -%}"
    "{%- for m in messages -%}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content or '' }}<|eot_id|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + OPEN_TURN + "{%- endif -%}"
)


def llama3_tokenizer_dir(qwen3_tokenizer_dir: Path) -> Path:
    """The Llama 3.x test tokenizer folder, next to the Qwen3 one in the fixture cache."""
    return build_family_tokenizer(
        qwen3_tokenizer_dir.parent,
        "llama3",
        [(text, True) for text in SPECIALS],
        chat_template=CHAT_TEMPLATE,
        eos=EOT,
    )
