"""The ``onehop`` command line: one subcommand per job, each a small function.

Subcommands register themselves on the shared parser in ``build_parser`` and
carry their handler as ``func``; ``main`` only parses and dispatches, so a new
subcommand is one ``_add_*`` function and one handler.

A start that cannot succeed (a missing model folder or config file, a port in
use, a config that no worker could serve) ends with one line on stderr and
exit status 2, checked before any model loads: handlers raise
``StartupError`` (``gateway.serving.preflight``, ``onehop.preflight``) and ``main`` prints it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.serving.preflight import EXIT_USAGE, StartupError, check_port
from gateway.serving.workers import add_options, run_gateway
from onehop.preflight import check_model_folder, startup_errors


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default; help that already words its default keeps it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, **kwargs: Any
) -> argparse.ArgumentParser:
    return commands.add_parser(name, formatter_class=_Help, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand attached."""
    parser = argparse.ArgumentParser(
        prog="onehop",
        formatter_class=_Help,
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
    fixtures = _command(
        commands,
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
        help="build here (default: $ONEHOP_CACHE_DIR, else ~/.cache/onehop)",
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
    engine = _command(
        commands,
        "engine",
        help="serve /inference/v1/generate (tokens, text, derender) over a backend",
        description="The engine: vLLM's generate API plus output_mode=derender, over hf, sim or vllm.",
    )
    engine.add_argument(
        "--backend", choices=["hf", "sim", "vllm"], default="hf", help="transformers, the simulator or vLLM"
    )
    engine.add_argument(
        "--model",
        default=None,
        help="model folder (hf, vllm) or tokenizer folder (sim); default: the tiny Qwen3 model, built on first use",
    )
    engine.add_argument(
        "--served-model-name", default=None, help="the model name answers carry (default: the folder's name)"
    )
    engine.add_argument("--host", default="127.0.0.1", help="address to listen on")
    engine.add_argument("--port", type=int, default=8100, help="port to listen on")
    engine.add_argument("--tokens-only", action="store_true", help="load no tokenizer: tokens mode only")
    _add_model_options(engine)
    # vLLM's flag names; unset (None) keeps EngineLimits' default, which the help repeats.
    engine.add_argument("--max-num-seqs", type=int, default=None, help="most choices (n) per request (default 256)")
    engine.add_argument(
        "--max-logprobs",
        type=int,
        default=None,
        help="most logprobs per token, -1 for the whole vocabulary (default 20)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cache prompts' KV blocks (sim backend; default: its prefix_caching option, off)",
    )
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (sim; default 16)")
    engine.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="vLLM's KV cache events config (sim; default: none),"
        " e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'",
    )
    engine.set_defaults(func=_run_engine)


def _add_model_options(command: argparse.ArgumentParser) -> None:
    """The options `engine` and `serve` share: the model's parsers and the backend's config."""
    command.add_argument(
        "--reasoning-parser", default="auto", help="vLLM reasoning parser name, auto (from the model folder) or none"
    )
    command.add_argument(
        "--tool-parser", default="auto", help="vLLM tool-call parser name, auto (from the model folder) or none"
    )
    command.add_argument(
        "--reasoning-field",
        choices=["reasoning", "reasoning_content", "both"],
        default="reasoning",
        help="where answers carry reasoning: vLLM's `reasoning` (default), the older `reasoning_content`, or both",
    )
    command.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the backend's config (VALUE parsed as JSON when it can be), e.g. itl_ms=20",
    )


