"""Kill a rank at every stage of a shared-memory step and check what is left (issue #32 items 2 and 7).

For each stage, two ranks (forked from this process, so each case costs a process-group start, not an import)
run a step whose all-reduce and reduce-scatter go through shared memory; rank 1 SIGKILLs itself at that stage.
Rank 0 must stop with a BackendError naming rank 1 within a few seconds (its PID was proven to name it), not after
the process group's timeout, and /dev/shm must hold exactly what it held before. Prints one JSON line per stage;
exits 1 if any stage fails.

    PYTHONPATH=src python scripts/shm_kill_matrix.py [--timeout 30] [--stages STAGE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("COCOWEAVE_KERNELS", "torch")

import torch.distributed as dist  # noqa: E402

import cocoweave as cw  # noqa: E402
from cocoweave.backends.inputs import make_inputs  # noqa: E402
from cocoweave.backends.torch import shm  # noqa: E402
from cocoweave.backends.torch.executable import Executable  # noqa: E402
from cocoweave.errors import BackendError  # noqa: E402
from cocoweave.plan import lower  # noqa: E402
from cocoweave.schedule.enumerate import _on  # noqa: E402
from cocoweave.schedule.schedule import Schedule  # noqa: E402

STAGES = ("before the group is proven", "before it maps a segment rank 0 made", "inside a barrier",
          "between two barriers", "between two steps")


def dev_shm() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir()) if Path("/dev/shm").is_dir() else []


def schedule() -> Schedule:
    p = cw.Program("collectives")
    g = p.tensor("g", (6, 2), "float32", cw.Local)
    p.output(cw.all_reduce(g, "sum"), "ar")
    p.output(cw.reduce_scatter(g, "sum", 0), "rs")
    return _on(p, Schedule(p), ("collective",), "shm")  # every collective through shared memory


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def rank_main(rank: int, stage: str, folder: Path, timeout: float) -> None:
    """One rank of one case; rank 0 writes what happened to `folder`/report.json."""
    store = dist.FileStore(str(folder / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout))
    s = schedule()
    inputs = make_inputs(s.program, 2, {}, seed=0)
    exe = Executable(lower(s), rank, 2, {}, "cpu")
    if rank == 1:
        if stage == STAGES[0]:
            die()
        real, calls = shm.ShmGroup.barrier, []

        def barrier(self: shm.ShmGroup) -> None:
            calls.append(1)
            if len(calls) == 2 and stage == "between two barriers":
                die()
            real(self)
            if len(calls) == 1 and stage == "inside a barrier":
                die()  # its flag raised: rank 0 passes this barrier and waits for it in the next

        shm.ShmGroup.barrier = barrier
        assert shm.group_for(None) is not None
        if stage == STAGES[1]:
            die()
        exe.run(dict(inputs[rank]))
        die()  # between two steps
    start, outcome = time.monotonic(), {"error": None}
    try:
        if stage != STAGES[0]:
            assert shm.group_for(None) is not None
        for _ in range(2):
            exe.run(dict(inputs[rank]))
    except BackendError as e:
        outcome["error"] = str(e)
    except Exception as e:  # noqa: BLE001 - the library's own error (gloo) when the group is not proven yet
        outcome["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    outcome["seconds"] = round(time.monotonic() - start, 2)
    (folder / "report.json").write_text(json.dumps(outcome))
    os._exit(0)


def run_case(stage: str, timeout: float) -> dict:
    before = dev_shm()
    with tempfile.TemporaryDirectory(prefix="cocoweave-kill-") as tmp:
        folder = Path(tmp)
        pids = []
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                try:
                    rank_main(rank, stage, folder, timeout)
                finally:
                    os._exit(3)
            pids.append(pid)
        deadline = time.monotonic() + timeout + 30
        codes: dict[int, int] = {}
        while len(codes) < 2 and time.monotonic() < deadline:
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        for pid in pids:
            if pid not in codes:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        report = folder / "report.json"
        outcome = json.loads(report.read_text()) if report.exists() else {"error": None, "seconds": None}
    named = outcome["error"] is not None and ("rank 1" in outcome["error"] or stage == STAGES[0])
    quick = outcome["seconds"] is not None and (outcome["seconds"] < 5 or stage == STAGES[0])
    left = sorted(set(dev_shm()) - set(before))
    return {"stage": stage, "rank0": outcome, "rank1_exit": codes.get(pids[1]), "left_in_dev_shm": left,
            "ok": named and quick and not left and codes.get(pids[1]) == -signal.SIGKILL}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=30.0, help="the process group's timeout, in seconds")
    ap.add_argument("--stages", nargs="*", default=list(STAGES), choices=STAGES)
    args = ap.parse_args(argv)
    results = [run_case(stage, args.timeout) for stage in args.stages]
    for r in results:
        print(json.dumps(r), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
