"""The folder of a checkpoint: its manifest of sizes and sha256 sums, the completion marker written last, the
swap that puts a complete checkpoint in place in one step; `info`, `verify` and `latest` read them."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import faults
from ..errors import CheckpointError

MARKER = "COMPLETE.json"
PARTIAL = ".partial"
OLD = ".old"
FORMAT = 2  # 2: a manifest of sizes and sha256 per file, JSON leaves in the skeleton
SKELETON = "__skeleton__"  # per rank: the nested structure of what it saved (JSON)
_STEP_DIR = re.compile(rf"^step-(\d+)({re.escape(OLD)})?$")


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

