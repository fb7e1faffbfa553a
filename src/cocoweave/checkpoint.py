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
Other values (ints, floats, strings, lists) are pickled by DCP. Keys are joined with "/".

Atomicity: ranks write into `PATH.partial`; after DCP has gathered every rank's writes and written its
metadata, rank 0 writes the completion marker `COMPLETE.json` (fsync'ed) and renames the directory to
`PATH`. A save that crashes at any point leaves at most a `.partial` directory, which `load` refuses
and `latest` ignores. Ranks on several hosts need a filesystem they all see at `PATH`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from . import faults
from .errors import CheckpointError
from .ir.layout import share_bounds

MARKER = "COMPLETE.json"
PARTIAL = ".partial"
FORMAT = 1
SKELETON = "__skeleton__"  # per rank: the nested structure of what it saved (JSON)
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Shard:
    """Part `index` of `count` of a tensor whose whole size along `dim` is `total` (tensor_split sizes, or in
    proportion to `shares`, one positive int per part)."""

    part: torch.Tensor
    dim: int
    total: int
    index: int
    count: int
    shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.shares is not None:
            self.shares = tuple(self.shares)
            if len(self.shares) != self.count or not all(isinstance(x, int) and x > 0 for x in self.shares):
                raise CheckpointError(f"a Shard of {self.count} parts needs {self.count} positive int shares, got "
                                      f"{self.shares}")
        start, stop = self.bounds(self.index)
        if self.part.ndim <= self.dim or self.part.shape[self.dim] != stop - start:
            raise CheckpointError(f"a Shard of part {self.index} of {self.count} along dim {self.dim} of size "
                                  f"{self.total} needs {stop - start} rows there, got shape {list(self.part.shape)}")

    def bounds(self, index: int) -> tuple[int, int]:
        """[start, stop) of part `index` along `dim`."""
        return share_bounds(self.total, self.shares if self.shares is not None else self.count, index)


def _is_dist(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _rank(group: Any) -> int:
    return dist.get_rank(group) if _is_dist(group) else 0


def _barrier(group: Any) -> None:
    if _is_dist(group):
        dist.barrier(group=group)


def _encode(value: Any, key: str, entries: dict[str, Any]) -> Any:
    """Add `value`'s leaves to `entries` (flat DCP keys joined with '/'); returns its skeleton: the nested
    structure (dict keys with their types, lists, tuples) with each leaf replaced by its kind and key."""
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
    entries[key] = value  # pickled by DCP
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

    An existing checkpoint at `path` is replaced only once the new one is complete."""
    final = Path(path)
    tmp = final.with_name(final.name + PARTIAL)
    rank = _rank(group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    _barrier(group)
    faults.maybe_fault(dist.get_rank() if _is_dist(group) else 0, 0, "checkpoint")
    try:
        entries: dict[str, Any] = {}
        entries[f"{SKELETON}/{_rank(None)}"] = json.dumps(_encode(dict(state), "", entries))
        with warnings.catch_warnings():  # DCP warns when it runs in one process, which is what we ask for
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(entries, checkpoint_id=str(tmp), process_group=group, no_dist=not _is_dist(group))
    except Exception as exc:  # noqa: BLE001 - DCP wraps rank failures in CheckpointException
        raise CheckpointError(f"saving checkpoint {final} failed: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
    faults.maybe_fault(dist.get_rank() if _is_dist(group) else 0, 1, "checkpoint")
    if rank == 0:
        record = {"format": FORMAT, "step": step, "world_size": dist.get_world_size(group) if _is_dist(group) else 1,
                  "time": time.time(), "meta": dict(meta or {})}
        with open(tmp / MARKER, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(final.parent)
    _barrier(group)  # no rank returns before the checkpoint is complete
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The completion record of the checkpoint at `path` (step, world size, meta); CheckpointError if
    `path` is missing or incomplete."""
    p = Path(path)
    if not p.is_dir():
        partial = p.with_name(p.name + PARTIAL)
        why = "only an interrupted save was found there" if partial.exists() else "no such directory"
        raise CheckpointError(f"checkpoint {p} cannot be loaded: {why}")
    try:
        with open(p / MARKER) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {p} is incomplete (no {MARKER}): its save was interrupted") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {p} has an unreadable {MARKER}: {exc}") from None
    if record.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {p} has format {record.get('format')!r}; this cocoweave reads {FORMAT}")
    return record


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint `root/step-N` with the largest N, or None (interrupted saves are skipped)."""
    best: tuple[int, Path] | None = None
    rootp = Path(root)
    if not rootp.is_dir():
        return None
    for child in rootp.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / MARKER).is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), child)
    return best[1] if best else None


def step_path(root: str | os.PathLike[str], step: int) -> Path:
    """Where `latest` looks for the checkpoint of step `step`: root/step-00000042."""
    return Path(root) / f"step-{step:08d}"


def load(path: str | os.PathLike[str], state: Mapping[str, Any], *, group: Any = None) -> dict[str, Any]:
    """Read the entries of `state`'s top-level keys from the checkpoint at `path` (every rank of `group`
    calls it); returns them as a nested dict.

    Tensors and Shards in `state` are filled in place (a Shard may be for another group size than the
    saved parts); everything else comes back as saved (new tensors, on the CPU), so that a template like
    an optimizer's state dict before its first step loads whatever state was saved."""
    p = Path(path)
    info(p)
    try:
        saved = dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {p} has unreadable DCP metadata: {type(exc).__name__}: {exc}") from None
    # First read the small records: every rank's skeleton and the saved split of every sliced tensor.
    records = {k: "" for k in saved if k.startswith(SKELETON + "/") or k.endswith(".layout")}
    _dcp_load(p, records, group)
    skeleton: dict[str, Any] = {"d": []}
    for key, text in records.items():
        if key.startswith(SKELETON + "/"):
            skeleton = _merge(skeleton, json.loads(text))
    top = {k: v for k, v in skeleton["d"]}
    missing = [k for k in state if k not in top]
    if missing:
        raise CheckpointError(f"checkpoint {p} has no entry `{missing[0]}`; it has: {', '.join(map(str, top))}")
    request: dict[str, Any] = {}
    shards: list[tuple[str, Shard]] = []
    tree = {k: _plan(p, top[k], state[k], saved, request, shards) for k in state}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, shard in shards:  # read only the saved parts that overlap this rank's part
        copies += _plan_shard(p, name, shard, json.loads(records[f"{name}.layout"]), saved, request)
    _dcp_load(p, request, group)
    for dst, src in copies:
        dst.copy_(src)
    return _resolve(tree, request)


