"""The program torchrun starts on every rank under `cocoweave profile`: install the step recorder
(`recorder`), then run the user's training script as `python SCRIPT ARGS...` would.

    torchrun --standalone --nproc-per-node K -m cocoweave.cluster.profiling.rank_entry SCRIPT ARGS
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from cocoweave.cluster.profiling.recorder import install_from_env
from cocoweave.launch.lifetime import die_with_parent


@record  # an uncaught exception goes to torchrun's error file for this rank: the parent names the root cause
def main(argv: list[str]) -> None:
    """Run `argv[0]` (a Python file) with arguments `argv[1:]` as its `__main__`, hooks installed."""
    if not argv:
        raise SystemExit("usage: python -m cocoweave.cluster.profiling.rank_entry SCRIPT.py [ARGS...]")
    die_with_parent()  # a rank ends with its torchrun agent, however the agent ends (launch/lifetime.py)
    install_from_env()
    script = Path(argv[0])
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
