"""``python -m gateway --config FILE [--workers N]``: the gateway alone, as ``onehop gateway``
runs it, loading no engine code; the supervisor starts each of its workers this way."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gateway.serving.preflight import EXIT_USAGE, StartupError
from gateway.serving.workers import add_options, run_gateway


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="Serve the OpenAI API against engines listed in a YAML config (see configs/gateway.yaml).",
    )
    add_options(parser)
    args = parser.parse_args(argv)
    try:
        return run_gateway(args.config, args.workers)
    except StartupError as exc:
        print(f"onehop gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
