"""Per-request route policy: strict rules from YAML, then a small cost model.

`decide(policy, features, engine)` is pure: the first rule whose `match`
holds picks the route; otherwise `default` does. A fixed default names a
route; `default: cost` runs the cost model:

    output tokens  T = (max_tokens or default_max_tokens) * n
    engine CPU s   E(mode) = T * (engine_us_per_token[mode]
                                  + top_logprobs * engine_us_per_logprob_entry) / 1e6
                   (the logprob term only for text and derender: on the token
                   routes the engine sends ids and floats, the gateway does the rest;
                   tokens-remote costs the engine what tokens does)
    duration s     D = (max_tokens or default_max_tokens) * seconds_per_output_token
                   (the n choices decode side by side, so n does not lengthen it)
    engine cores   C(mode) = E(mode) / D
    gateway CPU s  G(route) = T * gateway_us_per_token[route] / 1e6

It keeps `derender` (one hop, cheapest for the gateway) while
`engine.output_cpu_cores + C(derender) <= engine_budget_cores`, and sheds to
`tokens` (least engine CPU) once that would exceed the engine pod's frontend
budget. `output_cpu_cores` is live feedback from the engine's metrics, so the
choice moves back to `derender` as the engine cools; there is no state here.

Whatever was picked, a route the engine cannot serve (stock vLLM has no
derender; a tokens-only engine has only tokens) is replaced by the first
available route of `fallback`, and `NoRoute` is raised when there is none.

Errors in a policy file name the YAML line and the field path:
`policy.yaml:12: rules[1].match.top_logprobs: unknown field 'gte'`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta, Struct

from gateway.config import ROUTES, Route

Endpoint = Literal["chat", "completions"]
Default = Literal["cost", "derender", "text", "tokens", "tokens-remote"]
EngineMode = Literal["tokens", "text", "derender"]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


class PolicyError(ValueError):
    """A policy file that does not decode; the message names file, line and field."""


class NoRoute(ValueError):
    """Neither the chosen route nor any fallback is served by the engine."""


class Range(Struct, forbid_unknown_fields=True, kw_only=True):
    ge: NonNegInt | None = None
    le: NonNegInt | None = None

    def __post_init__(self) -> None:
        if self.ge is None and self.le is None:
            raise ValueError("a range needs ge, le or both")
        if self.ge is not None and self.le is not None and self.ge > self.le:
            raise ValueError(f"ge ({self.ge}) is greater than le ({self.le})")

    def contains(self, value: int) -> bool:
        return (self.ge is None or value >= self.ge) and (self.le is None or value <= self.le)

    def describe(self, name: str) -> str:
        low = [f"{name}>={self.ge}"] if self.ge is not None else []
        return ", ".join(low + ([f"{name}<={self.le}"] if self.le is not None else []))


class HeaderMatch(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    """Compared case-insensitively, as HTTP header names are."""
    equals: str


class Match(Struct, forbid_unknown_fields=True, kw_only=True):
    """Every condition that is set must hold; an empty match always holds."""

    endpoint: Endpoint | None = None
    model: str | None = None
    stream: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Range | None = None
    n: Range | None = None
    max_tokens: Range | None = None
    """A request that sets no max_tokens matches no max_tokens range."""
    prompt_tokens: Range | None = None
    tools: bool | None = None
    reasoning: bool | None = None
    header: HeaderMatch | None = None
    tenant: str | None = None

    def matches(self, f: RequestFeatures) -> bool:
        return all(_conditions(self, f))

    def describe(self) -> str:
        parts = [_describe_field(name, getattr(self, name)) for name in self.__struct_fields__]
        return ", ".join(p for p in parts if p) or "always"


class Rule(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    match: Match = msgspec.field(default_factory=Match)
    route: Route
    pool: str | None = None
    """Engine pool the lead's router sends matching requests to; None = any."""


def _us_per_token() -> dict[EngineMode, float]:
    # Engine output-processing CPU per 1k tokens by mode, docs/performance.md:
    # tokens 0.0011 s, text 0.0025 s, derender 0.0032 s.
    return {"tokens": 1.1, "text": 2.5, "derender": 3.2}


def _gateway_us_per_token() -> dict[Route, float]:
    return {"derender": 0.05, "text": 1.5, "tokens": 2.5, "tokens-remote": 0.5}


