"""The gateway's own chat-template render equals transformers' `apply_chat_template`, text and ids.

Every chat template the project ships or tests with (Qwen3's, and each family
fixture's), plus two folders written here for what those do not use: templates
listed in `tokenizer_config.json` or in `additional_chat_templates/`, a BOS in
the post-processor and as an AddedToken dict, a token only the config declares,
special tokens only in a legacy `special_tokens_map.json`, and a template that
calls every helper transformers gives templates. Where
transformers cannot render an input, the gateway must refuse it too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer, processors

from wire.openai_schema import ChatCompletionRequest
from engine.qwen3.fixtures import cache_dir
from gateway.edge.errors import InvalidRequest
from gateway.render.local import LocalRenderer
from tests.support.token_ids import id_list
from tests.support import deepseek, glm_tokenizer, harmony_tokenizer, kimi_k2, llama3, minimax_m2, mistral, pythonic

transformers = pytest.importorskip("transformers")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — métrique",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
CASES: dict[str, dict[str, Any]] = {
    "user": {"messages": [{"role": "user", "content": "hi"}]},
    "no_generation_prompt": {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    "turns": {
        "messages": [
            {"role": "system", "content": "Be terse. 世界"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c 🫠"},
        ]
    },
    "tools": {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]},
    "tool_round_trip": {
        "messages": [
            {"role": "system", "content": "You check weather."},
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
        "tools": [WEATHER],
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "simple sum"},
            {"role": "user", "content": "and 3+3?"},
        ]
    },
    "reasoning_content": {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
            {"role": "user", "content": "ok"},
        ]
    },
    "thinking_off": {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
    "thinking_on": {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": True, "thinking": True}},
    "content_parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "part two"}]}]},
    "continue": {
        "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "continue_trailing_space": {
        "messages": [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Hello  "}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "continue_parts": {
        "messages": [{"role": "user", "content": "Say"}, {"role": "assistant", "content": [{"type": "text", "text": "Bon"}]}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    # Unrenderable for transformers: both must fail.
    "continue_without_content": {
        "messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
        "tools": [WEATHER],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "kwargs_set_tools": {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": []}},
    "kwargs_set_messages": {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
}

HELPERS_TEMPLATE = """{{ bos_token }}{{ image_token }}{{ strftime_now('%Y') | length }}
{%- set ns = namespace(count=0) %}
{%- for m in messages %}
  {%- if m.role == 'bad' %}{{ raise_exception('no role named bad') }}{% endif %}
  {%- if loop.index > 40 %}{% break %}{% endif %}
  {%- set ns.count = ns.count + 1 %}
<|im_start|>{{ m.role }}
  {%- if m.thinking is defined %}<think>{{ m.thinking }}</think>{% endif %}
  {%- if m.content is string %}{% generation %}{{ m.content }}{% endgeneration %}
  {%- elif m.content is iterable %}{% for part in m.content %}{% if part.type != 'text' %}{% continue %}{% endif %}{{ part.text }}{% endfor %}
  {%- endif %}
  {%- for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson(indent=2, sort_keys=true) }}</tool_call>{% endfor %}<|im_end|>
{% endfor %}
{%- if tools %}{{ tools | tojson(separators=(',', ':')) }}{% endif %}
{%- for d in documents or [] %}{{ d.title }}: {{ d.text }}{% endfor %}
{{- dict(turns=ns.count, keys=dict.fromkeys(['é', 'b'])) | tojson }}<|extra|>
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif %}"""
TOOL_USE_TEMPLATE = "{% if not tools %}{{ raise_exception('tool_use needs tools') }}{% endif %}" + HELPERS_TEMPLATE
EXTRA_CASES: dict[str, dict[str, Any]] = {
    "documents": {"messages": [{"role": "user", "content": "summarise"}], "documents": [{"title": "A", "text": "first"}]},
    "raise_exception": {"messages": [{"role": "bad", "content": "x"}]},
}


def _written_folder(root: Path, name: str, base: Path, *, list_templates: bool) -> Path:
    """Qwen3's tokenizer with a BOS post-processor, a dict BOS, a config-only token and these templates."""
    folder = root / name
    folder.mkdir()
    backend = Tokenizer.from_file(str(base / "tokenizer.json"))
    bos = "<|endoftext|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["bos_token"] = {"__type": "AddedToken", "content": bos, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config["image_token"] = "<|image_pad|>"
    extra_id = str(backend.get_vocab_size(with_added_tokens=True))
    config["added_tokens_decoder"][extra_id] = {"content": "<|extra|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": False}
    if list_templates:
        config["chat_template"] = [{"name": "default", "template": HELPERS_TEMPLATE}, {"name": "tool_use", "template": TOOL_USE_TEMPLATE}]
    else:
        (folder / "chat_template.jinja").write_text(HELPERS_TEMPLATE, encoding="utf-8")
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE_TEMPLATE, encoding="utf-8")
        config["chat_template"] = "{{ raise_exception('the files win over the config') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


