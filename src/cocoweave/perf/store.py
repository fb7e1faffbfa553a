"""The measurement store: an append-only Parquet dataset, one immutable part file per `append`.

Every record is validated against `SCHEMA` before anything is written; a part is written under a
temporary name in the store folder and renamed into place, so a crash never leaves a half-written
part that `load` would read. A part that cannot be read (damaged on disk) is moved into the store's
`quarantine/` folder with a warning and the others load: one bad file never hides the rest, and no
file is ever deleted. Schema documented in docs/profiling.md.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import platform
import socket
import subprocess
import uuid
import warnings
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from cocoweave import settings
from cocoweave.errors import StoreError
from cocoweave.storage.statedir import state_dir

STORE_ENV = settings.STORE.name
DEFAULT_STORE = Path(".cocoweave") / "store"
PART_PREFIX = "part-"
PART_SUFFIX = ".parquet"
QUARANTINE = "quarantine"


class StoreWarning(UserWarning):
    """A part of the measurement store was skipped (unreadable: quarantined; another schema: left in place)."""

# column -> (arrow type, kind, nullable). Kinds: str, int, float, json (object), time (aware datetime).
COLUMNS: dict[str, tuple[pa.DataType, str, bool]] = {
    "program": (pa.string(), "str", False),
    "program_fingerprint": (pa.string(), "str", False),
    "schedule": (pa.string(), "str", False),
    "schedule_fingerprint": (pa.string(), "str", False),
    "sizes": (pa.string(), "json", False),
    "world_size": (pa.int64(), "int", False),
    "backend": (pa.string(), "str", False),
    "device": (pa.string(), "str", False),
    "stage_times_ms": (pa.string(), "json", False),
    "total_ms": (pa.float64(), "float", False),
    "iters": (pa.int64(), "int", False),
    "host": (pa.string(), "str", False),
    "git_commit": (pa.string(), "str", True),
    "versions": (pa.string(), "json", False),
    "time": (pa.timestamp("us", tz="UTC"), "time", False),
    "extra": (pa.string(), "json", False),
}
OPTIONAL_DEFAULTS: dict[str, Any] = {"extra": {}}
SCHEMA = pa.schema([pa.field(name, typ, nullable=nullable) for name, (typ, _, nullable) in COLUMNS.items()])


def _record_name(index: int, record: Mapping[str, Any]) -> str:
    program = record.get("program")
    return f"record {index}" + (f" (program {program!r})" if isinstance(program, str) else "")


def _json_object(value: Any, column: str, where: str) -> str:
    """A JSON object column: a dict, or a string holding a JSON object; stored as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise StoreError(f"column {column!r} of {where} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise StoreError(f"column {column!r} of {where} must be a JSON object (a dict), "
                         f"got {type(value).__name__}.")
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"column {column!r} of {where} cannot be stored as JSON: {exc}") from exc


def _check_stage_times(text: str, where: str) -> None:
    for stage, ms in json.loads(text).items():
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
            raise StoreError(f"column 'stage_times_ms' of {where}: stage {stage!r} has time {ms!r}, "
                             "expected a finite number of milliseconds.")


def _convert(column: str, value: Any, where: str) -> Any:
    """Check one value against its column's kind and return what Arrow stores."""
    _, kind, nullable = COLUMNS[column]
    if value is None:
        if nullable:
            return None
        raise StoreError(f"column {column!r} of {where} is None but the column is required.")
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "int" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if kind == "float" and isinstance(value, numbers.Real) and not isinstance(value, bool):
        if math.isfinite(value):
            return float(value)
        raise StoreError(f"column {column!r} of {where} is {value!r}, expected a finite number.")
    if kind == "json":
        return _json_object(value, column, where)
    if kind == "time" and isinstance(value, datetime):
        if value.tzinfo is None:
            raise StoreError(f"column {column!r} of {where} is a naive datetime; give a timezone-aware "
                             "one (UTC), e.g. from provenance().")
        return value.astimezone(UTC)
    expected = {"str": "str", "int": "int", "float": "float", "time": "datetime"}[kind]
    raise StoreError(f"column {column!r} of {where} has type {type(value).__name__}, expected {expected}.")