_MISSING = object()


@dataclass
class _Ref:
    key: str


def _plan(p: Path, node: Any, template: Any, saved: Mapping[str, Any], request: dict[str, Any],
          shards: list[tuple[str, Shard]]) -> Any:
    """What to read for one saved skeleton node into `template`; returns the result tree with _Refs."""
    if "s" in node:
        if not isinstance(template, Shard):
            raise CheckpointError(f"checkpoint {p}: `{node['s']}` is sliced there; load it into a "
                                  "checkpoint.Shard of this rank's part")
        shards.append((node["s"], template))
        return template
    if "t" in node:
        key, md = node["t"], saved.get(node["t"])
        if md is None or not hasattr(md, "size"):
            raise CheckpointError(f"checkpoint {p} lacks the data of tensor `{key}`")
        if isinstance(template, torch.Tensor):
            if tuple(md.size) != tuple(template.shape):
                raise CheckpointError(f"checkpoint {p}: tensor `{key}` has shape {list(md.size)} there, "
                                      f"the state to load into has {list(template.shape)}")
            request[key] = template.detach()
            return template
        if isinstance(template, Shard):
            raise CheckpointError(f"checkpoint {p}: `{key}` is a whole tensor there, not a sliced one")
        request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return _Ref(key)
    if "o" in node:
        request[node["o"]] = None if template is _MISSING or isinstance(template, torch.Tensor | Shard) \
            else template
        return _Ref(node["o"])
    if "d" in node:
        sub = template if isinstance(template, Mapping) else {}
        return {k: _plan(p, v, sub.get(k, _MISSING), saved, request, shards) for k, v in node["d"]}
    items = node.get("l", node.get("u"))
    subs = template if isinstance(template, list | tuple) and len(template) == len(items) else [_MISSING] * len(items)
    out = [_plan(p, v, t, saved, request, shards) for v, t in zip(items, subs)]
    return out if "l" in node else tuple(out)


