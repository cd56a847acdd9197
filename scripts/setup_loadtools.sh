#!/usr/bin/env bash
# Create (idempotently) a separate venv holding the load generators guidellm and
# aiperf, which the slow load-tool tests run against `onehop serve`. Neither goes
# into the project's own environment: their pins (aiohttp, pydantic, transformers,
# msgspec, ...) conflict with onehop's.
#
#   ONEHOP_LOADTOOLS_VENV         where the venv lives ($HOME/.cache/onehop/loadtools-venv)
#   ONEHOP_LOADTOOLS_BASE_PYTHON  interpreter to create it with (python3)
#   Extra arguments are passed to `pip install` (e.g. --find-links DIR).
#
# guidellm depends on torch without a version: unpinned, pip picks the newest
# build, a CUDA one of several GB. Asking for torch 2.13.0 in the same install
# takes the CPU build (guidellm only imports it; nothing here runs on a GPU).
#
# Prints the venv's bin folder on the last line of stdout.
set -euo pipefail

VENV="${ONEHOP_LOADTOOLS_VENV:-$HOME/.cache/onehop/loadtools-venv}"
BASE_PY="${ONEHOP_LOADTOOLS_BASE_PYTHON:-python3}"
GUIDELLM_VERSION="0.8.1"
AIPERF_VERSION="0.13.0"
TORCH_VERSION="2.13.0"
PY="$VENV/bin/python"

installed_ok() {
    [ -x "$PY" ] && "$PY" - "$GUIDELLM_VERSION" "$AIPERF_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
sys.exit(0 if (md.version("guidellm"), md.version("aiperf")) == (sys.argv[1], sys.argv[2]) else 1)
PY
}

if ! installed_ok; then
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || "$BASE_PY" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip >&2
    "$PY" -m pip install "torch==$TORCH_VERSION" "guidellm==$GUIDELLM_VERSION" "aiperf==$AIPERF_VERSION" "$@" >&2
fi

"$VENV/bin/guidellm" --version >&2
"$VENV/bin/aiperf" --version >&2
echo "$VENV/bin"
