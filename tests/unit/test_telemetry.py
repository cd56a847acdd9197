"""When tracing is on, and what its config accepts."""

from __future__ import annotations

import msgspec
import pytest
from opentelemetry import trace

from plumbing.telemetry import Tracing, TracingConfig, tracing_enabled
from gateway.config import GatewayConfig

_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("config", "env", "enabled"),
    [
        (TracingConfig(), {}, False),
        (TracingConfig(endpoint="http://collector:4318/v1/traces"), {}, True),
        (TracingConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        (TracingConfig(), {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        (TracingConfig(endpoint="http://c:4318/v1/traces"), {"OTEL_SDK_DISABLED": "true"}, False),
        (TracingConfig(endpoint="http://c:4318/v1/traces"), {"OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_tracing_is_on_only_with_an_endpoint(
    config: TracingConfig, env: dict[str, str], enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tracing_enabled(config) is enabled


def test_off_means_the_no_op_tracer() -> None:
    tracing = Tracing(TracingConfig(), "onehop-gateway")
    assert not tracing.enabled
    assert isinstance(tracing.tracer, trace.NoOpTracer)
    with tracing.tracer.start_as_current_span("x") as span:
        assert not span.is_recording()


async def test_service_name_from_config_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    endpoint = "http://127.0.0.1:9/v1/traces"  # nothing is exported: no span is made
    named = Tracing(TracingConfig(endpoint=endpoint, service_name="from-config"), "onehop-engine")
    from_env = Tracing(TracingConfig(endpoint=endpoint), "onehop-engine")
    try:
        assert named._provider.resource.attributes["service.name"] == "from-config"  # type: ignore[union-attr]
        assert from_env._provider.resource.attributes["service.name"] == "from-env"  # type: ignore[union-attr]
    finally:
        await named.shutdown()
        await from_env.shutdown()


def test_config_is_strict() -> None:
    base = {"model": "m", "tokenizer": "t", "engines": [{"url": "http://e"}]}
    with pytest.raises(msgspec.ValidationError, match="sample_rate"):
        msgspec.convert({**base, "tracing": {"sample_rate": 0.5}}, GatewayConfig)
    with pytest.raises(msgspec.ValidationError, match="sample_ratio"):
        msgspec.convert({**base, "tracing": {"sample_ratio": 1.5}}, GatewayConfig)
    config = msgspec.convert({**base, "tracing": {"endpoint": "http://c:4318/v1/traces", "record_content": True}}, GatewayConfig)
    assert config.tracing.record_content and config.tracing.sample_ratio is None
