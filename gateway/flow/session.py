"""One session key per request: the client's own conversation id, wherever it put it.

Agents name their conversation in different places; the first one present wins:

    X-Session-ID                       vLLM's header (any client)
    session_id                         vLLM's chat/completions body field
    X-Claude-Code-Session-Id           Claude Code, every request of a conversation
    session-id                         Codex CLI's header (its thread id)
    prompt_cache_key                   Responses API (Codex sends its thread id here too)
    metadata.user_id's session_id      Messages API (Claude Code writes JSON there)
    user                               OpenAI's end-user id (one user, one stream of work)

The key goes on the server span (`session.id`) and to engines as `X-Session-ID`, vLLM's
header for it (its KV events carry it); the routing layer can keep a session where its
prefix blocks are. A key longer than `MAX_KEY_CHARS` is replaced by its hash, so what a
client sends bounds nothing it should not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from wire.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.apis.translate import Turn

SESSION_HEADER = "X-Session-ID"
"""vLLM's session header (`vllm/entrypoints/generate/base/serving.py`), sent to engines."""
_HEADERS = ("X-Session-ID", "X-Claude-Code-Session-Id", "session-id")
MAX_KEY_CHARS = 128


def session_key(headers: Mapping[str, str], request: Any) -> str | None:
    """`request`: the decoded request (chat, completion, or a translated API's `Turn`);
    `headers`: its headers (case-insensitive lookups)."""
    header = headers.get(_HEADERS[0])
    body = (
        getattr(request, "session_id", None) if isinstance(request, ChatCompletionRequest | CompletionRequest) else None
    )
    found = header or body or next((value for name in _HEADERS[1:] if (value := headers.get(name))), None)
    found = found or _from_body(request.original if isinstance(request, Turn) else None)
    found = found or getattr(request.original if isinstance(request, Turn) else request, "user", None)
    return _bounded(found) if found else None


def _from_body(original: Any) -> str | None:
    """The Responses and Messages bodies' own session ids."""
    key = getattr(original, "prompt_cache_key", None)
    if isinstance(key, str) and key:
        return key
    metadata = getattr(original, "metadata", None)
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user_id, str) and user_id.startswith("{"):
        try:
            session = json.loads(user_id).get("session_id")
        except (ValueError, AttributeError):
            return None
        return session if isinstance(session, str) and session else None
    return None


def _bounded(key: str) -> str:
    if len(key) <= MAX_KEY_CHARS and key.isprintable():
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()
