"""The hardware one LLM layout runs on: a catalog machine's GPU (peak, HBM), its links inside and across nodes,
and the efficiency constants that turn spec-sheet peaks into achieved rates (calibrated, see `Efficiency`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cocoweave.cluster.catalog import Catalog, GPUSpec, MachineType, NetworkSpec


@dataclass(frozen=True)
class Efficiency:
    """Fractions of spec-sheet peaks one software stack reaches in training (docs/planning.md, "Planning at scale", says
    where each comes from). GEMM efficiency depends on the GEMM's shape: gemm_max x d / (d + gemm_half), d its
    smallest dimension. Fields marked calibrated are fitted by `calibrate.py` on the calibration rows of
    `published.py` and frozen here; the network fractions are nccl-tests' typical bus bandwidths, not fitted."""

    gemm_max: float = 0.76  # large fp16/bf16 GEMMs (calibrated per stack and GPU family; a family a stack was not
    # calibrated on: the catalog's measured figure where it has one, e.g. H100's 0.78)
    gemm_half: float = 40.0  # smallest GEMM dimension at which efficiency halves (calibrated)
    fp8_max: float = 0.5  # large FP8 linear-layer GEMMs, as a fraction of the FP8 peak, scaling and casts included
    # (calibrated on Hopper; the default is an assumption: torchtitan's float8 reaches 1.3x its bf16 step)
    flash: float = 0.70  # fused attention relative to GEMM efficiency (Dao 2023, FlashAttention-2: 50-73 % of A100
    # peak forward)
    elementwise_passes: float = 2.0  # HBM passes over the stored activations per elementwise sweep (calibrated)
    memory: float = 0.85  # fraction of HBM bandwidth elementwise kernels reach (STREAM-like, 80-90 %)
    intra: float = 0.77  # NCCL all-reduce bus bandwidth / NVLink peak (nccl-tests on DGX A100: ~230 of 300 GB/s)
    inter: float = 0.90  # NCCL bus bandwidth / NIC peak (nccl-tests across HDR rails: ~22.5 of 25 GB/s)
    tp_overlap: float = 1.0  # fraction of the tensor-parallel collectives a stack that overlaps them (TE's
    # userbuffers, torch's async TP) hides behind the layer's GEMMs (calibrated where a stack does it)
    overlap_drag: float = 0.0  # compute seconds lost per second of communication hidden behind it, of the part
    # spent moving bytes: NCCL's kernels take SMs and HBM bandwidth from the GEMMs they overlap as they copy and
    # reduce (Rashidi et al., ISCA 2021, "Enabling Compute-Communication Overlap in Distributed Deep Learning
    # Training Platforms", sec. 3), not as they wait out latency; calibrated on Hopper


@dataclass(frozen=True)
class Stack:
    """A training software stack: its efficiency constants (`eff`, and per GPU family where calibrated on one) and
    what layouts it offers (ZeRO stages; whether its data-parallel reduction overlaps the backward pass, its
    tensor-parallel collectives the GEMMs, its parameter all-gather the next forward)."""

    name: str
    eff: Efficiency
    zero_stages: tuple[int, ...]
    dp_overlap: bool
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: bool = True
    families: tuple[tuple[str, Efficiency], ...] = ()  # (catalog GPU family, constants calibrated on it)
    tp_overlap: bool = False
    gather_overlap: bool = False

    def efficiency(self, family: str | None) -> Efficiency | None:
        """The constants calibrated on GPUs of `family`, or None when this stack was not calibrated on it."""
        return dict(self.families).get(family) if family else None


HOPPER = "hopper"


# A100 constants (calibrated); the stacks calibrated on Hopper only take the nearest A100 stack's on an A100:
# Megatron-core's those of Megatron 2022, torchtitan with torch.compile's and llm-foundry's those of eager FSDP2
MEGATRON_2022 = Efficiency(gemm_max=0.78, elementwise_passes=2.094)
TORCHTITAN_2024 = Efficiency(gemm_max=0.78, elementwise_passes=8.788)
# Hopper constants that calibrate.FREE fits once for several stacks: cuBLAS's large-GEMM rate on DGX H100 (700 W
# SXM), shared by the stacks that ran there, and the GEMM shape constant, shared by all four Hopper stacks
DGX_H100_GEMM_MAX, HOPPER_GEMM_HALF = 0.7675, 60.0

