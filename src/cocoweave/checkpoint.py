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
DCP's own classes and other entries are read with `torch.load(weights_only=True)` (cocoweave.safe_dcp);
`trusted=True` lifts that, for checkpoints you trust, as torch.load's `weights_only=False` does. State the
template has and the checkpoint lacks (a tensor or a Shard) is refused, so is sliced state the checkpoint
has and the template lacks (e.g. after a schedule that keeps other state sliced).

Atomicity: ranks write into `PATH.partial`; after DCP has gathered every rank's writes and written its
metadata, rank 0 writes the completion marker `COMPLETE.json` (fsync'ed) and renames the directory to
`PATH`; over an existing checkpoint it swaps the two directories in one step (Linux renameat2
RENAME_EXCHANGE; elsewhere two renames, and `latest` finds `PATH.old` in between). A save that crashes at
any point leaves at most a `.partial` directory, which `load` refuses and `latest` ignores. Ranks on
several hosts need a filesystem they all see at `PATH`.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
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
from .safe_dcp import SafePlanner, SafeReader, UnsafeCheckpoint, first_failure
from .sharding import is_dtensor, places_like_dtensor

MARKER = "COMPLETE.json"
PARTIAL = ".partial"
OLD = ".old"
FORMAT = 2  # 2: a manifest of sizes and sha256 per file, JSON leaves in the skeleton
SKELETON = "__skeleton__"  # per rank: the nested structure of what it saved (JSON)
_STEP_DIR = re.compile(rf"^step-(\d+)({re.escape(OLD)})?$")
log = logging.getLogger(__name__)


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


def as_shard(value: Any) -> Any:
    """A DTensor as this format holds it: a Shard of this rank's part (sharded on one mesh dim; its part aliases the
    local tensor, so a load fills the DTensor in place), or its local tensor (replicated); anything else as it is."""
    if not is_dtensor(value):
        return value
    sharded = [(i, pl.dim) for i, pl in enumerate(value.placements) if pl.is_shard()]
    part = value._local_tensor
    if not sharded:
        return part
    if len(sharded) > 1 or any(pl.is_partial() for pl in value.placements):
        raise CheckpointError(f"a DTensor sharded on {len(sharded)} mesh dims ({list(value.placements)}) is not "
                              "supported by cocoweave.checkpoint; save it with torch.distributed.checkpoint")
    i, dim = sharded[0]
    mesh, size = value.device_mesh, value.shape[dim]
    count = mesh.size(i)
    if places_like_dtensor(size, count):  # DTensor's torch.chunk parts are the Shard's own tensor_split parts
        return Shard(part, dim, size, mesh.get_local_rank(i), count)
    sizes = [len(c) for c in torch.arange(size).chunk(count)]
    if len(sizes) != count:
        raise CheckpointError(f"a DTensor of {size} rows along dim {dim} split over {count} ranks leaves a rank "
                              "empty; cocoweave.checkpoint cannot place it")
    return Shard(part, dim, size, mesh.get_local_rank(i), count, tuple(sizes))


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


def _describe(exc: BaseException, behind: BaseException | None = None) -> str:
    """One line for a failure, saying first that the disk is full when that is the cause anywhere behind it (or
    behind `behind`, e.g. every rank's failure of a DCP CheckpointException): DCP's writer threads wrap the OSError
    in their own exceptions, which alone do not say so."""
    text = str(exc).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    full = _no_space(behind if behind is not None else exc)
    return line if full is None or full in line else f"the disk is full ({full}); {line}"


_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


def _no_space(exc: BaseException) -> str | None:
    """The strerror of a no-space (or quota) OSError in `exc`'s causes, contexts or DCP failures, else None."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return _FULL[e.errno]
        text = str(e)
        for code, words in _FULL.items():
            if words in text or f"[Errno {code}]" in text:
                return words
        stack += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [w[0] if isinstance(w, tuple) and w else w for w in failures.values()
                      if isinstance(w[0] if isinstance(w, tuple) and w else w, BaseException)]
    return None


def _from_rank0(value: Any, group: Any) -> Any:
    """Rank 0's `value` on every rank of `group` (a barrier that carries rank 0's outcome)."""
    if not _is_dist(group):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _complete(tmp: Path, final: Path, step: int | None, world_size: int, meta: Mapping[str, Any] | None) -> None:
    """Rank 0: write the manifest and completion marker into `tmp`, then put it at `final` in one step."""
    files = {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(tmp.iterdir()) if f.is_file()}
    record = {"format": FORMAT, "step": step, "world_size": world_size, "time": time.time(),
              "meta": dict(meta or {}), "files": files}
    with open(tmp / MARKER, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if not final.exists():
        os.replace(tmp, final)
    elif _exchange(tmp, final):  # the new checkpoint is at `final`, the old one at `tmp`
        faults.maybe_fault(0, 2, "checkpoint")
        shutil.rmtree(tmp, ignore_errors=True)
    else:  # no atomic swap here: `latest` finds PATH.old between the two renames
        old = final.with_name(final.name + OLD)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        faults.maybe_fault(0, 2, "checkpoint")
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(final.with_name(final.name + OLD), ignore_errors=True)  # left by a crash in an earlier save
    _fsync_dir(final.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where that is not possible."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    """The completion record of the checkpoint at `path` (step, world size, meta, files); CheckpointError if
    `path` is missing or incomplete."""
    p = Path(path)
    if not p.is_dir():
        partial = p.with_name(p.name + PARTIAL)
        why = "only an interrupted save was found there" if partial.exists() else "no such directory"
        raise CheckpointError(f"checkpoint {p} cannot be loaded: {why}")
    try:
        with open(p / MARKER, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {p} is incomplete (no {MARKER}): its save was interrupted") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {p} has an unreadable {MARKER}: {exc}") from None
    if not isinstance(record, dict) or record.get("format") not in (1, FORMAT):
        got = record.get("format") if isinstance(record, dict) else record
        raise CheckpointError(f"checkpoint {p} has format {got!r}; this cocoweave reads {FORMAT}")
    return record


def verify(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every file of the checkpoint at `path` against its manifest (size, then sha256), and that no
    other file is there; returns the completion record, or raises CheckpointError naming the first bad file."""
    p = Path(path)
    record = info(p)
    files = record.get("files")
    if record["format"] < FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {p} has no manifest of its files (format {record['format']}, written "
                              "by an older cocoweave); load it with trusted=True if you trust it")
    present = {f.name for f in p.iterdir()} - {MARKER}
    for name in sorted(set(files) | present):
        f, want = p / name, files.get(name)
        if not isinstance(want, dict):
            raise CheckpointError(f"checkpoint {p} has a file {name} that its manifest does not list")
        if name not in present:
            raise CheckpointError(f"checkpoint {p} lacks its file {name}")
        size = f.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(f"checkpoint {p}: file {name} has {size} bytes, its manifest says "
                                  f"{want.get('size')} (truncated or damaged)")
        if _sha256(f) != want.get("sha256"):
            raise CheckpointError(f"checkpoint {p}: file {name} does not match its sha256 checksum (damaged)")
    return record


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint `root/step-N` with the largest N, or None (interrupted saves are skipped).
    Where a re-save of step N was cut between its two renames (systems without an atomic swap), the
    previous `root/step-N.old` stands in for it. A directory listing is no snapshot: a rename running while it
    is read can hide both names, so a listing that finds only save-in-progress entries is read again."""
    rootp = Path(root)
    for _ in range(50):
        if not rootp.is_dir():
            return None
        best: tuple[int, bool, Path] | None = None
        in_progress = False
        for child in rootp.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / MARKER).is_file():
                key = (int(m.group(1)), m.group(2) is None, child)  # step-N beats step-N.old
                if best is None or key[:2] > best[:2]:
                    best = key
            in_progress |= child.name.endswith((PARTIAL, OLD))
        if best is not None or not in_progress:
            return best[2] if best else None
        time.sleep(0.001)
    return None


def step_path(root: str | os.PathLike[str], step: int) -> Path:
    """Where `latest` looks for the checkpoint of step `step`: root/step-00000042."""
    return Path(root) / f"step-{step:08d}"


def load(path: str | os.PathLike[str], state: Mapping[str, Any], *, group: Any = None,
         trusted: bool = False) -> dict[str, Any]:
    """Read the entries of `state`'s top-level keys from the checkpoint at `path` (every rank of `group`
    calls it); returns them as a nested dict.

    Every file is checked against the checkpoint's manifest before anything is read. Tensors and Shards in
    `state` are filled in place (a Shard may be for another group size than the saved parts); everything
    else comes back as saved (new tensors, on the CPU), so that a template like an optimizer's state dict
    before its first step loads whatever state was saved. A tensor or Shard of `state` the checkpoint lacks,
    or sliced state it has that `state` lacks, is refused. `trusted=True` (only for checkpoints you trust:
    code in them can run) also loads pickled objects and checkpoints without a manifest."""
    p = Path(path)
    _verify_once(p, trusted, group)
    log.info("loading checkpoint %s (rank %d)", p, _rank(group))
    reader = dcp.FileSystemReader if trusted else SafeReader
    try:
        saved = reader(str(p)).read_metadata().state_dict_metadata
    except UnsafeCheckpoint as exc:
        raise CheckpointError(f"checkpoint {p} is refused: {exc}; load it with trusted=True only if you trust "
                              "where it came from") from None
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {p} has unreadable DCP metadata: {type(exc).__name__}: {exc}") from None
    # First read the small records: every rank's skeleton and the saved split of every sliced tensor.
    records = {k: "" for k in saved if k.startswith(SKELETON + "/") or k.endswith(".layout")}
    _dcp_load(p, records, group, reader, trusted)
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
    plan = _Planner(p, saved, request, shards, trusted, records)
    tree = {k: plan.node(top[k], state[k], str(k)) for k in state}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, shard in shards:  # read only the saved parts that overlap this rank's part
        copies += _plan_shard(p, name, shard, json.loads(records[f"{name}.layout"]), saved, request)
    _dcp_load(p, request, group, reader, trusted)
    for dst, src in copies:
        dst.copy_(src)
    return _resolve(tree, request)


def _verify_once(p: Path, trusted: bool, group: Any) -> None:
    """Rank 0 of `group` checks the checkpoint's files against its manifest (hashing each once, however many ranks
    load it) and every rank gets its verdict: the same CheckpointError on all, or none."""
    error = None
    if _rank(group) == 0:
        try:
            if not (trusted and info(p)["format"] < FORMAT):
                verify(p)
        except CheckpointError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"checkpoint {p} cannot be read: {exc.strerror or exc}"
    error = _from_rank0(error, group)
    if error is not None:
        raise CheckpointError(error)


_MISSING = object()


@dataclass
class _Ref:
    key: str


def _holds_state(template: Any) -> bool:
    """Whether a template value is, or contains, a tensor or a Shard (state that must be loaded)."""
    if isinstance(template, torch.Tensor | Shard):
        return True
    if isinstance(template, Mapping):
        return any(_holds_state(v) for v in template.values())
    if isinstance(template, list | tuple):
        return any(_holds_state(v) for v in template)
    return False


_KINDS = {"d": "a dict", "l": "a list", "u": "a tuple", "v": "a plain value", "o": "an object"}


@dataclass
class _Planner:
    """What to read for each saved skeleton node into the template; builds the result tree with _Refs."""

    p: Path
    saved: Mapping[str, Any]
    request: dict[str, Any]
    shards: list[tuple[str, Shard]]
    trusted: bool
    layouts: Mapping[str, str]  # the saved split of every sliced tensor (JSON)

    def node(self, node: Any, template: Any, where: str) -> Any:
        if is_dtensor(template):  # filled in place through its local tensor; the result holds the DTensor
            plain = as_shard(template)
            result = self.node(node, plain, where)
            return template if result is plain else result
        if "s" in node:
            if template is _MISSING:
                raise CheckpointError(f"checkpoint {self.p} holds sliced state `{where}` that the state to load into "
                                      "lacks (was it saved with a schedule that keeps other state sliced?)")
            dim = json.loads(self.layouts[f"{node['s']}.layout"])["dim"]
            if isinstance(template, torch.Tensor) and template.dim() > dim:  # a whole tensor: the one part of one
                self.shards.append((node["s"], Shard(template.detach(), dim, template.shape[dim], 0, 1)))
                return template
            if not isinstance(template, Shard):
                raise CheckpointError(f"checkpoint {self.p}: `{where}` is sliced there; load it into a "
                                      "checkpoint.Shard of this rank's part")
            self.shards.append((node["s"], template))
            return template
        if "t" in node:
            return self.tensor(node["t"], template)
        if isinstance(template, torch.Tensor | Shard):
            kind = next(_KINDS[k] for k in _KINDS if k in node)
            raise CheckpointError(f"checkpoint {self.p}: `{where}` is {kind} there, the state to load into has a "
                                  f"{'sliced ' if isinstance(template, Shard) else ''}tensor")
        if "v" in node:
            return node["v"]
        if "o" in node:
            if not self.trusted:
                raise CheckpointError(f"checkpoint {self.p} holds a pickled object at `{where}`; load it with "
                                      "trusted=True only if you trust where it came from")
            self.request[node["o"]] = None if template is _MISSING else template
            return _Ref(node["o"])
        if "d" in node:
            sub = template if isinstance(template, Mapping) else {}
            keys = {json.dumps(k) for k, _ in node["d"]}
            lost = [k for k, v in sub.items() if json.dumps(k) not in keys and _holds_state(v)]
            if lost:
                raise CheckpointError(f"checkpoint {self.p} has no entry `{where}/{lost[0]}`, which the state to "
                                      "load into has (it would be left as it is)")
            return {k: self.node(v, sub.get(k, _MISSING), f"{where}/{k}") for k, v in node["d"]}
        items = node.get("l", node.get("u"))
        fits = isinstance(template, list | tuple) and len(template) == len(items)
        if not fits and _holds_state(template):
            raise CheckpointError(f"checkpoint {self.p}: `{where}` has {len(items)} items there, the state to load "
                                  f"into has {len(template)}")
        subs = template if fits else [_MISSING] * len(items)
        out = [self.node(v, t, f"{where}/{i}") for i, (v, t) in enumerate(zip(items, subs))]
        return out if "l" in node else tuple(out)

    def tensor(self, key: str, template: Any) -> Any:
        md = self.saved.get(key)
        if md is None or not hasattr(md, "size"):
            raise CheckpointError(f"checkpoint {self.p} lacks the data of tensor `{key}`")
        if isinstance(template, torch.Tensor):
            if tuple(md.size) != tuple(template.shape):
                raise CheckpointError(f"checkpoint {self.p}: tensor `{key}` has shape {list(md.size)} there, "
                                      f"the state to load into has {list(template.shape)}")
            self.request[key] = template.detach()
            return template
        if isinstance(template, Shard):
            raise CheckpointError(f"checkpoint {self.p}: `{key}` is a whole tensor there, not a sliced one")
        self.request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return _Ref(key)


def _resolve(tree: Any, request: Mapping[str, Any]) -> Any:
    if isinstance(tree, _Ref):
        return request[tree.key]
    if isinstance(tree, dict):
        return {k: _resolve(v, request) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_resolve(v, request) for v in tree)
    return tree


def _dcp_load(p: Path, request: dict[str, Any], group: Any, reader: Any, trusted: bool) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, storage_reader=reader(str(p)), planner=None if trusted else SafePlanner(),
                     process_group=group, no_dist=not _is_dist(group))
    except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        cause = first_failure(exc)
        if isinstance(cause, UnsafeCheckpoint):
            raise CheckpointError(f"checkpoint {p} is refused: {cause}; load it with trusted=True only if you "
                                  "trust where it came from") from None
        raise CheckpointError(f"loading checkpoint {p} failed: {_describe(cause)}") from None


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
    from .ir.layout import placements
    from .ir.types import bind_shape

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
        part = exe.state_part(name)
        total = bind_shape(v.shape, exe.sizes)[p.dim]
        out[name] = Shard(part, p.dim, total, pos.coords[axis], pos.shape[axis], p.shares)
    return out
