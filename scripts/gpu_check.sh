#!/usr/bin/env bash
# The first run on a GPU machine, in one command (issue #29): every CUDA path cocoweave has, each step under its
# own timeout so that the whole finishes inside 10 minutes, every result as JSON in one folder.
#
#     scripts/gpu_check.sh                # results in $OUT when set (the device tool), else runs/gpu_check-<time>/
#     GPU_CHECK_STEPS="tests demo" scripts/gpu_check.sh    # only those steps
#     GPU_CHECK_DRY=1 scripts/gpu_check.sh       # dry mode, on a machine without a GPU: every step on the CPU over
#                                                # Gloo with the smallest sizes (the plumbing, not the figures)
#
# Python packages the GPU machine lacks (pydantic there: its image has every other dependency) travel as wheels in
# .whl/ (git-ignored; `pip download --no-deps` them for its Python) and are installed into a temporary folder.
#
# Steps (seconds allowed):
#   tests        75  the GPU tests (tests/kernels/test_cuda.py, the sm_90 compile test) with compiled Triton, and
#                    the device-routing tests under the interpreter
#   titan-tp    100  issue #44's last item: torchtitan's unmodified Llama 3 ("debugmodel") trained 20 clipped steps at
#                    tp 2 through one parallelize call (2 Gloo ranks sharing the GPU; FlexAttention has a backward
#                    there) against one process: examples/torchtitan_llama3.py --steps 20 --device cuda, exit 0 when
#                    within 1e-5 (its line, in summary.json's output tail). Needs torchtitan's wheels in .whl/:
#                    `pip download --no-deps -d .whl torchtitan==0.3.0 spmd_types tyro docstring_parser`
#   step-nccl    90  benchmarks/train_step.py --device cuda at 1 rank over NCCL, both models (the first run's 5.3M
#                    model alone, 2 x 4 steps, was launch-bound: DistributedAdamW 1.26x DDP + AdamW(fused) there)
#   step-gloo    75  benchmarks/train_step.py --device cuda at 2 ranks sharing the GPU over Gloo
#   train-gpt    60  examples/train_gpt.py under torchrun, 1 rank (NCCL with Gloo beside it)
#   profile-io   90  cocoweave profile examples/slow_input.py -n 1,2 on the GPU, batches copied from pinned and
#                    from pageable memory (issue #31: host-device transfers timed)
#   demo        150  cocoweave demo --device cuda (every schedule of the paper's workloads, checked and timed)
#   kernels     120  benchmarks/kernels.py: each kernel checked on random inputs and timed against torch and its floor
# (the two longest last: a step gets what is left of the whole budget when that is less than its own).
# Files (at most 8, the device tool's limit): summary.json (per step: command, exit code, seconds, timed out, the
# last 12,000 characters of its output), tests.json (the whole log), demo.json, kernels.json, train_step-nccl.json,
# train_step-gloo.json, train_gpt.json, profile_io.json. Exits 0 when every step did.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
RESULTS=${OUT:-$ROOT/runs/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$RESULTS"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
TOTAL=${GPU_CHECK_SECONDS:-570}  # seconds for every step together, under the device tool's 600
DEV=cuda NCCL=nccl PIN=--pin-memory KERNELS= TEST_MODE=0 STEP_MODELS=small,large ROUNDS=3 STEPS_EACH=8
if [ -n "${GPU_CHECK_DRY:-}" ]; then  # the CPU stands in for the GPU, Gloo for NCCL; sizes as small as they go
    DEV=cpu NCCL=gloo PIN= KERNELS=--smoke TEST_MODE=1 STEP_MODELS=small ROUNDS=1 STEPS_EACH=2
fi
START=$(date +%s)
STEPS=()

step() {  # step NAME SECONDS COMMAND...: run it with what is left of both budgets, keep its log in $WORK
    local name=$1 budget=$2
    shift 2
    [[ -n "${GPU_CHECK_STEPS:-}" && " $GPU_CHECK_STEPS " != *" $name "* ]] && return 0  # not asked for this time
    local left=$(( TOTAL - ($(date +%s) - START) ))
    (( budget > left )) && budget=$left
    local t0 rc=124
    t0=$(date +%s%N)
    if (( budget > 0 )); then
        echo "== $name (up to ${budget}s): $*"
        timeout --kill-after=5 "$budget" "$@" >"$WORK/$name.log" 2>&1
        rc=$?
        tail -n 5 "$WORK/$name.log"
    else
        echo "(no time left for this step)" >"$WORK/$name.log"
    fi
    STEPS+=("$name|$rc|$(( ($(date +%s%N) - t0) / 1000000 ))|$*")
}

if [ -d .whl ] && ! "$PY" -c "import pydantic" 2>/dev/null; then  # the GPU image has no pydantic: carried wheels
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:$WORK/site
fi
TITAN_PATH=$PYTHONPATH  # torchtitan and its model's imports, carried as wheels, for the titan-tp step only
if ls .whl/torchtitan-*.whl >/dev/null 2>&1 && ! "$PY" -c "import torchtitan" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/titan" \
        .whl/torchtitan-*.whl .whl/spmd_types-*.whl .whl/tyro-*.whl .whl/docstring_parser-*.whl \
        && TITAN_PATH=$PYTHONPATH:$WORK/titan
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$WORK/gpu.txt" 2>&1 || true

step tests 75 bash -c "TRITON_INTERPRET=$TEST_MODE $PY -m pytest -q -p no:cacheprovider tests/kernels/test_cuda.py \
    tests/kernels/test_sm90_compile.py -rs && TRITON_INTERPRET=1 $PY -m pytest -q -p no:cacheprovider \
    tests/backends/test_placement.py tests/optim/test_device_routes.py tests/test_launch.py -k 'torchrun or nccl'"
TITAN_STEPS=20
[ -n "${GPU_CHECK_DRY:-}" ] && TITAN_STEPS=0  # the CPU has no FlexAttention backward: the forward check alone
step titan-tp 100 env PYTHONPATH="$TITAN_PATH" "$PY" examples/torchtitan_llama3.py --tensor-parallel 2 \
    --device $DEV --steps $TITAN_STEPS
step step-nccl 90 "$PY" benchmarks/train_step.py --device $DEV --backend $NCCL --worlds 1 --models $STEP_MODELS \
    --rounds $ROUNDS --steps $STEPS_EACH --out "$WORK/nccl"
step step-gloo 75 "$PY" benchmarks/train_step.py --device $DEV --backend gloo --worlds 2 --models small \
    --optimizers adamw --rounds $ROUNDS --steps $(( STEPS_EACH / 2 )) --out "$WORK/gloo"
step train-gpt 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_gpt.py \
    --steps 20 --tensor-parallel 1 --batch 8 --out "$WORK/gpt"
PROFILE="$PY -m cocoweave profile examples/slow_input.py -n 1,2 --no-check --steps 6 --warmup 2 --rounds 1 \
    --timeout 40 --store $WORK/store"
step profile-io 90 bash -c "$PROFILE --json $WORK/profile-pinned.json -- --device $DEV $PIN \
    --ckpt-every 3 && $PROFILE --json $WORK/profile-pageable.json -- --device $DEV --ckpt-every 3"
step demo 150 "$PY" -m cocoweave demo --device $DEV --out "$WORK/demo" --json "$RESULTS/demo.json"
step kernels 120 env OUT="$RESULTS" TRITON_INTERPRET=$TEST_MODE "$PY" benchmarks/kernels.py $KERNELS

for kind in nccl gloo; do  # train_step names its file by its options and date: one name here
    f=$(ls "$WORK/$kind"/train_step-*.json 2>/dev/null | head -n 1)
    [ -n "$f" ] && cp "$f" "$RESULTS/train_step-$kind.json"
done
[ -f "$WORK/gpt/losses.json" ] && cp "$WORK/gpt/losses.json" "$RESULTS/train_gpt.json"
"$PY" - "$WORK" "$RESULTS" <<'EOF'  # the two profiles as one file: pinned and pageable batches
import json, pathlib, sys
work, results = map(pathlib.Path, sys.argv[1:])
found = {k: json.loads((work / f"profile-{k}.json").read_text()) for k in ("pinned", "pageable")
         if (work / f"profile-{k}.json").exists()}
if found:
    (results / "profile_io.json").write_text(json.dumps(found, indent=1))
EOF

"$PY" - "$WORK" "$RESULTS" "${STEPS[@]}" <<'EOF'
import json, pathlib, subprocess, sys, datetime
work, results, steps = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
rows = []
for s in steps:
    name, rc, seconds, command = s.split("|", 3)
    log = (work / f"{name}.log").read_text(errors="replace") if (work / f"{name}.log").exists() else ""
    rows.append({"step": name, "command": command, "rc": int(rc), "seconds": round(int(seconds) / 1e3, 1),
                 "timed_out": int(rc) in (124, 137), "output_tail": log[-12000:]})
tests = next((r for r in rows if r["step"] == "tests"), None)
if tests is not None:  # the whole log of the tests, not only its end
    log = (work / "tests.log").read_text(errors="replace") if (work / "tests.log").exists() else ""
    (results / "tests.json").write_text(json.dumps(tests | {"output": log[-400_000:]}, indent=1))
try:
    import torch, triton
    versions = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
except Exception as exc:  # noqa: BLE001
    versions = {"error": repr(exc)}
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": commit,
       "gpu": (work / "gpu.txt").read_text().strip() if (work / "gpu.txt").exists() else None, **versions,
       "ok": all(r["rc"] == 0 for r in rows), "steps": rows}
(results / "summary.json").write_text(json.dumps(doc, indent=1))
print(f"{'step':<12} {'rc':>4} {'seconds':>8}")
for r in rows:
    print(f"{r['step']:<12} {r['rc']:>4} {r['seconds']:>8.1f}{'  (timed out)' if r['timed_out'] else ''}")
print(f"results in {results}")
sys.exit(0 if doc["ok"] else 1)
EOF