class CostModel(Struct, forbid_unknown_fields=True, kw_only=True):
    engine_us_per_token: dict[EngineMode, NonNegFloat] = msgspec.field(default_factory=_us_per_token)
    engine_us_per_logprob_entry: NonNegFloat = 0.4
    """docs/performance.md: derender with top_logprobs=20 is 0.0112 s per 1k tokens, (11.2 - 3.2) / 20."""
    gateway_us_per_token: dict[Route, NonNegFloat] = msgspec.field(default_factory=_gateway_us_per_token)
    engine_budget_cores: NonNegFloat = 0.25
    """CPU the engine pod's frontend may spend on output processing."""
    default_max_tokens: Annotated[int, Meta(ge=1)] = 1024
    """Output length assumed when a request sets no max_tokens."""
    seconds_per_output_token: Annotated[float, Meta(gt=0)] = 0.02

    def __post_init__(self) -> None:
        for name, table, keys in (
            ("engine_us_per_token", self.engine_us_per_token, ("tokens", "text", "derender")),
            ("gateway_us_per_token", self.gateway_us_per_token, ROUTES),
        ):
            missing = [k for k in keys if k not in table]
            if missing:
                raise ValueError(f"{name}: missing {', '.join(missing)}")


class Policy(Struct, forbid_unknown_fields=True, kw_only=True):
    rules: list[Rule] = []
    default: Default = "cost"
    fallback: list[Route] = msgspec.field(default_factory=lambda: ["derender", "text", "tokens"])
    cost: CostModel = msgspec.field(default_factory=CostModel)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, rule in enumerate(self.rules):
            if rule.name in seen:
                raise ValueError(f"rules[{i}].name: duplicate rule name {rule.name!r}")
            seen.add(rule.name)
        for i, route in enumerate(self.fallback):
            if route in self.fallback[:i]:
                raise ValueError(f"fallback[{i}]: {route!r} is listed twice")


@dataclass(frozen=True)
class RequestFeatures:
    """What the policy looks at, taken from a request once it is validated."""

    endpoint: Endpoint = "chat"
    model: str = ""
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    max_tokens: int | None = None
    prompt_tokens: int = 0
    tools: bool = False
    reasoning: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    tenant: str | None = None
    constraint: str | None = None
    """The structured-output kind the request sets (`json`, `regex`, ...): only engines that
    enforce it are picked."""
    forced_tool: bool = False
    """`tool_choice` is `required` or a named function (onehop forces the call in the prompt)."""
    cache_salt: str | None = None
    """The request's `cache_salt` (vLLM's): its prompt's blocks are its own in the engines'
    caches, so routing by the cache looks them up salted."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "headers", {k.lower(): v for k, v in self.headers.items()})

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


@dataclass(frozen=True)
class EngineState:
    routes: frozenset[str] = frozenset(ROUTES)
    output_cpu_cores: float = 0.0
    """The engine's recent output-processing CPU rate, from its metrics."""
    in_flight: int = 0


@dataclass(frozen=True)
class Decision:
    route: Route
    rule: str | None
    reason: str
    estimates: dict[str, float]
    pool: str | None = None


def _conditions(m: Match, f: RequestFeatures) -> Iterator[bool]:
    yield m.endpoint is None or m.endpoint == f.endpoint
    yield m.model is None or m.model == f.model
    yield m.stream is None or m.stream == f.stream
    yield m.logprobs is None or m.logprobs == f.logprobs
    yield m.top_logprobs is None or m.top_logprobs.contains(_top(f))
    yield m.n is None or m.n.contains(f.n)
    yield m.max_tokens is None or (f.max_tokens is not None and m.max_tokens.contains(f.max_tokens))
    yield m.prompt_tokens is None or m.prompt_tokens.contains(f.prompt_tokens)
    yield m.tools is None or m.tools == f.tools
    yield m.reasoning is None or m.reasoning == f.reasoning
    yield m.header is None or f.header(m.header.name) == m.header.equals
    yield m.tenant is None or m.tenant == f.tenant


def _describe_field(name: str, value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, Range):
        return value.describe(name)
    if isinstance(value, HeaderMatch):
        return f"header {value.name}={value.equals}"
    return f"{name}={value}"


