"""Shared fixtures: the offline Qwen3 tokenizer and tiny model, built once per cache."""

from __future__ import annotations

import os

# Set before transformers is imported anywhere: nothing in the suite may reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# litellm fetches a model price list from the internet at import unless told to use its own copy.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

from pathlib import Path
from typing import Any

import pytest

from gateway.serving.memory import release_freed_memory

from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer


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
    from derender.vocab import vocab_for

    return vocab_for(qwen3_tokenizer)


_WIDER_SCOPES = frozenset({"class", "module", "package"})
_wider_fixtures_set_up: list[str] = []
"""Fixtures living past one test that the current module set up (its `_collect_module_garbage` empties it)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    if fixturedef.scope in _WIDER_SCOPES and fixturedef.argname != "_collect_module_garbage":
        _wider_fixtures_set_up.append(fixturedef.argname)
    yield


@pytest.fixture(autouse=True, scope="module")
def _collect_module_garbage() -> Any:
    """After a module that set up fixtures living past one test: a full collection, then what
    survives is frozen again.

    Those fixtures are torn down here, after every per-test collection below has frozen them
    (they were alive then), so garbage they leave in cycles (apps, servers, tokenizers) is
    found only by unfreezing. That walks the whole heap (torch, tokenizers, decode tables:
    ~0.3 s), so a module whose fixtures all lived one test, whose garbage the per-test
    collections found, is not walked again (~100 of the suite's modules, ~40 s).
    """
    import gc

    yield
    _forget_built_middlewares()
    if _wider_fixtures_set_up:
        _wider_fixtures_set_up.clear()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    release_freed_memory()  # glibc keeps freed arenas: the suite's resident peak is what counts


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test(request: pytest.FixtureRequest) -> Any:
    """Collect after every test, so an unclosed resource is reported by the test that leaked it.

    What survives a collection is frozen out of the next ones, so each scans only what the
    test just made: a full collection of the suite's heap (torch, tokenizers, decode tables)
    costs ~0.2 s, which over a thousand tests was minutes. aiohttp's middleware-chain cache
    (an lru_cache of 1024 entries keyed by handler and app) would keep every test's app, and
    all it references, alive: it is emptied first, so a finished app is garbage here. So are
    the test's own arguments (its fixtures' values, torn down by now), which pytest would let go
    only after this teardown: an app in them, frozen here, stayed until its module ended (two
    apps, ~90 MB, a test).
    """
    import gc

    yield
    request.node.funcargs.clear()
    _forget_built_middlewares()
    gc.collect()
    gc.freeze()


def _forget_built_middlewares() -> None:
    from aiohttp import web_app

    web_app._cached_build_middleware.cache_clear()
