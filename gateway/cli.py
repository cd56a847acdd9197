"""The ``onehop`` command line: one subcommand per job, each a small function.

Subcommands register themselves on the shared parser in ``build_parser`` and
carry their handler as ``func``; ``main`` only parses and dispatches, so a new
subcommand is one ``_add_*`` function and one handler.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand attached."""
    parser = argparse.ArgumentParser(
        prog="onehop",
        description="OpenAI-compatible gateway and engine for disaggregated LLM serving.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_fixtures(commands)
    _add_engine(commands)
    _add_serve(commands)
    _add_gateway(commands)
    _add_policy(commands)
    return parser


def _add_fixtures(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fixtures = commands.add_parser(
        "fixtures",
        help="build the offline Qwen3 tokenizer (and tiny model) into the cache",
        description="Build the offline Qwen3 fixtures once and print their folders.",
    )
    fixtures.add_argument("--model", action="store_true", help="also build the tiny random Qwen3 model (needs torch)")
    fixtures.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="build here instead of $ONEHOP_CACHE_DIR or ~/.cache/onehop",
    )
    fixtures.set_defaults(func=_run_fixtures)


def _run_fixtures(args: argparse.Namespace) -> int:
    # Imported here so `onehop --help` stays fast and needs no tokenizer build.
    from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer

    print(f"tokenizer: {ensure_tokenizer(args.cache_dir)}")
    if args.model:
        print(f"tiny model: {ensure_tiny_model(args.cache_dir)}")
    return 0


def _add_engine(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    engine = commands.add_parser(
        "engine",
        help="serve /inference/v1/generate (tokens, text, derender) over a backend",
        description="The engine: vLLM's generate API plus output_mode=derender, over hf, sim or vllm.",
    )
    engine.add_argument("--backend", choices=["hf", "sim", "vllm"], default="hf")
    engine.add_argument(
        "--model",
        default=None,
        help="model folder (hf, vllm) or tokenizer folder (sim); default: the tiny Qwen3 model, built on first use",
    )
    engine.add_argument("--served-model-name", default=None)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8100)
    engine.add_argument("--tokens-only", action="store_true", help="load no tokenizer: tokens mode only")
    engine.add_argument("--reasoning-parser", default="auto", help="vLLM reasoning parser name, auto (from the model folder) or none")
    engine.add_argument("--tool-parser", default="auto", help="vLLM tool-call parser name, auto (from the model folder) or none")
    engine.add_argument(
        "--reasoning-field", choices=["reasoning", "reasoning_content", "both"], default="reasoning"
    )
    engine.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the backend's config (VALUE parsed as JSON when it can be), e.g. itl_ms=20",
    )
    # vLLM's flag names; unset (None) keeps EngineLimits' default, which the help repeats.
    engine.add_argument("--max-num-seqs", type=int, default=None, help="most choices (n) per request (default 256)")
    engine.add_argument(
        "--max-logprobs", type=int, default=None, help="most logprobs per token, -1 for the whole vocabulary (default 20)"
    )
    engine.set_defaults(func=_run_engine)


def _backend_options(pairs: Sequence[str]) -> dict[str, object]:
    import json

    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--backend-option wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _none_or(value: str) -> str | None:
    return None if value.lower() == "none" else value


def _run_engine(args: argparse.Namespace) -> int:
    from engine.app import run
    from engine.config import ConfigError, EngineConfig, engine_limits

    flags = {"max_num_seqs": args.max_num_seqs, "max_logprobs": args.max_logprobs}
    try:
        limits = engine_limits(**{name: value for name, value in flags.items() if value is not None})
    except ConfigError as exc:
        print(f"onehop engine: {exc}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer

        model = str(ensure_tokenizer() if args.backend == "sim" else ensure_tiny_model())
    config = EngineConfig(
        backend=args.backend,
        model=model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        tokens_only=args.tokens_only,
        reasoning_parser=_none_or(args.reasoning_parser),
        tool_parser=_none_or(args.tool_parser),
        reasoning_field=args.reasoning_field,
        backend_options=_backend_options(args.backend_option),
        limits=limits,
    )
    run(config)
    return 0


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="the OpenAI API with an embedded engine (default: the tiny Qwen3 model)",
        description="Serve the OpenAI API on HOST:PORT, backed by an engine in the same process.",
    )
    serve.add_argument("--model", default=None, help="a local HF causal-LM folder (default: the tiny Qwen3 model)")
    serve.add_argument("--backend", choices=["hf", "sim", "vllm"], default="hf")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--route", choices=["derender", "text", "tokens"], default="derender")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--reasoning-parser", default="auto", help="vLLM reasoning parser name, auto (from the model folder) or none")
    serve.add_argument("--tool-parser", default="auto", help="vLLM tool-call parser name, auto (from the model folder) or none")
    serve.add_argument(
        "--reasoning-field",
        choices=["reasoning", "reasoning_content", "both"],
        default="reasoning",
        help="where answers carry reasoning: vLLM's `reasoning` (default), the older `reasoning_content`, or both",
    )
    serve.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE")
    serve.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from gateway.embedded import serve

    model = args.model
    if model is None:
        from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer

        model = str(ensure_tokenizer() if args.backend == "sim" else ensure_tiny_model())
    engine = EngineConfig(
        backend=args.backend,
        model=model,
        served_model_name=args.served_model_name,
        reasoning_parser=_none_or(args.reasoning_parser),
        tool_parser=_none_or(args.tool_parser),
        reasoning_field=args.reasoning_field,
        backend_options=_backend_options(args.backend_option),
    )
    serve(engine, host=args.host, port=args.port, route=args.route)
    return 0


def _add_gateway(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gateway = commands.add_parser(
        "gateway",
        help="the OpenAI gateway alone, against the engines in a YAML config",
        description="Serve the OpenAI API against engines listed in a YAML config (see configs/gateway.yaml).",
    )
    gateway.add_argument("--config", type=Path, required=True, metavar="FILE")
    gateway.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="gateway processes sharing the port (default: the CPUs this process may use; 1: no supervisor)",
    )
    gateway.set_defaults(func=_run_gateway)


def _run_gateway(args: argparse.Namespace) -> int:
    from gateway.app import serve
    from gateway.config import ConfigError, load_config

    from gateway.workers import Supervisor, default_workers, worker_index

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"onehop gateway: {exc}", file=sys.stderr)
        return 2
    workers = default_workers() if args.workers is None else args.workers
    if workers < 1:
        print("onehop gateway: --workers must be at least 1", file=sys.stderr)
        return 2
    if workers == 1 or worker_index() is not None:
        from gateway.app import serve

        serve(config)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Supervisor(args.config, workers, config.host, config.port).run()


def _add_policy(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = commands.add_parser("policy", help="check a routing policy file, or explain its decision for a request")
    actions = policy.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="validate a policy YAML")
    check.add_argument("file", type=Path)
    check.set_defaults(func=lambda args: _policy().check_main(args.file))
    explain = actions.add_parser("explain", help="the route a policy picks for an OpenAI request JSON, and why")
    explain.add_argument("file", type=Path)
    explain.add_argument("request", type=Path)
    explain.set_defaults(func=lambda args: _policy().explain_main(args.file, args.request))


def _policy() -> Any:
    from gateway import policy

    return policy


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the subcommand."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return int(args.func(args))
