"""The DeepSeek test tokenizer and chat template, shared by the unit and the vLLM parity tests.

DeepSeek V3 / V3.1 / R1 ship a 128k BPE whose added tokens include the
sentence markers (`<｜begin▁of▁sentence｜>`, `<｜end▁of▁sentence｜>`: special),
the turn markers `<｜User｜>` / `<｜Assistant｜>`, `<think>` / `</think>`, and the
tool-call markers `<｜tool▁calls▁begin｜>`, `<｜tool▁call▁begin｜>`,
`<｜tool▁sep｜>`, `<｜tool▁call▁end｜>`, `<｜tool▁calls▁end｜>` (plus the
`<｜tool▁output…｜>` ones). The folder built here is the offline Qwen3 BPE with
those tokens added (`tests.support.family_tokenizers`). The turn and tool
markers are added as *non-special*: that is how DeepSeek's tokenizer has them
as far as can be checked offline (vLLM's deepseek parsers read the markers'
text with the default `skip_special_tokens=true` and never turn it off, which
only works if they are not special; DeepSeek-V3.2's DSML markers are the
special ones that need it). What differs from the real tokenizer:

- the BPE is Qwen's, so ordinary text splits into other tokens and every id differs;
- `<think>` / `</think>` keep Qwen3's ids (non-special, as in DeepSeek's);
- Qwen3's own added tokens (`<|im_start|>`, `<|im_end|>`, `<tool_call>`, ...) stay;
- the EOS is DeepSeek's `<｜end▁of▁sentence｜>` (tokenizer and generation config).

The chat template is written for these tests (no template text is copied): a
BOS, the system text and the tools as JSON, `<｜User｜>` turns, earlier assistant
turns closed with `</think>` before their text, and a generation turn
`<｜Assistant｜>` followed by `<think>` when the `thinking` or `enable_thinking`
kwarg is true, else by `</think>` (V3.1's rule); `bare_turn=true` writes the
turn alone, as R1's and V3's original templates do.
"""

from __future__ import annotations

from pathlib import Path

from derender.parsers.deepseek import ASSISTANT, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"

ADDED: tuple[tuple[str, bool], ...] = (
    (BOS, True),
    (EOS, True),
    (USER, False),
    (ASSISTANT, False),
    ("<think>", False),
    ("</think>", False),
    (CALLS_BEGIN, False),
    (CALLS_END, False),
    (CALL_BEGIN, False),
    (CALL_END, False),
    (SEP, False),
    ("<｜tool▁outputs▁begin｜>", False),
    ("<｜tool▁outputs▁end｜>", False),
    ("<｜tool▁output▁begin｜>", False),
    ("<｜tool▁output▁end｜>", False),
)

CHAT_TEMPLATE = (
    "{%- set thinking_on = (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) -%}"
    "<｜begin▁of▁sentence｜>"
    "{%- for m in messages if m.role == 'system' -%}{{ m.content + '\\n\\n' }}{%- endfor -%}"
    "{%- if tools -%}{{ '## Tools' }}{%- for t in tools -%}{{ '\\n' + (t | tojson) }}{%- endfor -%}{{ '\\n\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<｜Assistant｜></think>{{ m.content or '' }}<｜end▁of▁sentence｜>"
    "{%- elif m.role == 'tool' -%}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜>"
    "{%- if not (bare_turn is defined and bare_turn) -%}{%- if thinking_on -%}<think>{%- else -%}</think>{%- endif -%}{%- endif -%}"
    "{%- endif -%}"
)


def deepseek_tokenizer_dir(qwen3_tokenizer_dir: Path) -> Path:
    """The DeepSeek test tokenizer folder, next to the Qwen3 one in the fixture cache."""
    from tests.support.family_tokenizers import build_family_tokenizer

    return build_family_tokenizer(qwen3_tokenizer_dir.parent, "deepseek", ADDED, chat_template=CHAT_TEMPLATE, eos=EOS)
