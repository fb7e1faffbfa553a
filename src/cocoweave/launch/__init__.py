"""Launching ranks: a local world of live worker ranks over torch.distributed, and torchrun entry points.

    with LocalWorld(4) as world:                      # 4 rank processes, Gloo on 127.0.0.1, kept alive
        sums = world.run(step, tensor)                # step(rank, world_size, tensor) on every rank

Timeouts: `timeout_s` is how long a rank may wait for the others: the process group's timeout (every
collective) and how long the parent waits for the last ranks once one has finished or failed;
`wall_timeout_s` (default none) caps a whole call. A failing rank, a dead rank or a hang becomes a
`BackendError` naming the ranks (the one that stopped answering first), and the stage each was in; a world
whose ranks died or hung is torn down and marked broken until `restart()`. Every listening socket (the
parent's store, Gloo's pairs) is bound to 127.0.0.1. Functions sent to ranks must be module-level (ranks
import them by module name, or from their file).

The package by job: `world` (LocalWorld, the parent side), `worker` (the rank process LocalWorld starts), `torchrun`
(entry points for ranks torchrun or SLURM started), `sending` (functions and exceptions between processes),
`failures` (one sentence for what went wrong), `ranks` (this rank's state and the limits every entry point checks),
`network` (listening sockets on the loopback), `lifetime` (ranks end with the command that started them).
"""

from ..rankenv import in_torchrun as in_torchrun  # re-exported: examples and the CLI ask launch
from ..rankenv import torchrun_device as torchrun_device
from .network import listening_store as listening_store
from .ranks import MAX_TIMEOUT_S as MAX_TIMEOUT_S
from .ranks import check_local_ranks as check_local_ranks
from .ranks import check_seconds as check_seconds
from .ranks import max_local_ranks as max_local_ranks
from .ranks import rank_device as rank_device
from .ranks import rank_state as rank_state
from .torchrun import init_from_env as init_from_env
from .torchrun import rank_failure as rank_failure
from .torchrun import shutdown as shutdown
from .world import LocalWorld as LocalWorld
from .world import spawn_and_run as spawn_and_run
