"""Shared fixtures: the offline Qwen3 tokenizer and tiny model, built once per cache."""

from __future__ import annotations

import os

# Set before transformers is imported anywhere: nothing in the suite may reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer folder in the onehop cache (built on first use, ~2 s)."""
    return ensure_tokenizer()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    """The transformers tokenizer loaded offline from ``qwen3_tokenizer_dir``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A random-weight two-layer Qwen3 model folder; skipped without torch."""
    pytest.importorskip("torch")
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def qwen3_vocab(qwen3_tokenizer: Any) -> Any:
    """The derender decode tables of the Qwen3 tokenizer."""
    from engine.derender.vocab import vocab_for

    return vocab_for(qwen3_tokenizer)


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Any:
    """Collect after every test, so an unclosed resource is reported by the test that leaked it.

    What survives a collection is live (session fixtures, imported modules): it is frozen
    out of later collections, so each one scans only what the test just made. A full
    collection of the suite's heap (torch, tokenizers, decode tables) costs ~0.2 s, which
    over a thousand tests was minutes of the suite.
    """
    import gc

    yield
    gc.collect()
    gc.freeze()