def _backend_options(pairs: Sequence[str]) -> dict[str, object]:
    import json

    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise StartupError(f"--backend-option wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _none_or(value: str) -> str | None:
    return None if value.lower() == "none" else value


def _run_engine(args: argparse.Namespace) -> int:
    from engine.app import run
    from engine.config import ConfigError, EngineConfig, engine_limits, kv_events_config

    flags = {"max_num_seqs": args.max_num_seqs, "max_logprobs": args.max_logprobs}
    try:
        limits = engine_limits(**{name: value for name, value in flags.items() if value is not None})
        kv_events = kv_events_config(args.kv_events_config) if args.kv_events_config is not None else None
        if args.block_size is not None and args.block_size < 1:
            raise ConfigError(f"--block-size must be at least 1, got {args.block_size}")
    except ConfigError as exc:
        raise StartupError(str(exc)) from exc
    check_port(args.host, args.port)
    config = EngineConfig(
        backend=args.backend,
        model=_model_folder(args.model, args.backend),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        tokens_only=args.tokens_only,
        reasoning_parser=_none_or(args.reasoning_parser),
        tool_parser=_none_or(args.tool_parser),
        reasoning_field=args.reasoning_field,
        backend_options=_backend_options(args.backend_option),
        limits=limits,
        enable_prefix_caching=args.enable_prefix_caching,
        block_size=args.block_size,
        kv_events_config=kv_events,
    )
    with startup_errors(args.host, args.port):
        run(config)
    return 0


def _model_folder(model: str | None, backend: str) -> str:
    """The folder given (checked: hf and sim read local folders only), else the tiny Qwen3
    model (sim: its tokenizer), built on first use."""
    if model is not None:
        if backend != "vllm":  # vLLM also takes a hub name
            check_model_folder(model)
        return model
    from engine.qwen3.fixtures import ensure_tiny_model, ensure_tokenizer

    return str(ensure_tokenizer() if backend == "sim" else ensure_tiny_model())


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = _command(
        commands,
        "serve",
        help="the OpenAI API with an embedded engine (default: the tiny Qwen3 model)",
        description="Serve the OpenAI API on HOST:PORT, backed by an engine in the same process.",
    )
    serve.add_argument("--model", default=None, help="a local HF causal-LM folder (default: the tiny Qwen3 model)")
    serve.add_argument(
        "--backend", choices=["hf", "sim", "vllm"], default="hf", help="transformers, the simulator or vLLM"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address the OpenAI API listens on")
    serve.add_argument("--port", type=int, default=8000, help="port the OpenAI API listens on")
    serve.add_argument(
        "--route", choices=["derender", "text", "tokens"], default="derender", help="how answers are assembled"
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the model folder's name)"
    )
    serve.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="PATTERN",
        help="another model name clients may send, or a glob pattern of names"
        " (repeatable, e.g. 'claude-*'; default: none)",
    )
    _add_model_options(serve)
    serve.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from onehop.serve import serve

    check_port(args.host, args.port)
    engine = EngineConfig(
        backend=args.backend,
        model=_model_folder(args.model, args.backend),
        served_model_name=args.served_model_name,
        reasoning_parser=_none_or(args.reasoning_parser),
        tool_parser=_none_or(args.tool_parser),
        reasoning_field=args.reasoning_field,
        backend_options=_backend_options(args.backend_option),
    )
    with startup_errors(args.host, args.port):
        serve(engine, host=args.host, port=args.port, route=args.route, aliases=args.alias)
    return 0


def _add_gateway(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gateway = _command(
        commands,
        "gateway",
        help="the OpenAI gateway alone, against the engines in a YAML config",
        description="Serve the OpenAI API against engines listed in a YAML config (see configs/gateway.yaml).",
    )
    add_options(gateway)
    gateway.set_defaults(func=_run_gateway)


def _run_gateway(args: argparse.Namespace) -> int:
    return run_gateway(args.config, args.workers)


def _add_policy(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = _command(commands, "policy", help="check a routing policy file, or explain its decision for a request")
    actions = policy.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="validate a policy YAML")
    check.add_argument("file", type=Path)
    check.set_defaults(func=lambda args: _policy().check_main(args.file))
    explain = actions.add_parser("explain", help="the route a policy picks for an OpenAI request JSON, and why")
    explain.add_argument("file", type=Path)
    explain.add_argument("request", type=Path)
    explain.set_defaults(func=lambda args: _policy().explain_main(args.file, args.request))


def _policy() -> Any:
    from gateway.routing import policy

    return policy


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the subcommand."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return int(args.func(args))
    except StartupError as exc:
        print(f"onehop {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
