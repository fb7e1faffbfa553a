"""The machine catalog the planner chooses from: machine types (GPU, GPUs per node, networks, prices,
revocation rate, startup time), the GPUs' and networks' spec-sheet figures for modelled predictions, and
the parameter-server machine (always on-demand) for CM-DARE profiles.

The package ships a cited default (`cluster/data/catalog.yaml`); `--catalog FILE` replaces it. A catalog
may leave out `gpus`/`networks` (then only measured or CM-DARE profiles can be planned on it) and
`parameter_server` (then only profiles without parameter servers can).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from cocoweave.cluster.schema import Strict, validate
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
    gemm_efficiency: float | None = None  # fraction of peak large GEMMs reach, where measured (LLM planner)
    family: str | None = None  # architecture ("hopper"): the LLM planner's stacks are calibrated per family

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

    def gpu_of(self, machine: MachineType) -> GPUSpec:
        """The spec-sheet entry of `machine`'s GPU (what modelling it needs); PlanningError where there is none."""
        gpu = self.gpus.get(machine.gpu)
        if gpu is None:
            raise PlanningError(f"the catalog {self.source} has no spec-sheet entry for GPU {machine.gpu} "
                                f"(machine {machine.name}); add it under 'gpus'.")
        return gpu

    def modellable(self, machine: MachineType, dtype: str | None = None, whole_nodes: bool = False) -> bool:
        """Whether this catalog has what modelling `machine` needs: its GPU's figures (with `dtype`'s peak, where
        given) and a network for its world; with `whole_nodes` (the LLM planner: whole nodes, each group on its own
        link) the network across nodes and, past one GPU per node, the one inside."""
        gpu = self.gpus.get(machine.gpu)
        if gpu is None or dtype is not None and dtype not in gpu.tflops:
            return False
        if whole_nodes:
            return machine.inter_node is not None and (machine.gpus_per_node == 1 or machine.intra_node is not None)
        return machine.inter_node is not None or machine.intra_node is not None


NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(gt=0, le=1)]


class _GPU(Strict):
    name: str = Field(min_length=1)
    tflops: dict[str, NonNegative]
    hbm_gb_s: NonNegative
    memory_gb: NonNegative
    source: str = Field(min_length=1)
    gemm_efficiency: Fraction | None = None
    family: str | None = Field(default=None, min_length=1, max_length=40)


class _Network(Strict):
    bandwidth_gb_s: Positive
    latency_us: NonNegative
    source: str = Field(min_length=1)


class _Machine(Strict):
    name: str = Field(min_length=1)
    gpu: str = Field(min_length=1)
    on_demand_per_hour: NonNegative
    spot_per_hour: NonNegative | None = None
    revocations_per_hour: NonNegative = 0.0
    startup_s: NonNegative
    gpus_per_node: int = Field(default=1, ge=1)
    intra_node: str | None = None
    inter_node: str | None = None


class _ParameterServer(Strict):
    name: str = Field(min_length=1)
    on_demand_per_hour: NonNegative


class _Efficiency(Strict):
    compute: float = 1.0
    memory: float = 1.0
    network: float = 1.0


class _Catalog(Strict):
    machines: list[_Machine] = Field(min_length=1)
    networks: dict[str, _Network] = Field(default_factory=dict)
    gpus: dict[str, _GPU] = Field(default_factory=dict)
    parameter_server: _ParameterServer | None = None
    efficiency: _Efficiency = Field(default_factory=_Efficiency)
    launch_us: NonNegative = 0.0


def parse_catalog(doc: Any, source: str) -> Catalog:
    """Validate a catalog document (the parsed YAML); an unknown key or a bad value gets one sentence naming the
    file, the entry and the key (and the keys allowed)."""
    if isinstance(doc, dict) and not doc.get("machines"):
        raise PlanningError(f"{source}: a catalog needs a non-empty 'machines' list.")
    cat = validate(_Catalog, doc, source, "catalog")
    networks = {k: NetworkSpec(k, n.bandwidth_gb_s, n.latency_us, n.source) for k, n in cat.networks.items()}
    gpus = {}
    for key, g in cat.gpus.items():
        if "float32" not in g.tflops:
            raise PlanningError(f"{source}: gpus[{key!r}]: tflops needs a float32 entry.")
        gpus[key.upper()] = GPUSpec(key.upper(), g.name, dict(g.tflops), g.hbm_gb_s, g.memory_gb, g.source,
                                    g.gemm_efficiency, g.family)
    machines = []
    for i, m in enumerate(cat.machines):
        for key in ("intra_node", "inter_node"):
            link = getattr(m, key)
            if link is not None and link not in networks:
                raise PlanningError(f"{source}: machines[{i}]: {key} {link!r} is not one of the catalog's networks "
                                    f"({', '.join(sorted(networks)) or 'none'}).")
        machines.append(MachineType(m.name, m.gpu.upper(), m.on_demand_per_hour, m.spot_per_hour,
                                    m.revocations_per_hour, m.startup_s, m.gpus_per_node, m.intra_node, m.inter_node))
    names = [m.name for m in machines]
    if len(set(names)) != len(names):
        raise PlanningError(f"{source}: machine names must be unique.")
    ps = cat.parameter_server
    efficiency = cat.efficiency.model_dump()
    if any(not 0 < v <= 1 for v in efficiency.values()):
        raise PlanningError(f"{source}: efficiency factors must lie in (0, 1], got {efficiency}.")
    return Catalog(tuple(machines), ps.name if ps else None, ps.on_demand_per_hour if ps else None, gpus, networks,
                   efficiency, cat.launch_us, source)


def load_catalog(path: str | os.PathLike | None = None) -> Catalog:
    """Read and validate a YAML catalog file (the package's default catalog when `path` is None)."""
    path = DEFAULT_CATALOG if path is None else path
    return parse_catalog(load_yaml(path, "catalog"), str(path))
