#!/usr/bin/env bash
# Repeat a short healthy `cocoweave run --backend torch` under torchrun (2 ranks) N times (default 50); every run
# must exit 0 (issue #17 item 8: ranks that exited with a live process group aborted 1 run in 5-12).
#   scripts/torchrun_repeat.sh [N]          # about 5-10 s per run on a 2-core machine
# It runs the suite's test with COCOWEAVE_TORCHRUN_REPEATS=N (the suite itself repeats it 3 times).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
COCOWEAVE_TORCHRUN_REPEATS=${1:-50} TRITON_INTERPRET=1 PYTHONPATH=$PWD/src \
    "$PY" -m pytest -q tests/cli/test_torchrun.py -k healthy
