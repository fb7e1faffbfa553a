"""Search the layouts of a transformer on N GPUs of one machine type: the factorisations N = tp x cp x pp x dp (tp
within a node; cp > 1 for long sequences only, or as the spec states it, by a ring or by Ulysses' all-to-alls),
the expert-parallel degree of an MoE (as the spec states it, or every divisor of the experts that divides
cp x dp), the micro-batch, virtual stages, sequence parallelism, the ZeRO stage and recomputation. Layouts that
cannot run are skipped with their reason; layouts that do not fit in GPU memory are rejected with theirs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from cocoweave.cluster.planning.llm.memory import MemoryBreakdown, memory_per_gpu
from cocoweave.cluster.planning.llm.parallelism import RECOMPUTE, ParallelConfig
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.step import StepBreakdown, predict_step
from cocoweave.cluster.planning.llm.system import Stack, System
from cocoweave.errors import PlanningError

MICRO_BATCHES = (1, 2, 4, 8)
CONTEXT_PARALLEL = (1, 2, 4, 8, 16, 32)
LONG_SEQUENCE = 16384  # from this length on the search also tries context parallelism (Llama 3 used it from 128K;
# NeMo's recipes from 8K, torchtitan's tables from 32K)
MAX_VIRTUAL = 8
MAX_GPUS = 2**20  # a sane physical limit: the largest published training runs used ~10^5 GPUs


@dataclass(frozen=True)
class Evaluated:
    """One layout's prediction, or its memory and why it was rejected (`rejected` is None when it fits)."""

    cfg: ParallelConfig
    memory: MemoryBreakdown
    step: StepBreakdown | None = None
    rejected: str | None = None


@dataclass(frozen=True)
class SearchResult:
    """The fastest layout that fits, the runners-up, and how many were rejected for memory."""

    gpus: int
    best: Evaluated | None
    ranked: tuple[Evaluated, ...]
    rejected: int
    smallest_rejection: Evaluated | None  # the rejected layout needing the least memory (to say why nothing fits)


def _divisors(n: int, most: int | None = None) -> list[int]:
    """The divisors of n in increasing order, up to `most` (in O(sqrt n), not O(n): n may be a large GPU count)."""
    if most is not None:
        return [d for d in range(1, min(n, most) + 1) if n % d == 0]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def context_degrees(spec: TransformerSpec, gpus: int) -> list[int]:
    """The cp degrees the search tries: the spec's, or 1 and, for long sequences, the powers of two that split it."""
    if spec.context_parallel is not None:
        return [spec.context_parallel] if gpus % spec.context_parallel == 0 else []
    long = spec.seq_len >= LONG_SEQUENCE
    return [c for c in CONTEXT_PARALLEL if c == 1 or long and gpus % c == 0 and spec.seq_len % (2 * c) == 0]


def expert_degrees(spec: TransformerSpec, replicas: int) -> list[int]:
    """The ep degrees the search tries for cp x dp = `replicas`: the spec's, or every divisor of the experts that
    divides `replicas` (1 for a dense model)."""
    if spec.experts == 1:
        return [1]
    if spec.expert_parallel is not None:
        return [spec.expert_parallel] if replicas % spec.expert_parallel == 0 else []
    return [e for e in _divisors(spec.experts) if replicas % e == 0]


