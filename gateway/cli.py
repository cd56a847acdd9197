"""The ``onehop`` command line: one subcommand per job, each a small function.

Subcommands register themselves on the shared parser in ``build_parser`` and
carry their handler as ``func``; ``main`` only parses and dispatches, so a new
subcommand is one ``_add_*`` function and one handler.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand attached."""
    parser = argparse.ArgumentParser(
        prog="onehop",
        description="OpenAI-compatible gateway and engine for disaggregated LLM serving.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_fixtures(commands)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the subcommand."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return int(args.func(args))
