"""The machine catalog the planner chooses from: machine types (GPU, GPUs per node, networks, prices,
revocation rate, startup time), the GPUs' and networks' spec-sheet figures for modelled predictions, and
the parameter-server machine (always on-demand) for CM-DARE profiles.

The package ships a cited default (`cluster/data/catalog.yaml`); `--catalog FILE` replaces it. A catalog
may leave out `gpus`/`networks` (then only measured or CM-DARE profiles can be planned on it) and
`parameter_server` (then only profiles without parameter servers can).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cocoweave.cluster.yamlio import load_yaml
from cocoweave.errors import PlanningError

DEFAULT_CATALOG = Path(__file__).resolve().parent / "data" / "catalog.yaml"


@dataclass(frozen=True)
class MachineType:
    """One machine type; `spot_per_hour` None means it has no revocable offer. Prices, revocations and
    startup are per machine (node) of `gpus_per_node` GPUs."""

    name: str
    gpu: str
    on_demand_per_hour: float
    spot_per_hour: float | None
    revocations_per_hour: float
    startup_s: float
    gpus_per_node: int = 1
    intra_node: str | None = None  # network key between the GPUs of one node
    inter_node: str | None = None  # network key between nodes

    def nodes(self, gpus: int) -> int:
        """Machines needed for `gpus` GPUs (whole machines are rented)."""
        return -(-gpus // self.gpus_per_node)


@dataclass(frozen=True)
class GPUSpec:
    """Spec-sheet figures of one GPU: dense peak TFLOP/s per dtype, memory bandwidth and size."""

    key: str
    name: str
    tflops: dict[str, float]
    hbm_gb_s: float
    memory_gb: float
    source: str

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype` (float32's when that dtype has no entry)."""
        return 1e12 * self.tflops.get(dtype, self.tflops["float32"])


@dataclass(frozen=True)
class NetworkSpec:
    """One link: bandwidth per GPU and direction (GB/s) and the latency of one message step (us)."""

    key: str
    bandwidth_gb_s: float
    latency_us: float
    source: str


@dataclass(frozen=True)
class Catalog:
    """Machine types, the parameter-server price (None: no parameter servers) and the hardware figures."""

    machines: tuple[MachineType, ...]
    ps_name: str | None
    ps_per_hour: float | None
    gpus: dict[str, GPUSpec] = field(default_factory=dict)
    networks: dict[str, NetworkSpec] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=lambda: {"compute": 1.0, "memory": 1.0, "network": 1.0})
    launch_us: float = 0.0
    source: str = ""


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


def _mapping(doc: dict, key: str, where: str) -> dict:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise PlanningError(f"{where}: {key!r} must be a mapping, got {type(value).__name__}.")
    return value


def _machine(entry: Any, where: str, networks: dict[str, NetworkSpec]) -> MachineType:
    if not isinstance(entry, dict):
        raise PlanningError(f"{where} must be a mapping with name, gpu, prices, revocation rate and startup.")
    per_node = entry.get("gpus_per_node", 1)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise PlanningError(f"{where}: 'gpus_per_node' must be a positive integer, got {per_node!r}.")
    links = {}
    for key in ("intra_node", "inter_node"):
        link = entry.get(key)
        if link is not None and link not in networks:
            raise PlanningError(f"{where}: {key} {link!r} is not one of the catalog's networks "
                                f"({', '.join(sorted(networks)) or 'none'}).")
        links[key] = link
    return MachineType(
        name=_text(entry, "name", where), gpu=_text(entry, "gpu", where).upper(),
        on_demand_per_hour=_number(entry, "on_demand_per_hour", where),
        spot_per_hour=_number(entry, "spot_per_hour", where, optional=True),
        revocations_per_hour=_number(entry, "revocations_per_hour", where, optional=True) or 0.0,
        startup_s=_number(entry, "startup_s", where), gpus_per_node=per_node, **links)


def _gpu(key: str, entry: Any, where: str) -> GPUSpec:
    if not isinstance(entry, dict) or not isinstance(entry.get("tflops"), dict):
        raise PlanningError(f"{where} must be a mapping with name, tflops {{dtype: TFLOP/s}}, hbm_gb_s, memory_gb "
                            "and source.")
    tflops = {str(k): _number(entry["tflops"], k, f"{where}: tflops") for k in entry["tflops"]}
    if "float32" not in tflops:
        raise PlanningError(f"{where}: tflops needs a float32 entry.")
    return GPUSpec(key.upper(), _text(entry, "name", where), tflops, _number(entry, "hbm_gb_s", where),
                   _number(entry, "memory_gb", where), _text(entry, "source", where))


def _network(key: str, entry: Any, where: str) -> NetworkSpec:
    if not isinstance(entry, dict):
        raise PlanningError(f"{where} must be a mapping with bandwidth_gb_s, latency_us and source.")
    bandwidth = _number(entry, "bandwidth_gb_s", where)
    if not bandwidth:
        raise PlanningError(f"{where}: 'bandwidth_gb_s' must be positive.")
    return NetworkSpec(key, bandwidth, _number(entry, "latency_us", where), _text(entry, "source", where))


def parse_catalog(doc: Any, source: str) -> Catalog:
    """Validate a catalog document (the parsed YAML); errors name the file and the entry."""
    if not isinstance(doc, dict) or not isinstance(doc.get("machines"), list) or not doc["machines"]:
        raise PlanningError(f"{source}: a catalog needs a non-empty 'machines' list.")
    networks = {str(k): _network(str(k), v, f"{source}: networks[{k!r}]")
                for k, v in _mapping(doc, "networks", source).items()}
    gpus = {str(k).upper(): _gpu(str(k), v, f"{source}: gpus[{k!r}]") for k, v in _mapping(doc, "gpus", source).items()}
    machines = tuple(_machine(m, f"{source}: machines[{i}]", networks) for i, m in enumerate(doc["machines"]))
    names = [m.name for m in machines]
    if len(set(names)) != len(names):
        raise PlanningError(f"{source}: machine names must be unique.")
    ps, ps_name, ps_price = doc.get("parameter_server"), None, None
    if ps is not None:
        if not isinstance(ps, dict):
            raise PlanningError(f"{source}: 'parameter_server' must be a mapping with name and on_demand_per_hour.")
        where = f"{source}: parameter_server"
        ps_name, ps_price = _text(ps, "name", where), _number(ps, "on_demand_per_hour", where)
    eff = _mapping(doc, "efficiency", source)
    efficiency = {k: _number(eff, k, f"{source}: efficiency", optional=True) or 1.0
                  for k in ("compute", "memory", "network")}
    if any(not 0 < v <= 1 for v in efficiency.values()):
        raise PlanningError(f"{source}: efficiency factors must lie in (0, 1], got {efficiency}.")
    launch = _number(doc, "launch_us", source, optional=True) or 0.0
    return Catalog(machines, ps_name, ps_price, gpus, networks, efficiency, launch, source)


def load_catalog(path: str | os.PathLike | None = None) -> Catalog:
    """Read and validate a YAML catalog file (the package's default catalog when `path` is None)."""
    path = DEFAULT_CATALOG if path is None else path
    return parse_catalog(load_yaml(path, "catalog"), str(path))
