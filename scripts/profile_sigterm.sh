#!/usr/bin/env bash
# `cocoweave profile` ends its ranks on every exit path (issue #32 item 6): run it on examples/train_lm.py with
# far more steps than it can finish, then (1) SIGTERM it after START seconds, (2) let a short --timeout
# expire, (3) SIGKILL it; after each, no rank of that run may be left. Exit 1 if one is.
#   scripts/profile_sigterm.sh [START_SECONDS]     # about 1-2 minutes on a 2-core machine
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
START=${1:-25}
export PYTHONPATH=$PWD/src
ranks() { pgrep -f "cocoweave.cluster.profiling.rank_entry .*--steps $1" || true; }
fail=0 i=0
for how in sigterm timeout sigkill; do
    i=$((i + 1)) tag=$((7000000 + ($$ % 10000) * 10 + i))  # the script's --steps: each case's ranks are told apart by it
    timeout_opt=600; [ "$how" = timeout ] && timeout_opt=$START
    "$PY" -m cocoweave profile examples/train_lm.py -n 1,2 --rounds 1 --steps 100000 --timeout "$timeout_opt" \
        --no-check -- --steps "$tag" >/dev/null 2>&1 &
    cli=$!
    sleep "$START"
    [ -n "$(ranks "$tag")" ] || echo "note ($how): no rank seen running at ${START} s (start slower? raise START)"
    case $how in sigterm) kill -TERM "$cli" ;; sigkill) kill -KILL "$cli" ;; timeout) ;; esac
    wait "$cli" 2>/dev/null
    for _ in $(seq 1 40); do [ -z "$(ranks "$tag")" ] && break; sleep 0.5; done
    left=$(ranks "$tag")
    if [ -n "$left" ]; then
        echo "FAIL ($how): ranks left running: $left"; fail=1; kill -KILL $left 2>/dev/null
    else
        echo "ok ($how): no rank left"
    fi
done
exit $fail
