#!/usr/bin/env bash
# Starts one real vLLM (CPU build, from scripts/vllm/setup.sh) serving the tiny model as
# `tiny` on 127.0.0.1:PORT, pinned to CORE, with 1 GiB of KV cache, prefix caching, cached
# tokens in usage and /reset_prefix_cache. Runs in the foreground (~60-80 s to start).
#
#   scripts/vllm/serve.sh PORT [CORE] [extra vllm flags...]
set -euo pipefail
port="$1"; core="${2:-0}"; shift; [ $# -gt 0 ] && shift
dir="$("$(dirname "$0")/setup.sh")"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_SERVER_DEV_MODE=1 \
  VLLM_CPU_OMP_THREADS_BIND="$core" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# `python -m vllm.entrypoints.openai.api_server`: the `vllm` command looks for a distribution
# named `vllm` and fails under `vllm-cpu`.
exec "$dir/venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$dir/model" \
  --served-model-name tiny --host 127.0.0.1 --port "$port" --max-model-len 4096 \
  --enable-prefix-caching --enable-prompt-tokens-details "$@"
