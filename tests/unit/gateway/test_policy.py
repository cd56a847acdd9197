"""Route policy: rules, the cost model, capability fallbacks, and strict loading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.routing.policy import (
    EngineState,
    NoRoute,
    Policy,
    PolicyError,
    RequestFeatures,
    check_main,
    decide,
    estimate,
    explain_main,
    load_policy,
    policy_from_text,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "configs" / "policy.yaml"
ALL = EngineState()


def one_rule(match: str, default: str = "text") -> Policy:
    return policy_from_text(f"default: {default}\nrules:\n  - name: r\n    match: {match}\n    route: tokens\n")


RULE_CASES = [
    # (match, features, whether it holds)
    ("{endpoint: completions}", RequestFeatures(endpoint="completions"), True),
    ("{endpoint: completions}", RequestFeatures(endpoint="chat"), False),
    ("{model: m1}", RequestFeatures(model="m1"), True),
    ("{model: m1}", RequestFeatures(model="m2"), False),
    ("{stream: true}", RequestFeatures(stream=True), True),
    ("{stream: true}", RequestFeatures(stream=False), False),
    ("{logprobs: true}", RequestFeatures(logprobs=True), True),
    ("{logprobs: false}", RequestFeatures(logprobs=True), False),
    ("{top_logprobs: {ge: 10}}", RequestFeatures(logprobs=True, top_logprobs=10), True),
    ("{top_logprobs: {ge: 10}}", RequestFeatures(logprobs=True, top_logprobs=9), False),
    # top_logprobs without logprobs asks for nothing.
    ("{top_logprobs: {ge: 10}}", RequestFeatures(logprobs=False, top_logprobs=20), False),
    ("{n: {ge: 2, le: 4}}", RequestFeatures(n=2), True),
    ("{n: {ge: 2, le: 4}}", RequestFeatures(n=4), True),
    ("{n: {ge: 2, le: 4}}", RequestFeatures(n=1), False),
    ("{n: {ge: 2, le: 4}}", RequestFeatures(n=5), False),
    ("{max_tokens: {le: 256}}", RequestFeatures(max_tokens=256), True),
    ("{max_tokens: {le: 256}}", RequestFeatures(max_tokens=257), False),
    ("{max_tokens: {le: 256}}", RequestFeatures(max_tokens=None), False),
    ("{prompt_tokens: {ge: 8000}}", RequestFeatures(prompt_tokens=8000), True),
    ("{prompt_tokens: {ge: 8000}}", RequestFeatures(prompt_tokens=7999), False),
    ("{tools: true}", RequestFeatures(tools=True), True),
    ("{tools: true}", RequestFeatures(tools=False), False),
    ("{reasoning: false}", RequestFeatures(reasoning=False), True),
    ("{reasoning: false}", RequestFeatures(reasoning=True), False),
    ("{header: {name: X-Tier, equals: gold}}", RequestFeatures(headers={"x-tier": "gold"}), True),
    ("{header: {name: x-tier, equals: gold}}", RequestFeatures(headers={"X-TIER": "gold"}), True),
    ("{header: {name: x-tier, equals: gold}}", RequestFeatures(headers={"x-tier": "silver"}), False),
    ("{header: {name: x-tier, equals: gold}}", RequestFeatures(), False),
    ("{tenant: acme}", RequestFeatures(tenant="acme"), True),
    ("{tenant: acme}", RequestFeatures(tenant=None), False),
    ("{}", RequestFeatures(), True),
    ("{stream: true, tools: true}", RequestFeatures(stream=True, tools=True), True),
    ("{stream: true, tools: true}", RequestFeatures(stream=True, tools=False), False),
]


@pytest.mark.parametrize(("match", "features", "holds"), RULE_CASES)
def test_each_match_field(match: str, features: RequestFeatures, holds: bool) -> None:
    decision = decide(one_rule(match), features, ALL)
    assert (decision.route, decision.rule) == (("tokens", "r") if holds else ("text", None))


def test_first_matching_rule_wins() -> None:
    policy = policy_from_text(
        "rules:\n"
        "  - {name: a, match: {stream: true}, route: text, pool: p}\n"
        "  - {name: b, match: {}, route: tokens}\n"
    )
    first = decide(policy, RequestFeatures(stream=True), ALL)
    assert (first.route, first.rule, first.pool) == ("text", "a", "p")
    assert first.reason == "rule 'a' (stream=True) -> text"
    second = decide(policy, RequestFeatures(stream=False), ALL)
    assert (second.route, second.rule, second.pool) == ("tokens", "b", None)


def test_example_wide_logprobs_rule() -> None:
    decision = decide(load_policy(EXAMPLE), RequestFeatures(logprobs=True, top_logprobs=20), ALL)
    assert decision.route == "tokens" and decision.rule == "wide-logprobs"
    assert decision.reason == "rule 'wide-logprobs' (top_logprobs>=10) -> tokens"


@pytest.mark.parametrize("route", ["derender", "text", "tokens", "tokens-remote"])
def test_fixed_default(route: str) -> None:
    decision = decide(policy_from_text(f"default: {route}\n"), RequestFeatures(), ALL)
    assert (decision.route, decision.rule, decision.reason) == (route, None, f"default -> {route}")


COST_CASES = [
    # (engine output cores now, expected route): budget 0.25, plain derender adds 0.00016.
    (0.0, "derender"),
    (0.2498, "derender"),
    (0.2499, "tokens"),
    (0.3, "tokens"),
    (0.1, "derender"),  # cooled down: back to one hop
]


@pytest.mark.parametrize(("cores", "route"), COST_CASES)
def test_cost_sheds_near_budget_and_returns_when_cool(cores: float, route: str) -> None:
    decision = decide(Policy(), RequestFeatures(max_tokens=500), EngineState(output_cpu_cores=cores))
    assert decision.route == route and decision.rule is None
    assert decision.reason.startswith("cost: ") and decision.reason.endswith(f"-> {route}")


def test_cost_reason_text() -> None:
    shed = decide(Policy(), RequestFeatures(), EngineState(output_cpu_cores=0.26))
    assert shed.reason == "cost: engine at 0.26 of 0.25 cores, derender would add 0.00016 -> tokens"
    kept = decide(Policy(), RequestFeatures(), EngineState(output_cpu_cores=0.05))
    assert kept.reason == "cost: derender would add 0.00016 cores to the engine (0.05 now, budget 0.25) -> derender"


def test_wide_logprobs_cost_more_and_shed_sooner() -> None:
    cost = Policy().cost
    plain = estimate(cost, RequestFeatures(max_tokens=1000))
    wide = estimate(cost, RequestFeatures(max_tokens=1000, logprobs=True, top_logprobs=20))
    assert plain["engine_s.derender"] == pytest.approx(0.0032)
    assert wide["engine_s.derender"] == pytest.approx(0.0112)
    assert wide["engine_s.tokens"] == plain["engine_s.tokens"] == pytest.approx(0.0011)
    assert wide["engine_s.tokens-remote"] == wide["engine_s.tokens"]
    assert plain["gateway_s.derender"] < plain["gateway_s.tokens"]
    engine = EngineState(output_cpu_cores=0.2496)
    assert decide(Policy(), RequestFeatures(max_tokens=1000), engine).route == "derender"
    wide_features = RequestFeatures(max_tokens=1000, logprobs=True, top_logprobs=20)
    assert decide(Policy(), wide_features, engine).route == "tokens"


def test_estimates_use_default_max_tokens_and_n() -> None:
    est = estimate(Policy().cost, RequestFeatures(n=3))
    assert est["output_tokens"] == 3 * 1024
    # Choices decode side by side: n streams add n times the cores.
    one = estimate(Policy().cost, RequestFeatures(n=1))
    assert est["engine_cores.derender"] == pytest.approx(3 * one["engine_cores.derender"])


FALLBACK_CASES = [
    # (engine routes, route picked, final route)
    ({"text", "tokens", "tokens-remote"}, "derender", "text"),  # stock vLLM: no derender
    ({"tokens"}, "derender", "tokens"),  # tokens-only engine
    ({"tokens"}, "text", "tokens"),
    ({"derender", "text", "tokens"}, "tokens-remote", "derender"),
]


@pytest.mark.parametrize(("routes", "picked", "final"), FALLBACK_CASES)
def test_capability_fallback(routes: set[str], picked: str, final: str) -> None:
    decision = decide(policy_from_text(f"default: {picked}\n"), RequestFeatures(), EngineState(routes=frozenset(routes)))
    assert decision.route == final
    assert decision.reason.endswith(f"; {picked} unavailable on this engine, fallback -> {final}")


def test_rule_route_falls_back_too() -> None:
    decision = decide(load_policy(EXAMPLE), RequestFeatures(tenant="batch"), EngineState(routes=frozenset({"text"})))
    assert (decision.route, decision.rule, decision.pool) == ("text", "batch-tenant", "batch")


def test_no_route() -> None:
    with pytest.raises(NoRoute, match="engine serves nothing"):
        decide(Policy(), RequestFeatures(), EngineState(routes=frozenset()))
    tokens_remote_only = EngineState(routes=frozenset({"tokens-remote"}))
    with pytest.raises(NoRoute, match="derender unavailable"):
        decide(Policy(), RequestFeatures(), tokens_remote_only)


def test_example_config_decodes() -> None:
    policy = load_policy(EXAMPLE)
    assert [r.name for r in policy.rules] == ["wide-logprobs", "batch-tenant", "debug-text"]
    assert policy.default == "cost" and policy.fallback == ["derender", "text", "tokens"]
    assert policy.cost == Policy().cost


def test_an_empty_policy_is_refused_not_read_as_no_rules() -> None:
    for text in ("", "\n# only a comment\n"):
        with pytest.raises(PolicyError, match="the policy is empty"):
            policy_from_text(text)
    assert policy_from_text("default: cost\n") == Policy()


BAD_CASES = [
    (
        "rules:\n  - name: a\n    route: tokens\n    match:\n      top_logprobs:\n        gte: 3\n",
        "policy.yaml:6: rules[0].match.top_logprobs: unknown field 'gte'",
    ),
    ("bogus: 1\n", "policy.yaml:1: unknown field 'bogus'"),
    ("rules:\n  - name: a\n    route: tokens\n  - name: a\n    route: text\n", "policy.yaml:4: rules[1].name: duplicate rule name 'a'"),
    ("rules:\n  - name: a\n    route: tokenz\n", "policy.yaml:3: rules[0].route: Invalid enum value 'tokenz'"),
    ("cost:\n  engine_budget_cores: -1\n", "policy.yaml:2: cost.engine_budget_cores: Expected `float` >= 0.0"),
    ("rules:\n  - {name: a, route: text, match: {n: {}}}\n", "policy.yaml:2: rules[0].match.n: a range needs ge, le or both"),
    ("rules:\n  - {name: a, route: text, match: {n: {ge: 3, le: 2}}}\n", "policy.yaml:2: rules[0].match.n: ge (3) is greater than le (2)"),
    ("rules:\n  - {name: a, route: text, match: {n: {ge: -1}}}\n", "policy.yaml:2: rules[0].match.n.ge: Expected `int` >= 0"),
    ("cost:\n  engine_us_per_token: {tokens: 1}\n", "policy.yaml:2: cost.engine_us_per_token: missing text, derender"),
    ("fallback: [text, text]\n", "policy.yaml:1: fallback[1]: 'text' is listed twice"),
    ("rules:\n  - route: text\n", "policy.yaml:2: rules[0]: Object missing required field `name`"),
    ("default: fast\n", "policy.yaml:1: default: Invalid enum value 'fast'"),
]


@pytest.mark.parametrize(("text", "message"), BAD_CASES)
def test_bad_policy_names_line_and_field(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_text(text)
    assert str(info.value) == message


def test_typo_in_example_names_its_line(tmp_path: Path) -> None:
    lines = EXAMPLE.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if "top_logprobs: {ge: 10}" in line)
    lines[index] = lines[index].replace("ge:", "gte:")
    path = tmp_path / "policy.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == f"{path}:{index + 1}: rules[0].match.top_logprobs: unknown field 'gte'"


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"^p\.yaml:2: "):
        policy_from_text("rules: [\n", "p.yaml")
    with pytest.raises(PolicyError, match=r"nope\.yaml"):
        load_policy(tmp_path / "nope.yaml")


def test_check_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_main(EXAMPLE) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "wide-logprobs" in out and "default: cost" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("bogus: 1\n")
    assert check_main(bad) == 1
    assert capsys.readouterr().err.strip() == f"{bad}:1: unknown field 'bogus'"


def write_json(tmp_path: Path, body: object) -> Path:
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    return path


def test_explain_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20}
    assert explain_main(EXAMPLE, write_json(tmp_path, body)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["route: tokens", "rule: wide-logprobs", "reason: rule 'wide-logprobs' (top_logprobs>=10) -> tokens"]


def test_explain_completions_cost_and_engine_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = {"prompt": "hi", "max_tokens": 100, "engine_routes": ["text", "tokens"], "engine_output_cpu_cores": 0.01}
    assert explain_main(EXAMPLE, write_json(tmp_path, body)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "route: text" and out[1] == "rule: -"
    assert out[2].endswith("-> derender; derender unavailable on this engine, fallback -> text")
    assert "  output_tokens: 100" in out


def test_explain_completions_logprobs_and_prompt_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "default: text\nrules:\n"
        "  - {name: long, match: {prompt_tokens: {ge: 5000}, endpoint: completions, top_logprobs: {ge: 5}}, route: tokens}\n"
    )
    body = {"prompt": "hi", "logprobs": 5, "prompt_tokens": 6000}
    assert explain_main(policy, write_json(tmp_path, body)) == 0
    assert capsys.readouterr().out.startswith("route: tokens\nrule: long\n")


def test_explain_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert explain_main(EXAMPLE, write_json(tmp_path, {"model": "m"})) == 1
    assert "neither 'messages'" in capsys.readouterr().err
    assert explain_main(EXAMPLE, write_json(tmp_path, {"prompt": "x", "engine_routes": []})) == 1
    assert "error: " in capsys.readouterr().err


def test_cli_policy_check_and_explain(tmp_path: Path, capsys: Any) -> None:
    from onehop.cli import main

    root = Path(__file__).resolve().parents[3]
    assert main(["policy", "check", str(root / "configs" / "policy.yaml")]) == 0
    request = tmp_path / "request.json"
    request.write_text('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 20}')
    assert main(["policy", "explain", str(root / "configs" / "policy.yaml"), str(request)]) == 0
    out = capsys.readouterr().out
    assert "route: tokens" in out and "wide-logprobs" in out
