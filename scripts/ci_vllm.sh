#!/usr/bin/env bash
# The opt-in vLLM suite for CI: make vLLM's venv (scripts/setup_vllm.sh), then
# run the vllm-marked tests in the project's venv against it.
#
#   usage: scripts/ci_vllm.sh [extra pytest args...]
#
# A venv that cannot be made (no registry, no disk) is not a test failure:
# a loud SKIPPED banner, exit 0. Otherwise exits with pytest's status, where
# 5 (no test collected) counts as a failure. ~2 min with the venv in place
# (two vLLM servers start once), plus ~80 s the first time it is made.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

skipped() {
    local rule="================================================================"
    printf '\n%s\n*** vLLM conformance SKIPPED: %s ***\n%s\n\n' "$rule" "$1" "$rule"
    exit 0
}

setup_out="$(mktemp)"
trap 'rm -f "$setup_out"' EXIT
setup_rc=0
bash scripts/setup_vllm.sh >"$setup_out" || setup_rc=$?
if [ "$setup_rc" -ne 0 ]; then
    cat "$setup_out"
    skipped "scripts/setup_vllm.sh failed with exit $setup_rc (its output is above)"
fi
vllm_python="$(tail -n 1 "$setup_out")"
if [ ! -x "$vllm_python" ]; then
    skipped "scripts/setup_vllm.sh printed no usable python (got '$vllm_python')"
fi

export ONEHOP_VLLM_PYTHON="$vllm_python"
echo "vLLM conformance: ONEHOP_VLLM_PYTHON=$ONEHOP_VLLM_PYTHON"
rc=0
.venv/bin/python -m pytest -m vllm tests/vllm "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "vLLM conformance FAILED: pytest collected no vllm test" >&2
    exit 1
fi
exit "$rc"
