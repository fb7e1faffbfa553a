"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP), resharded on load.

    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step,
             "exe": checkpoint.executable_state(exe)}        # an Executable's kept-sliced state
    checkpoint.save(root / f"step-{step:08d}", state, step=step)   # every rank calls it (a collective)
    path = checkpoint.latest(root)                                   # newest complete checkpoint, or None
    state = checkpoint.load(path, state)                             # fills tensors and Shards in place

What is stored: plain tensors are taken to be identical on every rank (Replicated): DCP writes them
once and every rank reads them whole. A `Shard` (rank r's part of a tensor split along `dim` with
torch.tensor_split sizes or in proportion to `shares`, e.g. state a schedule keeps sliced) is stored as its
own DCP entry `NAME.part-I-of-N`, plus a small layout record `NAME.layout` (dim, whole size, N, shares). On
load each rank computes the bounds of its part for the *current* group size and shares and reads only the
saved parts that overlap them, so a checkpoint written by 4 ranks loads on 2 or 3 ranks (or 1), or with
other shares, with identical values.
None, bools, ints, floats and strings are kept as JSON in the skeleton; other objects are pickled by DCP
(and load only with `trusted=True`). Keys are joined with "/".

Integrity and trust: `COMPLETE.json` lists every file of the checkpoint with its size and sha256, and `load`
checks them all before reading anything: a truncated, emptied, deleted, added or changed file is refused
with a sentence. `load` never runs code from a checkpoint: DCP's metadata is unpickled with an allow-list of
DCP's own classes and other entries are read with `torch.load(weights_only=True)` (cocoweave.checkpoint.safe_dcp);
`trusted=True` lifts that, for checkpoints you trust, as torch.load's `weights_only=False` does. State the
template has and the checkpoint lacks (a tensor or a Shard) is refused, so is sliced state the checkpoint
has and the template lacks (e.g. after a schedule that keeps other state sliced).

Atomicity: ranks write into `PATH.partial`; after DCP has gathered every rank's writes and written its
metadata, rank 0 writes the completion marker `COMPLETE.json` (fsync'ed) and renames the directory to
`PATH`; over an existing checkpoint it swaps the two directories in one step (Linux renameat2
RENAME_EXCHANGE; elsewhere two renames, and `latest` finds `PATH.old` in between). A save that crashes at
any point leaves at most a `.partial` directory, which `load` refuses and `latest` ignores. Ranks on
several hosts need a filesystem they all see at `PATH`.

The package by job: `shard` (a rank's part of a sliced tensor, and what a DTensor or an Executable's state is as
one), `saving` (save), `loading` (load, resharded), `files` (the folder: manifest, completion marker, the atomic
swap, info/verify/latest), `common` (what save and load share: ranks, rank 0's verdict, a failure in one line),
`safe_dcp` (reading DCP's files without running code from them).
"""

from .files import FORMAT as FORMAT
from .files import MARKER as MARKER
from .files import OLD as OLD
from .files import PARTIAL as PARTIAL
from .files import SKELETON as SKELETON
from .files import info as info
from .files import latest as latest
from .files import step_path as step_path
from .files import verify as verify
from .loading import load as load
from .saving import save as save
from .shard import Shard as Shard
from .shard import as_shard as as_shard
from .shard import executable_state as executable_state
