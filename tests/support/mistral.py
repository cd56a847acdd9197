"""The Mistral test tokenizer and chat template, shared by the unit and the vLLM parity tests.

Mistral's tokenizers (Mistral Small 3.x, Ministral 3, Magistral, Devstral) put their
control tokens at the first ids, all special: `<s>`, `</s>`, `[INST]`, `[/INST]`,
`[AVAILABLE_TOOLS]`, `[TOOL_RESULTS]`, `[TOOL_CALLS]`, `[SYSTEM_PROMPT]`, `[ARGS]`,
`[CALL_ID]` and, from the reasoning models on, `[THINK]` / `[/THINK]`. The folder built
here is the offline Qwen3 BPE with those tokens added as specials
(`tests.support.family_tokenizers`), `</s>` as the EOS. What differs from the real tokenizer:

- it is an HF tokenizer (`tokenizer.json`), not mistral-common's `tekken.json`: vLLM then
  reads the format from the vocabulary (`[ARGS]` present: the v11+ `NAME[ARGS]{json}`
  calls; `[THINK]` present: special-token reasoning), as it does for an HF-converted
  Mistral checkpoint;
- the BPE is Qwen's, so ordinary text splits into other tokens and every id differs
  (Mistral's control tokens have ids 0..35 there, from 151,669 up here);
- `mistral_v3_tokenizer_dir` is the pre-v11 variant (Mistral 7B v0.3's control tokens: no
  `[ARGS]`, `[THINK]`), for the older `[TOOL_CALLS][{"name": ..., "arguments": ...}]` calls;
- Qwen3's own added tokens (`<|im_start|>`, `<|im_end|>`, `<think>`, ...) stay, as ordinary
  text to a Mistral parser; the image, FIM and other unused control tokens are left out.

The chat template is written for these tests (no template text is copied): `<s>`, an
optional `[SYSTEM_PROMPT]` turn, the tools as JSON in `[AVAILABLE_TOOLS]`, user turns in
`[INST]...[/INST]`, assistant turns closed by `</s>` with their calls as
`[TOOL_CALLS]NAME[ARGS]{json}`, and tool results in `[TOOL_RESULTS]...[/TOOL_RESULTS]`.
Magistral thinks when its system prompt asks it to: the model writes `[THINK]` itself.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.family_tokenizers import build_family_tokenizer

SPECIALS = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
)
EOS = "</s>"
# Mistral 7B v0.3 / Mixtral 8x22B (tokenizer v3): tools, no `[ARGS]`, no reasoning tokens.
SPECIALS_V3 = SPECIALS[:9]

CHAT_TEMPLATE = (
    "<s>"
    "{%- for m in messages if m.role == 'system' -%}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]{%- endfor -%}"
    "{%- if tools -%}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' -%}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments if c.function.arguments is string"
    " else c.function.arguments | tojson }}"
    "{%- endfor -%}</s>"
    "{%- elif m.role == 'tool' -%}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def mistral_tokenizer_dir(qwen3_tokenizer_dir: Path) -> Path:
    """The Mistral test tokenizer folder, next to the Qwen3 one in the fixture cache."""
    return build_family_tokenizer(
        qwen3_tokenizer_dir.parent,
        "mistral",
        [(text, True) for text in SPECIALS],
        chat_template=CHAT_TEMPLATE,
        eos=EOS,
    )


def mistral_v3_tokenizer_dir(qwen3_tokenizer_dir: Path) -> Path:
    """The pre-v11 variant (no `[ARGS]`: vLLM then parses `[TOOL_CALLS][{"name": ..., ...}]`)."""
    return build_family_tokenizer(
        qwen3_tokenizer_dir.parent,
        "mistral-v3",
        [(text, True) for text in SPECIALS_V3],
        chat_template=CHAT_TEMPLATE,
        eos=EOS,
    )
