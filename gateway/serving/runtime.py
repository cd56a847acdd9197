"""What serving one model takes, built once at start and never changed under a request.

A `ModelRuntime` holds the model's renderer, vocabulary, parser names and
engine pools; request code gets it from `GatewayState.model(name)` and reads
it, nothing fills it in later. Settings that change at run time (the policy,
the API keys) live in their watched files, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from derender.chat import ReasoningField
from derender.vocab import TokenVocab
from gateway.upstream.engine_client import EngineClient
from gateway.routing.policy import Policy
from gateway.render.local import LocalRenderer


@dataclass(frozen=True, eq=False)
class ModelRuntime:
    name: str
    """The served name: what `/v1/models` lists and answers carry."""
    renderer: LocalRenderer
    vocab: TokenVocab
    max_chars_per_token: int
    """The longest token's text: text longer than the context times this cannot fit."""
    reasoning_parser: str | None
    tool_parser: str | None
    reasoning_field: ReasoningField
    parses_locally: bool
    """onehop implements both parsers, so the text and tokens routes can parse chat."""
    render: Literal["local", "remote"]
    remote_url: str | None
    """vLLM's render/derender service (remote render, the tokens-remote route)."""
    fixed_policy: Policy
    """The policy when no policy file is configured: the model's route, with capability fallbacks."""
    engines: EngineClient
    """The main pool."""
    pools: Mapping[str, EngineClient] = field(default_factory=dict)
    """Named pools, for policy rules that name one."""
    prefill: EngineClient | None = None
    """The prefill pool when serving is disaggregated."""