def _top(f: RequestFeatures) -> int:
    """Top-logprob entries per token; a request without logprobs asks for none."""
    return f.top_logprobs if f.logprobs else 0


def estimate(cost: CostModel, f: RequestFeatures) -> dict[str, float]:
    """Engine CPU seconds, engine cores and gateway CPU seconds of each route."""
    per_choice = f.max_tokens if f.max_tokens is not None else cost.default_max_tokens
    tokens = per_choice * f.n
    duration = per_choice * cost.seconds_per_output_token
    entry_us = _top(f) * cost.engine_us_per_logprob_entry
    out: dict[str, float] = {"output_tokens": float(tokens)}
    for route in ROUTES:
        mode: EngineMode = "tokens" if route == "tokens-remote" else route
        us = cost.engine_us_per_token[mode] + (entry_us if mode != "tokens" else 0.0)
        out[f"engine_s.{route}"] = tokens * us / 1e6
        out[f"engine_cores.{route}"] = out[f"engine_s.{route}"] / duration
        out[f"gateway_s.{route}"] = tokens * cost.gateway_us_per_token[route] / 1e6
    return out


def _by_cost(cost: CostModel, engine: EngineState, est: dict[str, float]) -> tuple[Route, str]:
    now, add, budget = engine.output_cpu_cores, est["engine_cores.derender"], cost.engine_budget_cores
    if now + add <= budget:
        return "derender", (
            f"cost: derender would add {add:.2g} cores to the engine ({now:.2f} now, budget {budget:.2f}) -> derender"
        )
    return "tokens", f"cost: engine at {now:.2f} of {budget:.2f} cores, derender would add {add:.2g} -> tokens"


def _pick(
    policy: Policy, f: RequestFeatures, engine: EngineState, est: dict[str, float]
) -> tuple[Route, Rule | None, str]:
    for rule in policy.rules:
        if rule.match.matches(f):
            return rule.route, rule, f"rule {rule.name!r} ({rule.match.describe()}) -> {rule.route}"
    if policy.default == "cost":
        route, reason = _by_cost(policy.cost, engine, est)
        return route, None, reason
    return policy.default, None, f"default -> {policy.default}"


def decide(policy: Policy, features: RequestFeatures, engine: EngineState) -> Decision:
    """The route for one request; raises NoRoute when the engine serves none of the candidates."""
    est = estimate(policy.cost, features)
    route, rule, reason = _pick(policy, features, engine, est)
    if route not in engine.routes:
        fallback = next((r for r in policy.fallback if r in engine.routes), None)
        if fallback is None:
            served = ", ".join(sorted(engine.routes)) or "nothing"
            raise NoRoute(f"{reason}; {route} unavailable and no fallback is served (engine serves {served})")
        reason = f"{reason}; {route} unavailable on this engine, fallback -> {fallback}"
        route = fallback
    return Decision(route, rule.name if rule else None, reason, est, rule.pool if rule else None)


