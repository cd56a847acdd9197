"""The MiniMax M2 test tokenizer and chat template, shared by the unit and the vLLM parity tests.

MiniMax-M2 (and M2.1 / M2.5) have their own BPE with added tokens for the
chat turns — `]~!b[` (BOS), `]~b]` (a turn opens, `]~b]ai` for the assistant)
and `[e~[` (a turn ends; the EOS) as special tokens — and, as non-special
added tokens, `<think>`, `</think>`, `<minimax:tool_call>` and
`</minimax:tool_call>`. The `<invoke name=...>` / `<parameter name=...>` tags
are plain text. The folder built here is the offline Qwen3 BPE with those
tokens added (`tests.support.family_tokenizers`). What differs from the real
tokenizer:

- the BPE is Qwen's, so ordinary text splits into other tokens and every id differs;
- `<think>` and `</think>` keep Qwen3's ids (non-special in both);
- Qwen3's own added tokens (`<|im_start|>`, `<|im_end|>`, ...) stay; the EOS is `[e~[`
  as in MiniMax's.

The chat template is written for these tests (no template text is copied):
`]~b]role\\n...[e~[\\n` turns after a `]~!b[` BOS, the tools listed as JSON in the
system turn, and a generation prompt that opens `<think>\\n` as MiniMax's does; with
`enable_thinking` false it closes the block (`<think>\\n\\n</think>\\n\\n`), the way a
template with a thinking switch renders it (MiniMax-M2's own has none).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.family_tokenizers import build_family_tokenizer

BOS = "]~!b["
TURN = "]~b]"
EOS = "[e~["
ADDED = (
    (BOS, True),
    (TURN, True),
    (EOS, True),
    ("<think>", False),
    ("</think>", False),
    ("<minimax:tool_call>", False),
    ("</minimax:tool_call>", False),
)

CHAT_TEMPLATE = (
    "]~!b[]~b]system\nYou are a helpful assistant."
    "{% if tools %}\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>{% endif %}"
    "[e~[\n"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}]~b]ai\n{{ m.content or '' }}[e~[\n"
    "{% else %}]~b]{{ m.role }}\n{{ m.content }}[e~[\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n<think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}"
)


def minimax_tokenizer_dir(qwen3_tokenizer_dir: Path) -> Path:
    """The MiniMax M2 test tokenizer folder, next to the Qwen3 one in the fixture cache."""
    return build_family_tokenizer(
        qwen3_tokenizer_dir.parent, "minimax-m2", ADDED, chat_template=CHAT_TEMPLATE, eos=EOS
    )
