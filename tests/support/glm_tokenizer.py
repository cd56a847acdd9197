"""The GLM-4.5/4.6/4.7 test tokenizer: Qwen3's offline BPE plus GLM's added tokens.

GLM's own tokenizer cannot be downloaded here (no hub). What the `glm45` /
`glm47` parsers depend on is which of GLM's markers are single added tokens
and which are special, so the folder adds GLM-4.5's added tokens in GLM's
order, with GLM's special flags as far as vLLM's code and the published
``tokenizer_config.json`` show them: the role and mask tokens (``[gMASK]``,
``<sop>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>``,
``<|observation|>``, ...) are special; ``<think>``, ``</think>``,
``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``,
``<arg_key>``, ``</arg_key>``, ``<arg_value>``, ``</arg_value>`` and
``/nothink`` are not (the GLM chat template writes them as text, and vLLM's
GLM parser matches the arg tags in text).

What differs from GLM's real tokenizer (see ``tests.support.family_tokenizers``):
- the BPE is Qwen's, so ordinary text splits into other pieces and ids;
- ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>`` and
  ``<|endoftext|>`` keep Qwen3's ids, every other GLM token gets an id from
  151,669 up (GLM's own ids are 151,329-151,364); Qwen3's ChatML tokens stay;
- GLM's generation config stops on ``<|endoftext|>``, ``<|user|>`` and
  ``<|observation|>``; the builder writes one EOS id, so ``<|endoftext|>`` is
  the EOS and cases that end a turn on ``<|user|>`` / ``<|observation|>``
  list those in ``stop_token_ids`` (`STOP_TOKENS`), which stops the same way
  (``stop_reason`` is the id);
- the chat template is written here, in GLM's shape (``[gMASK]<sop>``, role
  tokens, calls as ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``,
  the generation turn pre-opening ``<think>`` as GLM-4.7's does, or closing it
  with ``</think>`` when ``enable_thinking`` is false); ``model_opens_think``
  renders a GLM-4.5-style turn that leaves ``<think>`` to the model.
"""

from __future__ import annotations

from pathlib import Path

from engine.qwen3.fixtures import cache_dir
from tests.support.family_tokenizers import build_family_tokenizer, token_id

SPECIAL = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
PLAIN = (
    "<|code_prefix|>",
    "<|code_middle|>",
    "<|code_suffix|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
)
ADDED = tuple((text, True) for text in SPECIAL) + tuple((text, False) for text in PLAIN)
EOS = "<|endoftext|>"
STOP_TOKENS = ("<|user|>", "<|observation|>")

CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.
Function signatures, one per line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
A call is written as <tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>.
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>{{ '<think>' ~ m.reasoning_content ~ '</think>' if m.reasoning_content else '</think>' }}
{{- m.content or '' }}
{%- for call in m.tool_calls or [] -%}
<tool_call>{{ call.function.name }}
{%- for key, value in (call.function.arguments.items() if call.function.arguments is mapping else []) -%}
<arg_key>{{ key }}</arg_key><arg_value>{{ value if value is string else value | tojson }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
<|observation|><tool_response>{{ m.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{%- if enable_thinking is defined and not enable_thinking -%}</think>
{%- elif not (model_opens_think | default(false)) -%}<think>
{%- endif -%}
{%- endif -%}"""


def glm_tokenizer_dir(root: Path | None = None) -> Path:
    """The GLM test tokenizer folder in the onehop cache (built once)."""
    return build_family_tokenizer(root or cache_dir(), "glm", ADDED, chat_template=CHAT_TEMPLATE, eos=EOS)


def glm_token_id(folder: Path, text: str) -> int:
    return token_id(folder, text)