def validate(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check records against the schema and return them as Arrow-ready rows; StoreError names the
    offending column and record."""
    rows = []
    for index, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise StoreError(f"record {index} is a {type(record).__name__}, expected a dict of columns.")
        where = _record_name(index, record)
        unknown = sorted(set(record) - set(COLUMNS))
        if unknown:
            raise StoreError(f"{where} has unknown column {unknown[0]!r} (allowed columns: {', '.join(COLUMNS)}); "
                             "put free-form data in 'extra'.")
        row = {}
        for column in COLUMNS:
            if column not in record and column not in OPTIONAL_DEFAULTS:
                raise StoreError(f"{where} is missing column {column!r}.")
            row[column] = _convert(column, record.get(column, OPTIONAL_DEFAULTS.get(column)), where)
        _check_stage_times(row["stage_times_ms"], where)
        rows.append(row)
    return rows


def _git_commit(cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def provenance(cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """Host, git commit (None outside a repository), library versions and the current UTC time."""
    from ..version import __version__

    return {
        "host": socket.gethostname(),
        "git_commit": _git_commit(Path(cwd) if cwd is not None else Path.cwd()),
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "triton": _version("triton"), "cocoweave": __version__},
        "time": datetime.now(UTC),
    }


def default_store_path() -> Path:
    """$COCOWEAVE_STORE if set, else .cocoweave/store under the current directory."""
    return settings.STORE.get() or state_dir() / DEFAULT_STORE.name


class MeasurementStore:
    """Append-only Parquet measurement dataset in one folder (see module docstring)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_store_path()

    def parts(self) -> list[Path]:
        """The committed part files, oldest name first (temporary files are never listed)."""
        if not self.path.is_dir():
            return []
        return sorted(p for p in self.path.iterdir()
                      if p.name.startswith(PART_PREFIX) and p.name.endswith(PART_SUFFIX))

    def append(self, records: Iterable[Mapping[str, Any]]) -> Path | None:
        """Validate `records` and write them as one new part; returns its path (None if no records)."""
        rows = validate(records)
        if not rows:
            return None
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the measurement store folder {self.path}: {exc}") from exc
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        final = self.path / f"{PART_PREFIX}{stamp}-{uuid.uuid4().hex[:12]}{PART_SUFFIX}"
        tmp = self.path / f".tmp-{final.name}"
        try:
            pq.write_table(table, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StoreError(f"cannot write a part to the measurement store {self.path}: {exc}") from exc
            raise
        return final

    def load(self) -> pd.DataFrame:
        """Every stored record as a DataFrame with the schema's columns (empty frame if nothing is stored).
        Unreadable parts are quarantined and parts of another schema skipped, each with a StoreWarning."""
        tables = []
        for part in self.parts():
            try:
                table = pq.read_table(part)
            except (OSError, pa.ArrowException) as exc:
                warnings.warn(f"measurement store part {part} is unreadable ({exc}); {self._quarantine(part)}",
                              StoreWarning, stacklevel=2)
                continue
            if not table.schema.equals(SCHEMA):
                warnings.warn(f"measurement store part {part} does not have the store's schema; skipped it",
                              StoreWarning, stacklevel=2)
                continue
            tables.append(table)
        if not tables:
            return SCHEMA.empty_table().to_pandas()
        return pa.concat_tables(tables).to_pandas()

    def _quarantine(self, part: Path) -> str:
        """Move an unreadable part out of the way (never delete it); says where it went."""
        target = self.path / QUARANTINE / part.name
        try:
            target.parent.mkdir(exist_ok=True)
            os.replace(part, target)
        except FileNotFoundError:
            return "another reader moved it already"
        except OSError as exc:
            return f"skipped it (it could not be moved to {target.parent}: {exc.strerror or exc})"
        return f"moved it to {target} and read the others"