# Loading: decode once, and on failure find the YAML line of the bad field.

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_REL = re.compile(r"^(?P<rel>[A-Za-z_][\w-]*(?:\[\d+\]|\.[A-Za-z_][\w-]*)*): (?P<msg>.*)$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _child(node: yaml.Node, seg: str | int) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode) and isinstance(seg, str):
        return next((v for k, v in node.value if getattr(k, "value", None) == seg), None)
    if isinstance(node, yaml.SequenceNode) and isinstance(seg, int) and seg < len(node.value):
        item = node.value[seg]
        return item if isinstance(item, yaml.Node) else None
    return None


def _key_node(node: yaml.Node, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        return next((k for k, _ in node.value if getattr(k, "value", None) == key), None)
    return None


def _line(root: yaml.Node | None, path: str, key: str | None) -> int:
    """1-based line of the deepest node on `path` (of `key` in it, if given)."""
    node = root
    for name, index in _SEGMENT.findall(path):
        nxt = _child(node, int(index) if index else name) if node is not None else None
        if nxt is None:
            break
        node = nxt
    if node is not None and key is not None:
        node = _key_node(node, key) or node
    return node.start_mark.line + 1 if node is not None else 1


def _explain_error(exc: msgspec.ValidationError, root: yaml.Node | None) -> tuple[int, str, str]:
    at = _AT.match(str(exc))
    assert at is not None  # the pattern matches any text
    msg, path, key = at["msg"], at["path"] or "", None
    rel = _REL.match(msg)
    if rel:  # a __post_init__ check names the field below the struct it ran in
        path, msg = f"{path}.{rel['rel']}", rel["msg"]
    unknown = _UNKNOWN.match(msg)
    if unknown:
        key, msg = unknown["key"], f"unknown field {unknown['key']!r}"
    line = _line(root, path, key)
    if key is None and path:
        parent, _, last = path.rpartition(".")
        if last and "[" not in last:
            line = _line(root, parent, last)
    return line, path.lstrip("."), msg


def policy_from_text(text: str, name: str = "policy.yaml") -> Policy:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise PolicyError(f"{name}:{line}: {getattr(exc, 'problem', None) or exc}") from exc
    if raw is None:  # an empty file, or one caught half-written: never a silent "no rules"
        raise PolicyError(f"{name}:1: the policy is empty (for no rules, write `default: <route>`)")
    try:
        return msgspec.convert(raw, Policy)
    except msgspec.ValidationError as exc:
        line, path, msg = _explain_error(exc, root)
        raise PolicyError(f"{name}:{line}: {path}: {msg}" if path else f"{name}:{line}: {msg}") from exc


def load_policy(path: str | Path) -> Policy:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: {exc.strerror or exc}") from exc
    return policy_from_text(text, str(path))


def policy_for(path: Path, pools: set[str]) -> Policy:
    """Load a policy and check that every pool its rules name is configured."""
    policy = load_policy(path)
    unknown = sorted({r.pool for r in policy.rules if r.pool is not None} - pools)
    if unknown:
        known = ", ".join(sorted(pools)) or "none"
        raise PolicyError(
            f"{path}: rules name pools the gateway config does not define: {', '.join(unknown)} (defined: {known})"
        )
    return policy


# CLI bodies; the lead wires `onehop policy check|explain` to these.


def features_from_request(body: Mapping[str, Any], prompt_tokens: int) -> RequestFeatures:
    """Policy features of an OpenAI chat or completions request body."""
    chat = "messages" in body
    if not chat and "prompt" not in body:
        raise ValueError("request has neither 'messages' (chat) nor 'prompt' (completions)")
    raw_lp = body.get("logprobs")
    logprobs = bool(raw_lp) if chat else raw_lp is not None
    top = int(body.get("top_logprobs") or 0) if chat else int(raw_lp or 0)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    kwargs = body.get("chat_template_kwargs") or {}
    return RequestFeatures(
        endpoint="chat" if chat else "completions",
        model=str(body.get("model", "")),
        stream=bool(body.get("stream", False)),
        logprobs=logprobs,
        top_logprobs=top,
        n=int(body.get("n") or 1),
        max_tokens=None if max_tokens is None else int(max_tokens),
        prompt_tokens=prompt_tokens,
        tools=bool(body.get("tools")),
        # Qwen3's chat template thinks unless told not to.
        reasoning=chat and bool(kwargs.get("enable_thinking", True)),
        headers=dict(body.get("headers") or {}),
        tenant=body.get("tenant"),
    )


def check_main(path: str | Path) -> int:
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    names = ", ".join(r.name for r in policy.rules) or "none"
    fallback = " → ".join(policy.fallback) or "none"
    print(f"{path}: ok; rules: {names}; default: {policy.default}; fallback: {fallback}")
    return 0


def explain_main(policy_path: str | Path, request_json_path: str | Path) -> int:
    try:
        policy = load_policy(policy_path)
        text = Path(request_json_path).read_text(encoding="utf-8")
        body = json.loads(text)
        if not isinstance(body, dict):
            raise TypeError("the request JSON must be an object")
        features = features_from_request(body, int(body.get("prompt_tokens", len(text) // 4)))
        engine = EngineState(
            routes=frozenset(body.get("engine_routes", ROUTES)),
            output_cpu_cores=float(body.get("engine_output_cpu_cores", 0.0)),
        )
        decision = decide(policy, features, engine)
    except (OSError, ValueError, TypeError) as exc:  # PolicyError, NoRoute, JSON errors are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"route: {decision.route}")
    print(f"rule: {decision.rule or '-'}")
    print(f"reason: {decision.reason}")
    for key, value in decision.estimates.items():
        print(f"  {key}: {value:.6g}")
    return 0
