"""MODELLED step time of a profiled training step on catalog hardware it was not measured on.

Compute: every operation the profiler counted (FLOPs, bytes, dtype) is priced by its roofline on the
target GPU, max(FLOPs / (peak x e_compute), bytes / (HBM bandwidth x e_memory), launch), with the
per-rank work scaled to the target world size as it scaled on the measured worlds. Communication: the
collectives each rank called, priced by the one alpha-beta model of collectives (collectives/pricing.py) on the
slowest link the world spans (NVLink or PCIe inside a node, the node's network across nodes): steps x latency +
the fraction of the tensor a rank moves / (bandwidth x e_network), on the library's own algorithm (its ring; a
profile's traffic is summed over a step's calls, so NCCL's per-message choice of a tree is not modelled). No
overlap of communication with computation is assumed (DDP overlaps its all-reduce with the backward pass: the
figure is an upper bound there).
"""

from __future__ import annotations

from dataclasses import dataclass

from cocoweave.cluster.catalog import Catalog, GPUSpec, MachineType, NetworkSpec
from cocoweave.cluster.profiling.host_scaling import Traffic, counted_total, known_kind, work_share_fit
from cocoweave.collectives import DEFAULT, entry
from cocoweave.collectives.pricing import Link, seconds
from cocoweave.errors import PlanningError

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64", "tfloat32", "float8")


@dataclass(frozen=True)
class WorkCounts:
    """One rank's counted operations in the reference world, and how per-rank FLOPs and bytes scale with p."""

    histogram: tuple[tuple[float, float, str, int], ...]  # (flops, bytes, dtype, calls)
    reference_world: int
    flops_fit: tuple[float, float]  # per-rank FLOPs = f0 + f1 / p
    bytes_fit: tuple[float, float]

    @classmethod
    def from_runs(cls, runs: list) -> WorkCounts:
        """From profiled worlds (`worlds.WorldRun`), the largest one with counts as the reference."""
        counted = [r for r in runs if r.counts.get("forward_backward", {}).get("histogram")]
        if not counted:
            raise PlanningError("the profile holds no operation counts (the script needs at least 2 warm-up steps); "
                                "modelled predictions need them.")
        sizes = [r.world_size for r in counted]
        flops = [counted_total(r.counts, "flops") for r in counted]
        nbytes = [counted_total(r.counts, "bytes") for r in counted]
        ref = max(counted, key=lambda r: r.world_size)
        hist = tuple((float(f), float(b), str(d), int(n)) for part in ("forward_backward", "update")
                     for f, b, d, n in ref.counts.get(part, {}).get("histogram", []))
        return cls(hist, ref.world_size, _scaling_fit(sizes, flops), _scaling_fit(sizes, nbytes))

    def scale(self, fit: tuple[float, float], p: int) -> float:
        """Per-rank amount at p ranks relative to the reference world's."""
        ref = fit[0] + fit[1] / self.reference_world
        return (fit[0] + fit[1] / p) / ref if ref > 0 else 1.0


def _scaling_fit(sizes: list[int], values: list[float]) -> tuple[float, float]:
    """(f0, f1) of f0 + f1 / p; a constant when one size was counted, (0, 0) (no scaling) without counts."""
    if min(values) <= 0:
        return 0.0, 0.0
    if len(set(sizes)) < 2:
        return values[0], 0.0
    return work_share_fit(sizes, values)


@dataclass(frozen=True)
class ModelledStep:
    """A modelled step (ms) on `world_size` GPUs of `machine`."""

    machine: str
    gpu: str
    world_size: int
    compute_ms: float
    comm_ms: float
    link: str | None

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms


def compute_ms(work: WorkCounts, gpu: GPUSpec, p: int, catalog: Catalog) -> float:
    """Roofline time of one rank's operations on `gpu` at p ranks."""
    rf, rb = work.scale(work.flops_fit, p), work.scale(work.bytes_fit, p)
    eff_c, eff_m = catalog.efficiency["compute"], catalog.efficiency["memory"]
    launch_s = catalog.launch_us * 1e-6
    total = 0.0
    for flops, nbytes, dtype, calls in work.histogram:
        peak = gpu.peak_flops(dtype if dtype in FLOAT_DTYPES else "float32")
        total += calls * max(flops * rf / (peak * eff_c), nbytes * rb / (gpu.hbm_gb_s * 1e9 * eff_m), launch_s)
    return 1e3 * total


def link_of(machine: MachineType, p: int, catalog: Catalog) -> NetworkSpec | None:
    """The slowest link a world of p GPUs of `machine` spans (None for one GPU)."""
    if p <= 1:
        return None
    key = machine.intra_node if p <= machine.gpus_per_node and machine.intra_node else machine.inter_node
    if key is None:
        raise PlanningError(f"catalog machine {machine.name} names no network for {p} GPUs "
                            f"({'inter_node' if p > machine.gpus_per_node else 'intra_node'} is missing).")
    return catalog.networks[key]


def comm_ms(traffic: Traffic, link: NetworkSpec | None, p: int, catalog: Catalog, algorithm: str = DEFAULT
            ) -> float:
    """Alpha-beta time of one rank's collectives per step at p ranks over `link`, each kind on `algorithm` where
    it implements that kind (else the library's call); a kind the table has no traffic for, as a message."""
    if link is None or p <= 1:
        return 0.0
    on = Link.of(link.key, link.bandwidth_gb_s, link.latency_us, catalog.efficiency["network"])
    total = 0.0
    for kind, (calls, nbytes) in traffic.kinds.items():
        known = known_kind(kind)
        total += seconds(known, nbytes, p, on, algorithm if entry(algorithm).implements(known) else DEFAULT, calls)
    return 1e3 * total


def modelled_step(work: WorkCounts, traffic: Traffic, machine: MachineType, p: int, catalog: Catalog) -> ModelledStep:
    """The modelled step of the profiled workload on p GPUs of `machine`."""
    gpu = catalog.gpu_of(machine)
    link = link_of(machine, p, catalog)
    return ModelledStep(machine.name, machine.gpu, p, compute_ms(work, gpu, p, catalog),
                        comm_ms(traffic, link, p, catalog), None if link is None else link.key)

