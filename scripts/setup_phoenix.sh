#!/usr/bin/env bash
# Create (idempotently) a separate venv holding Arize Phoenix, the OTLP receiver with an LLM
# trace UI that tests/integration/test_observability_phoenix.py and
# scripts/observability_screenshots.py start. It does not go into the project's own
# environment: its pins (SQLAlchemy, grpcio, opentelemetry, pandas, ...) are its own.
#
#   ONEHOP_PHOENIX_VENV         where the venv lives ($HOME/.cache/onehop/phoenix-venv)
#   ONEHOP_PHOENIX_BASE_PYTHON  interpreter to create it with (python3)
#   Extra arguments are passed to `pip install` (e.g. --find-links DIR).
#
# Prints the venv's bin folder on the last line of stdout.
set -euo pipefail

VENV="${ONEHOP_PHOENIX_VENV:-$HOME/.cache/onehop/phoenix-venv}"
BASE_PY="${ONEHOP_PHOENIX_BASE_PYTHON:-python3}"
PHOENIX_VERSION="20.26.1"
PY="$VENV/bin/python"

installed_ok() {
    [ -x "$PY" ] && [ -x "$VENV/bin/phoenix" ] && "$PY" - "$PHOENIX_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
sys.exit(0 if md.version("arize-phoenix") == sys.argv[1] else 1)
PY
}

if ! installed_ok; then
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || "$BASE_PY" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip >&2
    "$PY" -m pip install --quiet "arize-phoenix==$PHOENIX_VERSION" "$@" >&2
fi

"$PY" -c 'import importlib.metadata as md; print("arize-phoenix", md.version("arize-phoenix"))' >&2
echo "$VENV/bin"
