"""`save`: every rank writes its state through DCP into `PATH.partial`; rank 0 completes it (files.py). The
state's nested structure is kept as a JSON skeleton per rank, plain values in it, tensors and Shards as entries."""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import faults
from ..errors import CheckpointError
from .common import _describe, _from_rank0, _is_dist, _rank
from .files import PARTIAL, SKELETON, _complete
from .safe_dcp import first_failure
from .shard import Shard, as_shard

log = logging.getLogger(__name__)


def _encode(value: Any, key: str, entries: dict[str, Any]) -> Any:
    """Add `value`'s leaves to `entries` (flat DCP keys joined with '/'); returns its skeleton: the nested
    structure (dict keys with their types, lists, tuples) with each leaf replaced by its kind and key."""
    value = as_shard(value)
    if isinstance(value, Shard):
        entries[f"{key}.part-{value.index}-of-{value.count}"] = value.part.detach()
        entries[f"{key}.layout"] = json.dumps({"dim": value.dim, "total": value.total, "count": value.count,
                                               "shares": list(value.shares) if value.shares else None})
        return {"s": key}
    if isinstance(value, torch.Tensor):
        entries[key] = value.detach()
        return {"t": key}
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise CheckpointError(f"checkpoint state `{key}` has a key {k!r}; keys must be strings or ints")
            items.append([k, _encode(v, f"{key}/{k}" if key else str(k), entries)])
        return {"d": items}
    if isinstance(value, list | tuple):
        kind = "l" if isinstance(value, list) else "u"
        return {kind: [_encode(v, f"{key}/{i}", entries) for i, v in enumerate(value)]}
    if value is None or isinstance(value, bool | int | float | str):
        return {"v": value}  # JSON in the skeleton
    entries[key] = value  # pickled by DCP: loads only with trusted=True
    return {"o": key}


def _merge(a: Any, b: Any) -> Any:
    """The union of two ranks' skeletons (ranks may hold different keys, e.g. per tensor-parallel rank)."""
    if "d" in a and "d" in b:
        merged = dict((json.dumps(k), [k, v]) for k, v in a["d"])
        for k, v in b["d"]:
            j = json.dumps(k)
            merged[j] = [k, _merge(merged[j][1], v)] if j in merged else [k, v]
        return {"d": list(merged.values())}
    return a


def save(path: str | os.PathLike[str], state: Mapping[str, Any], *, step: int | None = None,
         meta: Mapping[str, Any] | None = None, group: Any = None) -> Path:
    """Write `state` as a complete checkpoint at `path` (every rank of `group` calls it); returns the path.

    An existing checkpoint at `path` is replaced only once the new one is complete, in one step."""
    final = Path(path)
    tmp = final.with_name(final.name + PARTIAL)
    rank = _rank(group)
    error = _prepare(tmp, final) if rank == 0 else None
    error = _from_rank0(error, group)  # every rank stops with rank 0's sentence, or goes on once the folder is there
    if error is not None:
        raise CheckpointError(error)
    faults.maybe_fault(dist.get_rank() if _is_dist(group) else 0, 0, "checkpoint")
    try:
        entries: dict[str, Any] = {}
        entries[f"{SKELETON}/{_rank(None)}"] = json.dumps(_encode(dict(state), "", entries))
        with warnings.catch_warnings():  # DCP warns when it runs in one process, which is what we ask for
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(entries, checkpoint_id=str(tmp), process_group=group, no_dist=not _is_dist(group))
    except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        raise CheckpointError(f"saving checkpoint {final} failed: {_describe(first_failure(exc), exc)}") from None
    faults.maybe_fault(dist.get_rank() if _is_dist(group) else 0, 1, "checkpoint")
    error = None
    if rank == 0:
        try:
            _complete(tmp, final, step, dist.get_world_size(group) if _is_dist(group) else 1, meta)
        except OSError as exc:
            error = f"saving checkpoint {final} failed: {exc.strerror or exc}"
    error = _from_rank0(error, group)  # no rank returns before the checkpoint is complete
    if error is not None:
        raise CheckpointError(error)
    if rank == 0:
        log.info("saved checkpoint %s (step %s)", final, step)
    return final


def _prepare(tmp: Path, final: Path) -> str | None:
    """Rank 0: an empty `tmp` folder for the save (a folder left by a save that crashed is removed), or why not."""
    if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):
        return (f"saving checkpoint {final} failed: {tmp} is in the way and is not a folder cocoweave left (a "
                f"{'symbolic link' if tmp.is_symlink() else 'file'}); move or remove it and save again")
    shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        return f"saving checkpoint {final} failed: cannot create {tmp} ({exc.strerror or exc})"
    return None

