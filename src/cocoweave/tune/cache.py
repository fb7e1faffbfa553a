"""The tuner's cache: the chosen schedule per (program fingerprint, sizes, world size, backend, device).

One JSON file (`.cocoweave/tune-cache.json`, or $COCOWEAVE_TUNE_CACHE). Every write takes a lock
file, re-reads the file, changes one entry, writes a temporary file, fsyncs it and renames it into
place, so readers never see half-written state and concurrent tuners never lose each other's entries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from .. import settings
from ..errors import CocoweaveError, ScheduleError
from ..ir.graph import Program
from ..schedule.schedule import Schedule
from ..storage.atomic import write_text
from ..storage.statedir import state_dir

log = logging.getLogger(__name__)

CACHE_ENV = settings.TUNE_CACHE.name
VERSION = 1
LOCK_TIMEOUT_S = 60.0  # how long a write waits for another process's write to the same cache


def default_cache_path() -> Path:
    """$COCOWEAVE_TUNE_CACHE if set, else .cocoweave/tune-cache.json under the current directory."""
    return settings.TUNE_CACHE.get() or state_dir() / "tune-cache.json"


def cache_key(program: Program, sizes: Mapping[str, int], world_size: int, backend: str, device: str) -> str:
    """The key of one tuning problem; `device` is a device type ("cpu", "cuda")."""
    sized = json.dumps({k: int(v) for k, v in sizes.items() if k in program.size_names()}, sort_keys=True)
    return f"{program.fingerprint()}|{sized}|w{world_size}|{backend}|{device.split(':')[0]}"


class TuneCache:
    """Chosen schedules by `cache_key`, persisted atomically as JSON."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {}
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise CocoweaveError(f"the tuning cache {self.path} is not UTF-8 text (byte {exc.start} cannot be "
                                 "decoded); delete it to start over.") from None
        except (OSError, ValueError) as exc:
            raise CocoweaveError(f"the tuning cache {self.path} is unreadable ({exc}); "
                                 "delete it to start over.") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), dict):
            raise CocoweaveError(f"the tuning cache {self.path} has no 'entries' object; delete it to start over.")
        bad = next((k for k, v in doc["entries"].items() if not isinstance(v, dict)), None)
        if bad is not None:
            raise CocoweaveError(f"the tuning cache {self.path} has an entry {bad!r} that is not an object; "
                                 "delete it to start over.")
        return doc["entries"]

    def entries(self) -> dict[str, Any]:
        """Every cached entry by key."""
        return self._read()

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry for `key`, or None."""
        return self._read().get(key)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            with FileLock(lock, timeout=LOCK_TIMEOUT_S):
                yield
        except Timeout:
            raise CocoweaveError(f"the tuning cache {self.path} stayed locked by another process for "
                                 f"{LOCK_TIMEOUT_S:g} s ({lock}); try again when it has finished.") from None

    def put(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store `entry` under `key` (replacing an older one) atomically."""
        try:
            with self._locked():
                entries = self._read()
                entries[key] = dict(entry) | {"time": datetime.now(UTC).isoformat()}
                text = json.dumps({"version": VERSION, "entries": entries}, indent=2, sort_keys=True) + "\n"
                write_text(self.path, text)
                log.info("tuning cache %s: %s -> %s", self.path, key, entry.get("schedule"))
        except OSError as exc:
            raise CocoweaveError(f"cannot write the tuning cache {self.path}: {exc.strerror or exc}.") from None


def cached_schedule(program: Program, sizes: Mapping[str, int], world_size: int, backend: str, device: str,
                    cache: TuneCache | None = None) -> Schedule | None:
    """The cached choice for this problem rebuilt on `program`, or None (with a warning saying why) if nothing
    usable is cached: a cache that cannot be read counts as no choice, so training never fails because of it."""
    try:
        cache = cache or TuneCache()  # a refused state folder (storage.statedir): no choice, with a warning
        entry = cache.get(cache_key(program, sizes, world_size, backend, device))
    except CocoweaveError as exc:
        warnings.warn(f"{str(exc).rstrip('.')}; using no tuned schedule", stacklevel=2)
        return None
    if entry is None:
        return None
    if not _not_slower(entry):
        warnings.warn(f"the cached schedule {entry.get('schedule')!r} for {program.name} measured "
                      f"{entry.get('measured_ms')} ms against {entry.get('baseline_ms')} ms for the program as "
                      "written; ignoring it", stacklevel=2)
        return None
    try:
        return Schedule(program, entry["steps"])
    except (ScheduleError, KeyError, TypeError, AttributeError, ValueError) as exc:
        warnings.warn(f"the cached schedule {entry.get('schedule')!r} for {program.name} no longer applies "
                      f"({type(exc).__name__}: {exc}); ignoring it", stacklevel=2)
        return None


def _not_slower(entry: Mapping[str, Any]) -> bool:
    """False when a cached choice's own measurements say it is slower than the program as written (the tuner never
    writes one; an older tuner or a hand-edited cache may have); an entry without both times is taken as given."""
    ms, base = entry.get("measured_ms"), entry.get("baseline_ms")
    if not entry.get("steps") or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (ms, base)):
        return True
    return ms <= base  # False when either is NaN

