"""Errors someone else chose (an engine, vLLM's render service, aiohttp) in OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from gateway.upstream.engine_client import engine_error
from gateway.edge.errors import error_json, status_error

VLLM_OVERFLOW = (
    "This model's maximum context length is 32768 tokens. However, your request has 40009 input tokens. "
    "Please reduce the length of the input messages."
)


def _info(body: bytes) -> dict[str, object]:
    return json.loads(body)["error"]


def test_an_engine_refusal_in_vllms_context_words_gets_openais_code() -> None:
    body = json.dumps({"error": {"message": VLLM_OVERFLOW, "type": "BadRequestError", "param": None, "code": 400}}).encode()
    info = _info(error_json(engine_error(400, body)))
    assert info == {"message": VLLM_OVERFLOW, "type": "invalid_request_error", "param": None, "code": "context_length_exceeded"}


def test_other_engine_refusals_keep_their_words_and_get_a_null_code() -> None:
    body = json.dumps({"error": {"message": "temperature must be non-negative", "type": "BadRequestError", "code": 400}}).encode()
    assert _info(error_json(engine_error(400, body))) == {
        "message": "temperature must be non-negative", "type": "invalid_request_error", "param": None, "code": None
    }


@pytest.mark.parametrize(
    ("status", "shape"),
    [
        (400, ("invalid_request_error", None)),
        (404, ("invalid_request_error", "unknown_url")),
        (405, ("invalid_request_error", "method_not_allowed")),
        (408, ("invalid_request_error", "request_timeout")),
        (413, ("invalid_request_error", "request_too_large")),
        (418, ("invalid_request_error", None)),
        (429, ("requests", "rate_limit_exceeded")),
        (431, ("invalid_request_error", None)),
        (500, ("server_error", None)),
    ],
)
def test_a_status_maps_to_openais_type_and_a_string_or_null_code(status: int, shape: tuple[str, str | None]) -> None:
    info = _info(error_json(status_error(status, "m")))
    assert (info["type"], info["code"]) == shape


@pytest.mark.parametrize("status", [400, 500])
def test_an_engine_message_with_a_backtrace_passes_on_as_its_first_line(status: int) -> None:
    """An engine once sent llguidance's panic with its 77-line Rust backtrace (issue #27): the
    client gets the first line and a hash to find the rest in the engine's log."""
    trace = "\n".join(f"  {i}: <unknown>" for i in range(77))
    message = f"invalid structured output grammar: panic: assertion failed\n<backtrace>\n{trace}\n</backtrace>"
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": status}}).encode()
    shown = str(_info(error_json(engine_error(status, body)))["message"])
    assert "invalid structured output grammar: panic: assertion failed" in shown
    assert "\n" not in shown and "unknown" not in shown and "characters cut" in shown, shown