# The software stacks the published runs used, with their calibrated constants (`calibrate.py` refits them);
# `DEFAULT_STACK` is what `cocoweave plan` assumes for a new job.
STACKS: dict[str, Stack] = {s.name: s for s in (
    # SC'21's runs: "local" DDP all-reduces after the pipeline flush; no distributed optimizer yet
    Stack("megatron-2021", Efficiency(gemm_max=0.70, elementwise_passes=2.094), (0,), False, ("none", "full"), False),
    # Korthikanti's runs: sequence parallelism, selective recomputation, distributed optimizer (ZeRO-1)
    Stack("megatron-2022", MEGATRON_2022, (0, 1), False),
    # eager PyTorch (unfused norms, RoPE, SwiGLU): FSDP2 overlapping its gathers and reductions
    Stack("torchtitan-2024", TORCHTITAN_2024, (0, 1, 3), True),
    # Megatron-core with Transformer Engine (NeMo 24.07): fused kernels, FP8 (delayed scaling), TP communication
    # overlapped by userbuffers, distributed optimizer overlapping its reduce-scatter with backward and its
    # all-gather with the next forward; Megatron FSDP. Hopper constants fitted on NeMo 24.07's H100 rows and NeMo
    # 24.03.01's long-sequence ones (its attention: flash)
    Stack("megatron-core-2024", MEGATRON_2022, (0, 1, 3), True,
          families=((HOPPER, Efficiency(gemm_max=DGX_H100_GEMM_MAX, gemm_half=HOPPER_GEMM_HALF, fp8_max=0.62,
                                        elementwise_passes=3.1812, flash=0.61, tp_overlap=0.4)),),
          tp_overlap=True, gather_overlap=True),
    # Megatron-Bridge 25.09-26.06: Megatron-core with a year of TE releases after NeMo 24.07 (FP8 current scaling,
    # newer cuDNN attention, fusions), the same layouts and overlaps; its FP8 rate, attention kernel and
    # elementwise passes fitted on its own calibration releases, the H100's GEMM rate, GEMM shape and TP overlap
    # shared with NeMo 24.07's rows
    Stack("megatron-bridge-2025", MEGATRON_2022, (0, 1, 3), True,
          families=((HOPPER, Efficiency(gemm_max=DGX_H100_GEMM_MAX, gemm_half=HOPPER_GEMM_HALF, fp8_max=0.67,
                                        elementwise_passes=1.9625, flash=0.61, tp_overlap=0.4)),),
          tp_overlap=True, gather_overlap=True),
    # torchtitan with torch.compile (fused elementwise), FSDP2, float8 and async TP: fitted on its H100 tables
    Stack("torchtitan-compile-2024", TORCHTITAN_2024, (0, 1, 3), True,
          families=((HOPPER, Efficiency(gemm_max=0.6325, gemm_half=HOPPER_GEMM_HALF, fp8_max=0.5,
                                        elementwise_passes=2.6938, flash=0.64, tp_overlap=0.525)),),
          tp_overlap=True),
    # MosaicML llm-foundry / Composer: FSDP (FULL_SHARD), FlashAttention, bf16: fitted on its H100 table
    # (fp8_max, tp_overlap: not fitted, no such row; its FSDP (FSDP1: flat-parameter copies, fp32 reduce-scatter)
    # drags the compute)
    Stack("llm-foundry-2023", TORCHTITAN_2024, (3,), True,
          families=((HOPPER, Efficiency(gemm_max=DGX_H100_GEMM_MAX, gemm_half=HOPPER_GEMM_HALF,
                                        elementwise_passes=3.9125, flash=0.36, tp_overlap=0.5, overlap_drag=0.975)),),
          sequence_parallel=False),
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


def efficiency_key(stack: Stack, gpu: GPUSpec) -> str:
    """The name of the constants `stack` uses on `gpu`: "stack/family" where calibrated on its family, else "stack"."""
    return f"{stack.name}/{gpu.family}" if stack.efficiency(gpu.family) else stack.name


def stack_efficiencies() -> dict[str, Efficiency]:
    """Every stack's constants by `efficiency_key` (what `calibrate.py` fits)."""
    out = {name: st.eff for name, st in STACKS.items()}
    return out | {f"{name}/{fam}": eff for name, st in STACKS.items() for fam, eff in st.families}


def system_for(machine: MachineType, catalog: Catalog, eff: Efficiency | Stack | None = None,
               calibrated_here: bool = False) -> System:
    """The System of a catalog machine under a stack's constants (those calibrated on the GPU's family where the
    stack has them), or under `eff` as given (`calibrated_here`: fitted on this GPU's family); constants not
    calibrated on the GPU take the catalog's measured `gemm_efficiency` where it gives one."""
    gpu = catalog.gpu_of(machine)
    if isinstance(eff, Stack):
        calibrated = eff.efficiency(gpu.family)
        eff = calibrated or eff.eff
    else:
        eff = eff or STACKS[DEFAULT_STACK].eff
        calibrated = eff if calibrated_here else None
    if gpu.gemm_efficiency is not None and calibrated is None:
        eff = replace(eff, gemm_max=gpu.gemm_efficiency)
    intra = catalog.networks.get(machine.intra_node) if machine.intra_node else None
    inter = catalog.networks.get(machine.inter_node) if machine.inter_node else None
    return System(machine, gpu, intra, inter, eff)
