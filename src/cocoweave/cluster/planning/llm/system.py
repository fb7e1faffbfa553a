"""The hardware one LLM layout runs on: a catalog machine's GPU (peak, HBM), its links inside and across nodes,
and the efficiency constants that turn spec-sheet peaks into achieved rates (calibrated, see `Efficiency`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cocoweave.cluster.catalog import Catalog, GPUSpec, MachineType, NetworkSpec
from cocoweave.errors import PlanningError


@dataclass(frozen=True)
class Efficiency:
    """Fractions of spec-sheet peaks one software stack reaches in training (docs/planning.md, "Planning at scale", says
    where each comes from). GEMM efficiency depends on the GEMM's shape: gemm_max x d / (d + gemm_half), d its
    smallest dimension. Fields marked calibrated are fitted by `calibrate.py` on the calibration rows of
    `published.py` and frozen here; the network fractions are nccl-tests' typical bus bandwidths, not fitted."""

    gemm_max: float = 0.76  # large fp16/bf16 GEMMs (calibrated per stack on A100; H100: the catalog's measured 0.78)
    gemm_half: float = 40.0  # smallest GEMM dimension at which efficiency halves (calibrated)
    flash: float = 0.70  # fused attention relative to GEMM efficiency (Dao 2023, FlashAttention-2: 50-73 % of A100
    # peak forward)
    elementwise_passes: float = 2.0  # HBM passes over the stored activations per elementwise sweep (calibrated)
    memory: float = 0.85  # fraction of HBM bandwidth elementwise kernels reach (STREAM-like, 80-90 %)
    intra: float = 0.77  # NCCL all-reduce bus bandwidth / NVLink peak (nccl-tests on DGX A100: ~230 of 300 GB/s)
    inter: float = 0.90  # NCCL bus bandwidth / NIC peak (nccl-tests across HDR rails: ~22.5 of 25 GB/s)


@dataclass(frozen=True)
class Stack:
    """A training software stack: its efficiency constants and what layouts it offers (ZeRO stages; whether its
    data-parallel reduction overlaps the backward pass)."""

    name: str
    eff: Efficiency
    zero_stages: tuple[int, ...]
    dp_overlap: bool
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: bool = True


# The software stacks the published runs used, with their calibrated constants (`calibrate.py` refits them);
# `DEFAULT_STACK` is what `cocoweave plan` assumes for a new job.
STACKS: dict[str, Stack] = {s.name: s for s in (
    # SC'21's runs: "local" DDP all-reduces after the pipeline flush; no distributed optimizer yet
    Stack("megatron-2021", Efficiency(gemm_max=0.695), (0,), False, ("none", "full"), False),
    # Korthikanti's runs: sequence parallelism, selective recomputation, distributed optimizer (ZeRO-1)
    Stack("megatron-2022", Efficiency(gemm_max=0.76), (0, 1), False),
    # eager PyTorch (unfused norms, RoPE, SwiGLU): FSDP2 overlapping its gathers and reductions
    Stack("torchtitan-2024", Efficiency(gemm_max=0.76, elementwise_passes=9.03), (0, 1, 3), True),
)}
DEFAULT_STACK = "megatron-2022"


@dataclass(frozen=True)
class System:
    """One machine type's GPU and links as the LLM model prices them."""

    machine: MachineType
    gpu: GPUSpec
    intra: NetworkSpec | None
    inter: NetworkSpec | None
    eff: Efficiency

    @property
    def gpus_per_node(self) -> int:
        return self.machine.gpus_per_node

    def peak_flops(self, dtype: str) -> float:
        return self.gpu.peak_flops(dtype)

    @property
    def hbm_bytes_s(self) -> float:
        return self.gpu.hbm_gb_s * 1e9 * self.eff.memory

    @property
    def memory_bytes(self) -> float:
        return self.gpu.memory_gb * 1e9


def system_for(machine: MachineType, catalog: Catalog, eff: Efficiency | None = None) -> System:
    """The System of a catalog machine; the GPU's own `gemm_efficiency`, when the catalog gives one, replaces the
    calibrated default."""
    gpu = catalog.gpus.get(machine.gpu)
    if gpu is None:
        raise PlanningError(f"the catalog {catalog.source} has no spec-sheet entry for GPU {machine.gpu} "
                            f"(machine {machine.name}); add it under 'gpus'.")
    eff = eff or STACKS[DEFAULT_STACK].eff
    if gpu.gemm_efficiency is not None:
        eff = replace(eff, gemm_max=gpu.gemm_efficiency)
    intra = catalog.networks.get(machine.intra_node) if machine.intra_node else None
    inter = catalog.networks.get(machine.inter_node) if machine.inter_node else None
    return System(machine, gpu, intra, inter, eff)