def _resolve(tree: Any, request: Mapping[str, Any]) -> Any:
    if isinstance(tree, _Ref):
        return request[tree.key]
    if isinstance(tree, dict):
        return {k: _resolve(v, request) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_resolve(v, request) for v in tree)
    return tree


def _dcp_load(p: Path, request: dict[str, Any], group: Any) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, checkpoint_id=str(p), process_group=group, no_dist=not _is_dist(group))
    except Exception as exc:  # noqa: BLE001
        text = str(exc).strip()
        raise CheckpointError(f"loading checkpoint {p} failed: {type(exc).__name__}: "
                              f"{text.splitlines()[0] if text else ''}") from None


def _plan_shard(p: Path, name: str, shard: Shard, layout: Any, saved: Mapping[str, Any],
                request: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Add the saved parts overlapping this rank's new part to `request`; returns (dst, src) copies."""
    if not isinstance(layout, dict) or layout.get("dim") != shard.dim or layout.get("total") != shard.total:
        raise CheckpointError(f"checkpoint {p}: sliced `{name}` was saved split along dim {layout.get('dim')} "
                              f"of size {layout.get('total')}, not dim {shard.dim} of size {shard.total}")
    start, stop = shard.bounds(shard.index)
    saved_split = tuple(layout["shares"]) if layout.get("shares") else layout["count"]
    copies = []
    for i in range(layout["count"]):
        s, e = share_bounds(shard.total, saved_split, i)
        lo, hi = max(s, start), min(e, stop)
        if lo >= hi:
            continue
        key = f"{name}.part-{i}-of-{layout['count']}"
        if key not in saved:
            raise CheckpointError(f"checkpoint {p} lacks part {i} of {layout['count']} of sliced `{name}`")
        shape = list(shard.part.shape)
        shape[shard.dim] = e - s
        if list(saved[key].size) != shape:
            raise CheckpointError(f"checkpoint {p}: part {i} of sliced `{name}` has shape {list(saved[key].size)}, "
                                  f"expected {shape}")
        buf = torch.empty(shape, dtype=shard.part.dtype, device=shard.part.device)
        request[key] = buf
        copies.append((shard.part.narrow(shard.dim, lo - start, hi - lo), buf.narrow(shard.dim, lo - s, hi - lo)))
    return copies


# ---------------------------------------------------------------------------------------------------------
# Executables: the state a schedule keeps sliced between calls
# ---------------------------------------------------------------------------------------------------------


def executable_state(exe: Any) -> dict[str, Shard]:
    """This rank's kept-sliced state of a torch-backend Executable, as Shards (saved and loaded in place).

    State the executable has not been given yet is allocated (uninitialised), so that loading into a fresh
    executable on any world size restores it; its next `run` then continues from the loaded values."""
    from .backends.inputs import local_shape
    from .ir.layout import placements
    from .ir.types import DTYPES, bind_shape

    out: dict[str, Shard] = {}
    for name in exe.plan.sliced_state:
        v = exe.program.inputs[name]
        if exe.rank not in v.group.ranks(exe.world_size):
            continue
        pos = v.position(exe.rank, exe.world_size)
        was = exe.plan.unsliced.get(name)
        if was is not None and not was.is_replicated:
            raise CheckpointError(f"state `{name}` is kept sliced along one mesh axis and was split along others "
                                  "before; executable_state saves state that was Replicated before it was sliced")
        axis, p = next((i, p) for i, p in enumerate(placements(v.layout, len(pos.coords))) if p.is_sliced)
        part = exe.kept.get(name)
        if part is None:
            part = exe.kept[name] = torch.empty(local_shape(v, exe.sizes, pos), dtype=DTYPES[v.dtype],
                                                device=exe.device)
        total = bind_shape(v.shape, exe.sizes)[p.dim]
        out[name] = Shard(part, p.dim, total, pos.coords[axis], pos.shape[axis], p.shares)
    return out
