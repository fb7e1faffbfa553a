"""Search the layouts of a transformer on N GPUs of one machine type: the factorisations N = tp x cp x pp x dp (tp
within a node; cp > 1 for long sequences only, or as the spec states it, by a ring or by Ulysses' all-to-alls),
the expert-parallel degree of an MoE (as the spec states it, or every divisor of the experts that divides
cp x dp), the micro-batch, virtual stages, sequence parallelism, the ZeRO stage and recomputation. Layouts that
cannot run are skipped with their reason; layouts that do not fit in GPU memory are rejected with theirs."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

from cocoweave.cluster.planning.llm.memory import MemoryBreakdown, memory_per_gpu
from cocoweave.cluster.planning.llm.parallelism import RECOMPUTE, ParallelConfig
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.step import (
    StepBreakdown,
    forward_key,
    layer_forward_s,
    layer_key,
    layer_terms,
    predict_step,
    sixteen_bit_peak,
)
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
    recomputes = [r for r in RECOMPUTE if r in stack.recompute]  # fastest first
    for key in _keys(spec, gpus, gpus_per_node, stack, group_ok):
        for recompute in recomputes:
            yield _config(key, recompute, stack)


Key = tuple[int, int, int, int, int, int, int, int, bool, bool]  # tp, cp, pp, dp, ep, zero, mb, vp, sp, ulysses


def _config(key: Key, recompute: str, stack: Stack) -> ParallelConfig:
    tp, cp, pp, dp, ep, zero, mb, vp, sp, ulysses = key
    return ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, zero=zero, micro_batch=mb, vp=vp, sp=sp,
                          ulysses=ulysses, recompute=recompute, dp_overlap=stack.dp_overlap,
                          tp_overlap=stack.tp_overlap and tp > 1, gather_overlap=stack.gather_overlap)


def _keys(spec: TransformerSpec, gpus: int, gpus_per_node: int, stack: Stack,
          group_ok: Callable[[ParallelConfig], bool]) -> Iterator[Key]:
    """The layouts of `layouts` but their recomputation, in its order (each yields one layout per recomputation)."""
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= gpus_per_node and gpus % t == 0 and spec.heads % t == 0]
    for tp in tps:
        for cp in context_degrees(spec, gpus // tp):
            yield from _pipelines(spec, gpus // (tp * cp), tp, cp, stack, group_ok)


def _pipelines(spec: TransformerSpec, rest: int, tp: int, cp: int, stack: Stack,
               group_ok: Callable[[ParallelConfig], bool]) -> Iterator[Key]:
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
                                yield tp, cp, pp, dp, ep, zero, mb, vp, sp, ulysses


def search(spec: TransformerSpec, system: System, gpus: int, stack: Stack, keep: int = 5) -> SearchResult:
    """The fastest layouts `stack` offers for `spec` on `gpus` GPUs of `system` that fit in its memory."""
    if not 1 <= gpus <= MAX_GPUS:
        raise PlanningError(f"the number of GPUs must be between 1 and {MAX_GPUS:,}, got {gpus}.")
    fitting, rejected, smallest = _fitting(spec, gpus, system.gpus_per_node, stack, system.memory_bytes)
    forwards = _forwards(spec, system)
    layer_cache: dict[tuple, tuple[tuple[float, float, float], tuple[float, float, float, float]]] = {}
    candidates: list[tuple[float, int, ParallelConfig, MemoryBreakdown, tuple]] = []
    for index, (cfg, memory) in enumerate(fitting):
        lk = layer_key(cfg)
        layer = layer_cache.get(lk)
        if layer is None:
            fk = forward_key(cfg)
            forward = forwards.get(fk)
            if forward is None:
                forward = forwards[fk] = layer_forward_s(spec, cfg, system)
            layer = layer_cache[lk] = forward, layer_terms(spec, cfg, system, forward)
        candidates.append((step_lower_bound(spec, cfg, layer[1]), index, cfg, memory, layer))
    # Price the layouts that fit from the least lower bound up, and stop once a bound exceeds the keep-th fastest
    # step priced: every layout left is slower than `keep` layouts already priced, so cannot be among those kept
    # (the result is the one pricing every layout would give, ties broken in the same enumeration order).
    candidates.sort(key=lambda c: (c[0], c[1]))
    fits: list[tuple[float, float, int, Evaluated]] = []
    fastest: list[float] = []  # the `keep` least step times priced so far, negated (a max-heap)
    for bound, index, cfg, memory, (forward, layer) in candidates:
        if len(fastest) >= keep > 0 and bound > -fastest[0]:
            break
        step = predict_step(spec, cfg, system, forward, layer)
        fits.append((step.total_s, memory.total, index, Evaluated(cfg, memory, step)))
        if len(fastest) < keep:
            heapq.heappush(fastest, -step.total_s)
        elif keep > 0 and step.total_s < -fastest[0]:
            heapq.heapreplace(fastest, -step.total_s)
    fits.sort(key=lambda f: f[:3])
    ranked = [f[3] for f in fits]
    return SearchResult(gpus, ranked[0] if ranked else None, tuple(ranked[:keep]), rejected, smallest)


@lru_cache(maxsize=64)
def _fitting(spec: TransformerSpec, gpus: int, gpus_per_node: int, stack: Stack, capacity: float
             ) -> tuple[tuple[tuple[ParallelConfig, MemoryBreakdown], ...], int, Evaluated | None]:
    """The layouts of `spec` on `gpus` GPUs that fit in `capacity` bytes per GPU, each with the least
    recomputation that fits, in `layouts`' order, with their memory; how many were rejected for memory and the
    one needing the least. None of this depends on the machine but for its GPUs per node and memory, so machines
    that share them (DGX H100, H100 RoCE, AWS p5) share it."""
    rejected, smallest = 0, None
    floors: dict[ParallelConfig, float] = {}  # least memory of a group: recompute everything, micro-batch 1

    def group_ok(group: ParallelConfig) -> bool:
        if group not in floors:
            least = replace(group, recompute="full", sp=group.tp > 1 and stack.sequence_parallel)
            floors[group] = memory_per_gpu(spec, least).total
        return floors[group] <= capacity or smallest is None  # keep one to say why nothing fits

    recomputes = [r for r in RECOMPUTE if r in stack.recompute]  # fastest first: the first that fits is priced
    fitting: list[tuple[ParallelConfig, MemoryBreakdown]] = []
    for key in _keys(spec, gpus, gpus_per_node, stack, group_ok):
        for i, recompute in enumerate(recomputes):
            cfg = _config(key, recompute, stack)
            if i == 0 and cfg.problems(spec, gpus_per_node):
                break  # recomputation changes none of them
            memory = memory_per_gpu(spec, cfg)  # cheap: reject before pricing the step
            if memory.total > capacity:
                rejected += 1
                if smallest is None or memory.total < smallest.memory.total:
                    smallest = Evaluated(cfg, memory, None, memory_reason(memory, capacity))
                continue
            fitting.append((cfg, memory))
            break  # more recomputation is slower: skip it
    return tuple(fitting), rejected, smallest


_FORWARDS: dict[tuple, dict[tuple, tuple[float, float, float]]] = {}


def _forwards(spec: TransformerSpec, system: System) -> dict[tuple, tuple[float, float, float]]:
    """The per-layer forwards (`layer_forward_s`) of `spec` on `system`'s GPU under its constants, by `forward_key`:
    shared by every search on a machine with that GPU (they depend on nothing else of the machine: its peaks, its
    HBM bandwidth and the stack's constants)."""
    fp8 = system.peak_flops("float8") if spec.dtype == "float8" else None
    key = (spec, sixteen_bit_peak(system, spec.dtype), fp8, system.hbm_bytes_s,
           system.eff)
    if key not in _FORWARDS:
        if len(_FORWARDS) >= 64:
            _FORWARDS.clear()
        _FORWARDS[key] = {}
    return _FORWARDS[key]


def step_lower_bound(spec: TransformerSpec, cfg: ParallelConfig, layer: tuple[float, float, float, float]) -> float:
    """A lower bound on `predict_step`'s step time from one layer's `layer_terms`: the micro-batches through the
    stage with the most layers and the bubble, counting each stage as its layers alone (its point-to-point
    traffic, embedding and logits, the exposed data-parallel traffic and the optimizer are never negative), shaded
    by 1e-9 for rounding (the step adds a few dozen floating-point terms, each exact to 1e-16, and at most 10,000
    stages); no bound (-inf) where a constant made a layer's seconds not positive."""
    per_layer = layer[0] + layer[1] + layer[2] + layer[3]  # as `pipeline_s` adds them
    if not per_layer > 0:
        return -math.inf
    most = max(cfg.stage_layers(spec)) if cfg.pp > 1 else spec.layers
    bubble = (cfg.pp - 1) / cfg.vp * (spec.layers * per_layer / cfg.pp)
    return (cfg.micro_batches(spec) * (most * per_layer) + bubble) * (1 - 1e-9)


def memory_reason(m: MemoryBreakdown, capacity: float) -> str:
    """Why a layout does not fit: its memory by part against the GPU's."""
    return (f"needs {m.total / 1e9:.1f} GB per GPU (weights {m.weights / 1e9:.1f}, gradients {m.gradients / 1e9:.1f}, "
            f"optimizer {m.optimizer / 1e9:.1f}, activations {m.activations / 1e9:.1f}, workspace "
            f"{m.workspace / 1e9:.1f}) of {capacity / 1e9:.0f} GB")
