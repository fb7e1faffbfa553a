"""Ranks in different PID namespaces do not use shared memory (issue #32 item 7): rank 0 runs here, rank 1 in a
PID namespace of its own (`unshare --pid --fork --mount-proc`, as a container with its own PID namespace would);
both must fall back to the library's collectives with a warning naming why (rank 1 cannot open rank 0's segment)
and compute the right result. Needs root (unshare). Exit 0 when both did.

    sudo PYTHONPATH=src python scripts/shm_pid_namespace.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path


def rank_main(rank: int, folder: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    import cocoweave as cw
    from cocoweave.backends.torch.executable import Executable
    from cocoweave.plan import lower
    from cocoweave.schedule.enumerate import _on
    from cocoweave.schedule.schedule import Schedule

    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    p = cw.Program("ar")
    g = p.tensor("g", (4,), "float32", cw.Local)
    p.output(cw.all_reduce(g, "sum"), "ar")
    exe = Executable(lower(_on(p, Schedule(p), ("collective",), "shm")), rank, 2, {}, "cpu", kernels="torch")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = exe.run({"g": torch.full((4,), float(rank + 1))}).outputs["ar"]
    result = {"rank": rank, "pid_here": os.getpid(), "sum_ok": bool((out == 3.0).all()),
              "warning": next((str(w.message) for w in seen if "shm collectives" in str(w.message)), None)}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    me = [sys.executable, os.path.abspath(__file__)]
    with tempfile.TemporaryDirectory(prefix="cocoweave-pidns-") as folder:
        r0 = subprocess.Popen([*me, "0", folder])
        r1 = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *me, "1", folder])
        codes = [r0.wait(timeout=300), r1.wait(timeout=300)]
        results = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in (0, 1)
                   if Path(folder, f"rank{r}.json").exists()]
    for r in results:
        print(json.dumps(r))
    ok = codes == [0, 0] and len(results) == 2 and all(r["sum_ok"] and r["warning"] for r in results)
    print("ok: both ranks fell back to the library's collectives" if ok else f"FAIL: exit codes {codes}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3:
        rank_main(int(sys.argv[1]), sys.argv[2])
    else:
        sys.exit(main())
