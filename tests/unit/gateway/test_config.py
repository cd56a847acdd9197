"""The example gateway config decodes, and a typo is an error that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]


def test_example_config_decodes() -> None:
    config = load_config(ROOT / "configs" / "gateway.yaml")
    assert config.route == "derender" and len(config.engines) == 2
    assert config.timeouts.first_token_s == 120


def test_unknown_key_is_named(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "gateway.yaml").read_text().replace("idle_s: 60", "idel_s: 60")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="idel_s"):
        load_config(path)


def test_remote_route_needs_a_url(tmp_path: Path) -> None:
    path = tmp_path / "remote.yaml"
    path.write_text("model: m\ntokenizer: t\nengines: [{url: 'http://x'}]\nroute: tokens-remote\n")
    with pytest.raises(ConfigError, match="remote_url"):
        load_config(path)


MODELS = """
route: tokens
tool_parser: hermes
models:
  - name: a
    aliases: [alpha]
    tokenizer: /t/a
    engines: [{url: 'http://a'}]
  - name: b
    tokenizer: /t/b
    engines: [{url: 'http://b'}]
    route: derender
    tool_parser: null
"""


def test_several_models_take_the_top_level_settings_as_defaults(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    a, b = load_config(path).served_models()
    assert (a.name, a.names(), a.route, a.tool_parser, a.reasoning_parser) == ("a", ["a", "alpha"], "tokens", "hermes", "auto")
    assert (b.route, b.tool_parser, b.render) == ("derender", None, "local")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (MODELS + "model: c\n", "model belong inside each model"),
        (MODELS + "engines: [{url: 'http://c'}]\n", "engines belong inside each model"),
        (MODELS.replace("name: b", "name: alpha"), "'alpha' is given twice"),
        (MODELS.replace("    route: derender\n", "    route: derender\n    rotue: text\n"), "rotue"),
        (MODELS.replace("    route: derender\n", "    route: tokens-remote\n"), "model 'b': remote_url is required"),
        ("tokenizer: t\nengines: [{url: 'http://x'}]\n", "give model, tokenizer and engines"),
        ("models: []\n", "give model, tokenizer and engines"),
    ],
)
def test_a_models_config_that_cannot_be_served_is_refused(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_config(path)


def test_response_store_bounds_decode_and_a_share_past_the_whole_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    base = "model: m\ntokenizer: t\nengines: [{url: 'http://x'}]\n"
    path.write_text(base + "response_store: {max_bytes: 1000000, max_tenant_bytes: 250000}\n")
    stored = load_config(path).response_store
    assert (stored.max_bytes, stored.max_tenant_bytes, stored.max_entries, stored.max_tenant_entries) == (1_000_000, 250_000, 10_000, 2_500)
    assert stored.one_tenant().max_tenant_bytes == 1_000_000
    path.write_text(base + "response_store: {max_bytes: 1000000, max_tenant_bytes: 2000000}\n")
    with pytest.raises(ConfigError, match="max_tenant_bytes"):
        load_config(path)


def test_state_defaults_to_memory_and_redis_needs_a_url(tmp_path: Path) -> None:
    path = tmp_path / "state.yaml"
    base = "model: m\ntokenizer: t\nengines: [{url: 'http://x'}]\n"
    path.write_text(base)
    assert load_config(path).state.backend == "memory"
    path.write_text(base + "state: {backend: redis, url: 'redis://cache:6379/2', timeout_s: 0.25, key_prefix: 'a:'}\n")
    state = load_config(path).state
    assert (state.backend, state.url, state.timeout_s, state.key_prefix) == ("redis", "redis://cache:6379/2", 0.25, "a:")
    assert state.fairness_sync_s == 0.2  # shared by default; null keeps each process's own
    path.write_text(base + "state: {backend: redis, url: 'redis://x', fairness_sync_s: null}\n")
    assert load_config(path).state.fairness_sync_s is None
    for wrong, named in (
        ("{backend: redis}", "state.url is required"),
        ("{backend: redis, url: 'http://cache'}", "redis://"),
        ("{backend: memcached}", "backend"),
        ("{backend: redis, url: 'redis://x', timeout: 1}", "timeout"),
        ("{backend: redis, url: 'redis://x', fairness_sync_s: 0}", "fairness_sync_s"),
        ("{backend: redis, url: 'redis://x', fairness_sync_s: 60}", "fairness_sync_s"),
    ):
        path.write_text(base + f"state: {wrong}\n")
        with pytest.raises(ConfigError, match=named):
            load_config(path)


KV_EVENTS = """
model: m
tokenizer: t
engines:
  - url: http://a:8000
    kv_events: tcp://a:5557
    kv_replay: tcp://a:5558
    kv_topic: kv
    data_parallel_size: 2
  - url: http://b:8000
