"""The pythonic (Llama 3.2 / Llama 4) test tokenizer and chat template, for the unit and the vLLM parity tests.

Pythonic calls are plain text (`[get_weather(city="Paris")]`), so the `pythonic`
parser needs no marker token; Llama 4's tokenizer adds `<|python_start|>` /
`<|python_end|>` (special: skipped from text by default) around a call list and
ends a turn with the special `<|eot|>`. The folder built here is the offline
Qwen3 BPE with those three added as specials (`tests.support.family_tokenizers`)
and `<|eot|>` as the EOS; both parser names are tested with it. What differs
from the real tokenizers:

- the BPE is Qwen's (Llama's is tiktoken-based), so text splits into other tokens
  and every id differs;
- Llama 3.2's `<|eot_id|>` / `<|python_tag|>` and Llama 4's header tokens are absent;
- Qwen3's own added tokens (`<|im_start|>`, `<|im_end|>`, `<think>`, ...) stay.

The chat template is written for these tests (no template text is copied): the
tools as JSON in a first turn, then `role: content<|eot|>` turns and an
`assistant: ` generation prompt; the parsers never read the prompt.
"""

from __future__ import annotations

from pathlib import Path

from derender.parsers.pythonic import PYTHON_END, PYTHON_START
from tests.support.family_tokenizers import build_family_tokenizer

EOT = "<|eot|>"
SPECIALS = (PYTHON_START, PYTHON_END, EOT)

CHAT_TEMPLATE = (
    "{%- if tools -%}system: call tools as [name(key=value, ...)]: {{ tools | tojson }}<|eot|>{%- endif -%}"
    "{%- for m in messages -%}{{ m.role }}: {{ m.content or '' }}<|eot|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {%- endif -%}"
)


def pythonic_tokenizer_dir(qwen3_tokenizer_dir: Path) -> Path:
    """The pythonic test tokenizer folder, next to the Qwen3 one in the fixture cache."""
    return build_family_tokenizer(
        qwen3_tokenizer_dir.parent,
        "pythonic",
        [(text, True) for text in SPECIALS],
        chat_template=CHAT_TEMPLATE,
        eos=EOT,
    )
