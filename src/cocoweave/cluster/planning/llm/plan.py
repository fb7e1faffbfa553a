"""Plan an LLM training job: for every catalog machine that can be modelled and every GPU count, the fastest layout
that fits (`search`), then the existing planner's time and cost on-demand and on spot (revocations, Young's
checkpoint interval, the checkpoint model), the Pareto front and the recommendation for a deadline or a budget."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cocoweave.cluster.catalog import Catalog, MachineType
from cocoweave.cluster.planning.checkpoint_model import CheckpointModel
from cocoweave.cluster.planning.llm.memory import OPTIMIZER_BYTES
from cocoweave.cluster.planning.llm.search import MAX_GPUS, Evaluated, SearchResult, search
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.system import Stack, system_for
from cocoweave.cluster.planning.planner import ClusterPlan, Option, evaluate_options, pareto_front, recommend
from cocoweave.cluster.planning.step_times import ProfilePoint, WorkloadProfile
from cocoweave.errors import PlanningError


@dataclass(frozen=True)
class LLMPlan:
    """The cluster plan, the layout behind each (machine, GPU count), and the GPU counts where nothing fits."""

    spec: TransformerSpec
    tokens: float
    stack: str
    plan: ClusterPlan
    layouts: dict[tuple[str, int], Evaluated]
    unfit: dict[tuple[str, int], str]
    notes: tuple[str, ...]

    def layout(self, option: Option) -> Evaluated:
        return self.layouts[(option.machine.name, option.workers)]


def gpu_counts(machine: MachineType, min_gpus: int, max_gpus: int) -> list[int]:
    """Whole nodes, doubling: gpus_per_node x 1, 2, 4, ... within [min_gpus, max_gpus]."""
    out, n = [], machine.gpus_per_node
    while n <= max_gpus:
        if n >= min_gpus:
            out.append(n)
        n *= 2
    return out


def checkpoint_seconds(spec: TransformerSpec, gpus: int, model: CheckpointModel) -> float:
    """Seconds to save weights and Adam state, every GPU writing its shard in parallel (sharded checkpointing as
    torch.distributed.checkpoint does), each shard priced by CM-DARE's duration-vs-size model."""
    shard_mb = spec.params() * (spec.bytes_per_value + OPTIMIZER_BYTES) / gpus / 1e6
    return model.duration_s(shard_mb)


def check_max_gpus(max_gpus: int) -> None:
    """Refuse a GPU bound past any physical cluster (the search would run for minutes), before any work."""
    if not 1 <= max_gpus <= MAX_GPUS:
        raise PlanningError(f"the most GPUs to consider (--max-gpus) must be between 1 and {MAX_GPUS:,}, got "
                            f"{max_gpus}.")


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Pause the cyclic garbage collector while the search creates and drops a few hundred thousand small acyclic
    objects (layouts, their memory and steps: reference counting frees them); its passes over them cost a fifth
    of the search. Restored on exit, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def plan_llm(spec: TransformerSpec, catalog: Catalog, tokens: float, stack: Stack, checkpoints: CheckpointModel,
             deadline_h: float | None = None, budget_usd: float | None = None, min_gpus: int = 1,
             max_gpus: int = 4096) -> LLMPlan:
    """Recommend machine, GPU count and layout for training `spec` on `tokens` tokens by a deadline or a budget."""
    if not (math.isfinite(tokens) and tokens > 0):
        raise PlanningError(f"the number of tokens to train must be positive, got {tokens}.")
    check_max_gpus(max_gpus)
    machines = [m for m in catalog.machines if catalog.modellable(m, spec.dtype, whole_nodes=True)]
    if not machines:
        raise PlanningError(f"no machine of the catalog {catalog.source} has a GPU with {spec.dtype} figures and "
                            "the networks the LLM model needs (gpus: tflops; machines: intra_node, inter_node).")
    steps = math.ceil(tokens / spec.tokens_per_step())
    layouts: dict[tuple[str, int], Evaluated] = {}
    unfit: dict[tuple[str, int], str] = {}
    options: list[Option] = []
    unfinishable = 0
    with _no_cycle_collection():
        for machine in machines:
            system = system_for(machine, catalog, stack)
            for n in gpu_counts(machine, min_gpus, max_gpus):
                result: SearchResult = search(spec, system, n, stack)
                if result.best is None:
                    why = result.smallest_rejection.rejected if result.smallest_rejection else "no layout divides it"
                    unfit[(machine.name, n)] = why
                    continue
                layouts[(machine.name, n)] = result.best
                profile = WorkloadProfile(spec.name, checkpoint_seconds(spec, n, checkpoints),
                                          (ProfilePoint(machine.gpu, 0, n, result.best.step.total_s, machine.name),),
                                          modelled=True)
                opts, lost = evaluate_options(profile, catalog, steps)
                options += opts  # the profile names only this machine
                unfinishable += lost
    if not options:
        worst = next(iter(unfit.items()), None)
        detail = f" (e.g. {worst[0][1]} GPUs of {worst[0][0]}: {worst[1]})" if worst else ""
        raise PlanningError(f"{spec.name} fits on no machine of the catalog within {max_gpus} GPUs{detail}.")
    best = recommend(options, steps, deadline_h, budget_usd)
    plan = ClusterPlan(steps, deadline_h, budget_usd, tuple(options), tuple(pareto_front(options)), best,
                       unfinishable)
    notes = (f"{spec.name}: {spec.params() / 1e9:.1f}B parameters, {spec.tokens_per_step():,} tokens per step, "
             f"{steps:,} steps for {tokens:.3g} tokens; stack {stack.name}",)
    return LLMPlan(spec, tokens, stack.name, plan, layouts, unfit, notes)
