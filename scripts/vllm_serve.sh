#!/usr/bin/env bash
# Start a stock vLLM 0.32 OpenAI server (the reference peer) from the venv
# that scripts/setup_vllm.sh builds, in the foreground; stop it with SIGINT or
# SIGTERM. Ready in ~30 s on CPU, ~3.5 GiB RSS.
#
#   usage: scripts/vllm_serve.sh MODEL_DIR PORT [extra vLLM server args...]
#
#   ONEHOP_VLLM_VENV    the venv ($HOME/.cache/onehop/vllm-venv)
#   ONEHOP_VLLM_PYTHON  its python, overriding ONEHOP_VLLM_VENV
#   VLLM_CPU_KVCACHE_SPACE  KV cache GiB on CPU (default 1)
set -euo pipefail

if [ "$#" -lt 2 ]; then
    sed -n '2,10p' "$0" >&2
    exit 2
fi
MODEL_DIR="$1"
PORT="$2"
shift 2

PY="${ONEHOP_VLLM_PYTHON:-${ONEHOP_VLLM_VENV:-$HOME/.cache/onehop/vllm-venv}/bin/python}"
if [ ! -x "$PY" ]; then
    echo "no vLLM python at $PY; run scripts/setup_vllm.sh first" >&2
    exit 1
fi

export HF_HUB_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"

# `python -m` because the `vllm` console script fails on the vllm-cpu package name.
exec "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" \
    --port "$PORT" \
    --enforce-eager \
    --enable-scale-out \
    --reasoning-parser qwen3 \
    --tool-call-parser hermes \
    --enable-auto-tool-choice \
    "$@"
