#!/usr/bin/env bash
# The verl test group: verl 0.9's own DataProto, padding, micro-batching, Ulysses and FSDP
# engine code carry and replay routes from the store. Runs in its own venv (verl pins
# transformers < 5.11): $RR_VERL_VENV, default .venv-verl in the repo root, made and filled
# once. Usage: bash integrations/ci_verl.sh [extra pytest args]. Exits non-zero if the
# group fails or could not run (verl not importable).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RR_VERL_VENV:-.venv-verl}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if ! "$PY" -c 'import importlib.metadata as m; assert m.version("verl") == "0.9.1"' 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0 verl==0.9.1
fi
"$PY" -m pip install -q -e ".[ray]" pytest
"$PY" -c 'import verl, routing_replay, integrations.verl' # fail loudly, never skip silently
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_integration_verl.py "$@"
