"""The hf backend's configuration and its model folder: what it serves, and loading it.

`read_info` reads files only (the served name, limits, vocabulary size, EOS ids);
`load_model` puts the weights on the device and refuses a model whose cache layers the
batch cannot line up (`batch.py` pads and concatenates whole key/value tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch
from msgspec import Meta
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
)
from transformers.cache_utils import DynamicLayer

from engine.backends.base import BackendError, BackendInfo
from engine.backends.grammar_check import DEFAULT_TIMEOUT_S
from wire.grammar_compile import CONSTRAINTS


class HFBackendConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    """A local Hugging Face causal-LM folder."""
    served_model_name: str | None = None
    """Default: the folder's name."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: float32 on CPU, bfloat16 on CUDA."""
    max_batch_size: Annotated[int, Meta(ge=1)] = 16
    """Rows (choices) decoded together; a request with n choices takes n rows."""
    max_model_len: Annotated[int, Meta(ge=1)] | None = None
    """Default: the model config's max_position_embeddings."""
    threads: Annotated[int, Meta(ge=1)] | None = None
    """torch intra-op threads when set."""
    grammar_timeout_s: Annotated[float, Meta(gt=0)] = DEFAULT_TIMEOUT_S
    """Longest a structured-output constraint may take to compile (in the check process):
    past it the request is a 400 (a 60,000-symbol grammar took 3 s on this project's CPUs)."""


def read_info(config: HFBackendConfig) -> BackendInfo:
    """The served name, limits, vocabulary size and EOS ids of a model folder (reads files only)."""
    folder = Path(config.model)
    if not folder.is_dir():
        raise BackendError(f"the model folder {folder} does not exist")
    try:
        text_config = AutoConfig.from_pretrained(folder, local_files_only=True).get_text_config()
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read the model config in {folder}: {exc}") from exc
    tokenizer = load_tokenizer(folder)
    # Ids past the embedding would crash the forward, whatever the tokenizer knows.
    vocab = min(len(tokenizer), text_config.vocab_size) if tokenizer is not None else text_config.vocab_size
    eos = _generation_eos(folder)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    if not eos:
        eos = _as_ids(getattr(text_config, "eos_token_id", None))
    return BackendInfo(
        name="hf",
        model=config.served_model_name or folder.name,
        max_model_len=config.max_model_len or text_config.max_position_embeddings,
        vocab_size=vocab,
        eos_token_ids=frozenset(eos),
        constraints=CONSTRAINTS if tokenizer is not None else frozenset(),  # a grammar needs the token strings
    )


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer; None when it has none (the backend then serves token ids only)."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _generation_eos(folder: Path) -> set[int]:
    if not (folder / "generation_config.json").is_file():
        return set()
    return _as_ids(GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id)


def _as_ids(value: int | Sequence[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _pick_device(wanted: str) -> torch.device:
    if wanted == "cuda" and not torch.cuda.is_available():
        raise BackendError("device='cuda' was asked for but torch sees no CUDA device")
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _pick_dtype(wanted: str, device: torch.device) -> torch.dtype:
    if wanted == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[wanted]


def load_model(config: HFBackendConfig) -> tuple[Any, torch.device]:
    """Load the model for inference; blocking, so call it off the event loop."""
    device = _pick_device(config.device)
    dtype = _pick_dtype(config.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, local_files_only=True)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps .to() in a decorator mypy misreads
    model.eval()  # type: ignore[no-untyped-call]  # transformers leaves its eval() unannotated
    layers = DynamicCache(config=model.config).layers
    # Joins pad and concatenate whole key/value tensors; sliding-window and
    # linear-attention layers keep other state that this cannot line up.
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        raise BackendError("the hf backend needs a model with full attention in every layer")
    return model, device
