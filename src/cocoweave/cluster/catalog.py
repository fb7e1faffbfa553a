"""The machine catalog the planner chooses from: GPU machine types with prices, revocation rates and
startup times, and the parameter-server machine (always on-demand)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cocoweave.cluster.yamlio import load_yaml
from cocoweave.errors import PlanningError


@dataclass(frozen=True)
class MachineType:
    """One GPU worker machine type; `spot_per_hour` None means it has no revocable offer."""

    name: str
    gpu: str
    on_demand_per_hour: float
    spot_per_hour: float | None
    revocations_per_hour: float
    startup_s: float


@dataclass(frozen=True)
class Catalog:
    """GPU machine types and the parameter-server price."""

    machines: tuple[MachineType, ...]
    ps_name: str
    ps_per_hour: float


def _number(entry: dict, key: str, where: str, optional: bool = False) -> float | None:
    value = entry.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise PlanningError(f"{where}: {key!r} must be a non-negative number, got {value!r}.")
    return float(value)


def _text(entry: dict, key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise PlanningError(f"{where}: {key!r} must be a non-empty string, got {value!r}.")
    return value


def _machine(entry: Any, where: str) -> MachineType:
    if not isinstance(entry, dict):
        raise PlanningError(f"{where} must be a mapping with name, gpu, prices, revocation rate and startup.")
    return MachineType(
        name=_text(entry, "name", where), gpu=_text(entry, "gpu", where).upper(),
        on_demand_per_hour=_number(entry, "on_demand_per_hour", where),
        spot_per_hour=_number(entry, "spot_per_hour", where, optional=True),
        revocations_per_hour=_number(entry, "revocations_per_hour", where, optional=True) or 0.0,
        startup_s=_number(entry, "startup_s", where))


def parse_catalog(doc: Any, source: str) -> Catalog:
    """Validate a catalog document (the parsed YAML); errors name the file and the entry."""
    if not isinstance(doc, dict) or not isinstance(doc.get("machines"), list) or not doc["machines"]:
        raise PlanningError(f"{source}: a catalog needs a non-empty 'machines' list.")
    ps = doc.get("parameter_server")
    if not isinstance(ps, dict):
        raise PlanningError(f"{source}: a catalog needs a 'parameter_server' entry with name and "
                            "on_demand_per_hour.")
    machines = tuple(_machine(m, f"{source}: machines[{i}]") for i, m in enumerate(doc["machines"]))
    names = [m.name for m in machines]
    if len(set(names)) != len(names):
        raise PlanningError(f"{source}: machine names must be unique.")
    where = f"{source}: parameter_server"
    return Catalog(machines, _text(ps, "name", where), _number(ps, "on_demand_per_hour", where))


def load_catalog(path: str | os.PathLike) -> Catalog:
    """Read and validate a YAML catalog file."""
    return parse_catalog(load_yaml(path, "catalog"), str(path))


def default_catalog_path() -> Path:
    """examples/catalog.yaml found above the current directory or above this package."""
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for folder in (start, *start.parents):
            candidate = folder / "examples" / "catalog.yaml"
            if candidate.is_file():
                return candidate
    raise PlanningError("no catalog given and no examples/catalog.yaml found; pass --catalog FILE.")
