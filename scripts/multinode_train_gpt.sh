#!/usr/bin/env bash
# A multi-node-style run on one host: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1:PORT), two
# ranks each, train examples/train_gpt.py (dp 2 x tp 2) for STEPS steps (default 200) and compare the losses with
# the one-process reference; both agents must exit 0. tests/examples/test_multinode.py runs it with 4 steps.
#   scripts/multinode_train_gpt.sh [STEPS] [OUT]
# On real machines run one agent per host with --rdzv-endpoint HOST0:PORT (a port every host can reach) and set
# GLOO_SOCKET_IFNAME to the interface the hosts share: see docs/reliability.md, "torchrun on several hosts".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${1:-200}
OUT=${2:-runs/multinode}
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$OUT"
pids=()
for node in 0 1; do
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src "$PY" -m torch.distributed.run --nnodes 2 --nproc-per-node 2 \
        --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "multinode-$PORT" --max-restarts 0 \
        examples/train_gpt.py --steps "$STEPS" --tensor-parallel 2 --out "$OUT" > "$OUT/agent-$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
cat "$OUT"/agent-*.log | grep -E "^(dp|loss|parallel)" || true
[ "$status" -eq 0 ] && echo "both agents exited 0; losses in $OUT/losses.json" || echo "an agent failed (exit $status); see $OUT/agent-*.log"
exit "$status"