def layouts(spec: TransformerSpec, gpus: int, gpus_per_node: int, stack: Stack,
            group_ok: Callable[[ParallelConfig], bool] = lambda cfg: True) -> Iterator[ParallelConfig]:
    """Every layout of `spec` on `gpus` GPUs that `stack` offers (tp a power of two within a node); `group_ok(cfg)`
    False, asked of each (tp, cp, pp, dp, ep, zero) group once, skips it (e.g. its model state alone does not fit)."""
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= gpus_per_node and gpus % t == 0 and spec.heads % t == 0]
    for tp in tps:
        for cp in context_degrees(spec, gpus // tp):
            yield from _pipelines(spec, gpus // (tp * cp), tp, cp, stack, group_ok)


def _pipelines(spec: TransformerSpec, rest: int, tp: int, cp: int, stack: Stack,
               group_ok: Callable[[ParallelConfig], bool]) -> Iterator[ParallelConfig]:
    for pp in _divisors(rest):
        if spec.layers < pp:
            continue  # uneven stages are fine (`split_layers`), empty ones are not
        dp = rest // pp
        for mb in MICRO_BATCHES:
            if spec.global_batch % (dp * mb):
                continue
            m = spec.global_batch // (dp * mb)
            if pp > 1 and m < pp:
                continue  # 1F1B needs at least pp micro-batches
            even = spec.layers % pp == 0  # interleaving needs equal chunks
            vps = [1] if pp == 1 or not even else [v for v in _divisors(spec.layers // pp, MAX_VIRTUAL)
                                                   if v == 1 or m % pp == 0]
            zeros = [z for z in stack.zero_stages if z < 3 or pp == 1]
            for ep in expert_degrees(spec, cp * dp):
                for vp in vps:
                    for zero in zeros if cp * dp > 1 else (0,):
                        if not group_ok(ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, zero=zero)):
                            continue
                        for sp in (True, False) if tp > 1 and stack.sequence_parallel else (False,):
                            for ulysses in (False, True) if cp > 1 else (False,):
                                for recompute in [r for r in RECOMPUTE if r in stack.recompute]:  # fastest first
                                    yield ParallelConfig(
                                        tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, zero=zero, micro_batch=mb, vp=vp, sp=sp,
                                        ulysses=ulysses, recompute=recompute, dp_overlap=stack.dp_overlap,
                                        tp_overlap=stack.tp_overlap and tp > 1, gather_overlap=stack.gather_overlap)


def search(spec: TransformerSpec, system: System, gpus: int, stack: Stack, keep: int = 5) -> SearchResult:
    """The fastest layouts `stack` offers for `spec` on `gpus` GPUs of `system` that fit in its memory."""
    if not 1 <= gpus <= MAX_GPUS:
        raise PlanningError(f"the number of GPUs must be between 1 and {MAX_GPUS:,}, got {gpus}.")
    capacity = system.memory_bytes
    fits, rejected, smallest = [], 0, None
    floors: dict[ParallelConfig, float] = {}  # least memory of a group: recompute everything, micro-batch 1

    def group_ok(group: ParallelConfig) -> bool:
        if group not in floors:
            least = replace(group, recompute="full", sp=group.tp > 1 and stack.sequence_parallel)
            floors[group] = memory_per_gpu(spec, least).total
        return floors[group] <= capacity or smallest is None  # keep one to say why nothing fits

    done: set[tuple] = set()  # layouts already priced with less recomputation (faster): skip the rest
    for cfg in layouts(spec, gpus, system.gpus_per_node, stack, group_ok):
        key = (cfg.tp, cfg.cp, cfg.ulysses, cfg.pp, cfg.dp, cfg.ep, cfg.micro_batch, cfg.vp, cfg.zero, cfg.sp)
        if key in done:
            continue
        if cfg.problems(spec, system.gpus_per_node):
            continue
        memory = memory_per_gpu(spec, cfg)  # cheap: reject before pricing the step
        if memory.total > capacity:
            rejected += 1
            if smallest is None or memory.total < smallest.memory.total:
                smallest = Evaluated(cfg, memory, None, memory_reason(memory, capacity))
            continue
        done.add(key)
        fits.append(Evaluated(cfg, memory, predict_step(spec, cfg, system)))
    fits.sort(key=lambda e: (e.step.total_s, e.memory.total))
    return SearchResult(gpus, fits[0] if fits else None, tuple(fits[:keep]), rejected, smallest)


def memory_reason(m: MemoryBreakdown, capacity: float) -> str:
    """Why a layout does not fit: its memory by part against the GPU's."""
    return (f"needs {m.total / 1e9:.1f} GB per GPU (weights {m.weights / 1e9:.1f}, gradients {m.gradients / 1e9:.1f}, "
            f"optimizer {m.optimizer / 1e9:.1f}, activations {m.activations / 1e9:.1f}, workspace "
            f"{m.workspace / 1e9:.1f}) of {capacity / 1e9:.0f} GB")