balancing:
  kv_index: {max_blocks: 5000, block_size: 32}
"""


def test_kv_events_endpoints_and_the_index_bounds_decode(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text(KV_EVENTS)
    config = load_config(path)
    first, second = config.engines
    assert (first.kv_events, first.kv_replay, first.kv_topic, first.data_parallel_size) == (
        "tcp://a:5557", "tcp://a:5558", "kv", 2,
    )
    assert second.kv_events is None and second.data_parallel_size == 1
    assert (config.balancing.kv_index.max_blocks, config.balancing.kv_index.block_size) == (5000, 32)


@pytest.mark.parametrize(
    ("engine", "error"),
    [
        ("{url: 'http://a', kv_events: 'http://a:5557'}", "kv_events 'http://a:5557' is not tcp://HOST:PORT"),
        ("{url: 'http://a', kv_events: 'tcp://a'}", "is not tcp://HOST:PORT"),
        ("{url: 'http://a', kv_events: 'tcp://a:99999'}", "kv_events 'tcp://a:99999' is not a URL"),
        ("{url: 'http://a', kv_replay: 'tcp://a:5558'}", "kv_replay needs kv_events"),
        ("{url: 'http://a', resolve: true, kv_events: 'tcp://a:5557'}", "resolve: true cannot have it"),
        ("{url: 'http://a', kv_events: 'tcp://a:5557', data_parallel_size: 0}", "data_parallel_size"),
    ],
)
def test_a_bad_kv_events_endpoint_is_refused(tmp_path: Path, engine: str, error: str) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text(f"model: m\ntokenizer: t\nengines: [{engine}]\n")
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace("?", r"\?")):
        load_config(path)


def test_tenants_priority_and_fairness_settings_decode_and_bad_ones_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    base = "model: m\ntokenizer: t\nengines: [{url: 'http://x'}]\n"
    path.write_text(
        base + "tenants:\n  a: {priority: -1, best_priority: -5, weight: 2.5, max_concurrency: 4, max_queue: 8}\n"
    )
    config = load_config(path)
    a = config.tenant("a")
    assert (a.priority, a.best_priority, a.weight, a.max_concurrency, a.max_queue) == (-1, -5, 2.5, 4, 8)
    default = config.tenant("other")
    assert (default.priority, default.best_priority, default.weight, default.max_concurrency) == (0, None, 1.0, None)
    for wrong, named in (
        ("{weight: 0}", r"tenants\['a'\]\.weight"),
        ("{weight: -1}", r"tenants\['a'\]\.weight"),
        ("{max_concurrency: 0}", r"tenants\['a'\]\.max_concurrency"),
        ("{max_queue: -1}", r"tenants\['a'\]\.max_queue"),
        ("{priority: 99999999999999999999}", r"tenants\['a'\]\.priority"),
        ("{priority: 1, best_priority: 3}", r"best_priority 3 is less urgent than priority 1.*tenants\['a'\]"),
    ):
        path.write_text(base + f"tenants: {{a: {wrong}}}\n")
        with pytest.raises(ConfigError, match=named):
            load_config(path)