def _legacy_folder(root: Path, base: Path) -> Path:
    """A config from before `added_tokens_decoder`: the special tokens in `special_tokens_map.json`."""
    folder = root / "legacy"
    folder.mkdir()
    shutil.copyfile(base / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in ("added_tokens_decoder", "bos_token", "eos_token"):
        config.pop(key, None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    legacy = {
        "bos_token": {"content": "<|endoftext|>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
        "eos_token": "<|im_end|>",
        "additional_special_tokens": ["<|legacy_extra|>"],
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(legacy), encoding="utf-8")
    (folder / "chat_template.jinja").write_text(HELPERS_TEMPLATE.replace("<|extra|>", "{{ eos_token }}<|legacy_extra|>"), encoding="utf-8")
    return folder


FOLDERS: dict[str, Callable[[Path, Path], Path]] = {
    "qwen3": lambda qwen3, _: qwen3,
    "deepseek": lambda qwen3, _: deepseek.deepseek_tokenizer_dir(qwen3),
    "glm": lambda qwen3, _: glm_tokenizer.glm_tokenizer_dir(qwen3.parent),
    "harmony": lambda qwen3, _: harmony_tokenizer.harmony_tokenizer(qwen3.parent),
    "kimi_k2": lambda qwen3, _: kimi_k2.kimi_tokenizer_dir(qwen3),
    "llama3": lambda qwen3, _: llama3.llama3_tokenizer_dir(qwen3),
    "minimax_m2": lambda qwen3, _: minimax_m2.minimax_tokenizer_dir(qwen3),
    "mistral": lambda qwen3, _: mistral.mistral_tokenizer_dir(qwen3),
    "mistral_v3": lambda qwen3, _: mistral.mistral_v3_tokenizer_dir(qwen3),
    "pythonic": lambda qwen3, _: pythonic.pythonic_tokenizer_dir(qwen3),
    "listed_templates": lambda qwen3, tmp: _written_folder(tmp, "listed", qwen3, list_templates=True),
    "template_files": lambda qwen3, tmp: _written_folder(tmp, "files", qwen3, list_templates=False),
    "legacy_special_tokens": lambda qwen3, tmp: _legacy_folder(tmp, qwen3),
}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def pair(request: pytest.FixtureRequest, qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRenderer, Any]]:
    folder = FOLDERS[request.param](qwen3_tokenizer_dir, tmp_path_factory.mktemp(request.param))
    renderer = LocalRenderer(folder, workers=1)
    yield renderer, transformers.AutoTokenizer.from_pretrained(str(folder))
    renderer.close()


def _expected(tokenizer: Any, request: ChatCompletionRequest, *, tokenize: bool) -> Any:
    """What transformers renders for the messages the gateway hands its template."""
    return tokenizer.apply_chat_template(
        [msgspec.to_builtins(message) for message in request.messages],
        tools=[msgspec.to_builtins(tool) for tool in request.tools] if request.tools else None,
        documents=request.documents,
        add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
        continue_final_message=request.continue_final_message,
        tokenize=tokenize,
        return_dict=False,
        **(request.chat_template_kwargs or {}),
    )


def _check(pair: tuple[LocalRenderer, Any], case: dict[str, Any]) -> None:
    renderer, tokenizer = pair
    request = msgspec.convert(case, ChatCompletionRequest)
    try:
        text = _expected(tokenizer, request, tokenize=False)
    except Exception:  # transformers could not render it: neither may the gateway
        with pytest.raises(InvalidRequest):
            renderer.chat_text(request)
        return
    assert renderer.chat_text(request) == text
    assert id_list(renderer.chat_sync(request)) == list(_expected(tokenizer, request, tokenize=True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_equals_transformers(pair: tuple[LocalRenderer, Any], name: str) -> None:
    _check(pair, CASES[name])


@pytest.mark.parametrize("name", sorted(EXTRA_CASES))
def test_documents_and_raised_errors_equal_transformers(pair: tuple[LocalRenderer, Any], name: str) -> None:
    _check(pair, EXTRA_CASES[name])


@pytest.mark.parametrize("text", ["hello world", "<|im_start|>user\nhi<|im_end|>", "  lead <|extra|> trail ", "<|endoftext|>x<|legacy_extra|>"])
def test_special_tokens_are_added_as_transformers_adds_them(pair: tuple[LocalRenderer, Any], text: str) -> None:
    renderer, tokenizer = pair
    for add_special_tokens in (True, False):
        assert id_list(renderer.encode_sync(text, add_special_tokens=add_special_tokens)) == tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_o200k_folder_renders_as_transformers(qwen3_tokenizer_dir: Path) -> None:
    """gpt-oss's vocabulary (built with vLLM's python, so only where that build is cached): a
    `bos_token` with no post-processor, and no tokenizer class."""
    folder = cache_dir() / harmony_tokenizer.O200K_DIRNAME
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the o200k harmony tokenizer is not built here")
    renderer = LocalRenderer(folder, workers=1)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        for case in CASES.values():
            _check((renderer, tokenizer), case)
        assert id_list(renderer.encode_sync("hi", add_special_tokens=True)) == tokenizer.encode("hi", add_special_tokens=True)
    finally:
        renderer.close()


def test_a_folder_without_tokenizer_json_is_refused(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    from gateway.render.tokenizer_folder import TokenizerFolderError

    shutil.copyfile(qwen3_tokenizer_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    with pytest.raises(TokenizerFolderError, match=r"tokenizer\.json"):
        LocalRenderer(tmp_path)
