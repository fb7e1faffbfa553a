"""Predicted peak memory of one rank in one step: weights, gradients, DistributedAdamW's state (two moments,
1/dp of the parameters each; fp32 masters too when the weights are 16-bit), the activations of the micro-batches
in flight (counted from the trace: forwards done whose backward has not run), torch's receive buffers (one per
micro-batch and direction, which its stages allocate up front) and the optimizer's bucket buffer (its programs
keep one full-size buffer of each bucket besides the parameters, gradients and state). One layer's activations per
micro-batch are the LLM planner's (cluster/planning/llm/memory.py: Korthikanti et al. 2022; fused attention keeps
no scores), scaled from its 16-bit values to the job's dtype. Not modelled: the buffers the tensor-parallel
layers' compiled programs keep between calls (docs/preflight.md has the measured gap)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PreflightError
from .job import PipelineJob
from .trace import Trace

GiB = 2**30


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by term; `in_flight` is the micro-batches x stages whose activations
    it keeps at that peak."""

    rank: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    in_flight: int

    TERMS = ("weights", "gradients", "optimizer", "activations", "buffers")

    @property
    def total(self) -> float:
        return sum(getattr(self, t) for t in self.TERMS)

    def to_json(self) -> dict[str, float]:
        return {t: getattr(self, t) for t in self.TERMS} | {"total": self.total, "in_flight": self.in_flight}


def layer_activation(job: PipelineJob) -> float:
    """Bytes one block keeps for backward per micro-batch on one rank (the planner's formula)."""
    from ..cluster.planning.llm.memory import layer_activation_bytes
    from ..cluster.planning.llm.parallelism import ParallelConfig
    from ..cluster.planning.llm.spec import TransformerSpec

    spec = TransformerSpec(layers=job.n_blocks, hidden=job.d_model, heads=job.heads, ffn=job.d_ff,
                           vocab=max(job.vocab, 1), seq_len=job.seq, global_batch=job.batch * job.dp,
                           flash_attention=job.fused_attention)
    cfg = ParallelConfig(tp=job.tp, pp=job.pp, dp=job.dp, micro_batch=job.micro_batch, sp=job.sequence_parallel)
    return layer_activation_bytes(spec, cfg, recompute="none") * job.value_bytes / 2


def _params(job: PipelineJob, stages: list[int], split: list[int]) -> int:
    if job.stage_params is not None:
        return sum(int(job.stage_params.get(s, 0)) for s in stages)
    last = len(split) - 1
    return sum(split[s] * job.block_params + (job.first_params if s == 0 else 0)
               + (job.last_params if s == last else 0) for s in stages)


def rank_memory(job: PipelineJob, trace: Trace, rank: int, split: list[int]) -> RankMemory:
    """The peak of `rank` in the step `trace` describes."""
    from .predict import coords

    num_stages = len(split)
    _, pp_rank, _ = coords(rank, job.pp, job.tp)
    stages = list(range(pp_rank, num_stages, job.pp))
    params = _params(job, stages, split)
    b = job.value_bytes
    optimizer = 0.0
    if job.optimizer:  # Adam's two fp32 moments (and an fp32 master of 16-bit weights) on this rank's 1/dp slice
        optimizer = params * (8 + (4 if b < 4 else 0)) / job.dp
    per_block = layer_activation(job)
    held: dict[int, int] = {}
    peak, peak_n, now = 0.0, 0, 0.0
    for ev in trace.events.get(rank, []):
        if ev.what != "compute" or ev.stage is None:
            continue
        kind = ev.label[len(str(ev.stage))]
        if kind == "F":
            held[ev.stage] = held.get(ev.stage, 0) + 1
            now += split[ev.stage] * per_block
        elif kind in "BI":
            held[ev.stage] -= 1
            now -= split[ev.stage] * per_block
        if now > peak:
            peak, peak_n = now, sum(held.values())
    boundary = job.boundary_numel() * b * job.microbatches
    buffers = sum(boundary * ((s > 0) + (s < num_stages - 1)) for s in stages)
    if job.optimizer:  # DistributedAdamW's bucket programs keep one full-size buffer of the bucket (measured: dp 1, 2)
        buffers += params * b
    return RankMemory(rank, params * b, params * b, optimizer, peak, float(buffers), peak_n)


def check_fits(memory: RankMemory, capacity: float, step: int = 0) -> None:
    """PreflightError naming the rank, its need and the term that does not fit when it exceeds `capacity`."""
    if memory.total <= capacity:
        return
    terms = {t: getattr(memory, t) for t in RankMemory.TERMS}
    biggest = max(terms, key=terms.__getitem__)
    parts = ", ".join(f"{t} {v / GiB:.3g}" for t, v in terms.items())
    name = {"optimizer": "the optimizer state", "buffers": "the receive buffers",
            "activations": f"the activations of {memory.in_flight} micro-batch stages in flight"}.get(
        biggest, f"the {biggest}")
    raise PreflightError(f"rank {memory.rank} would need {memory.total / GiB:.3g} GiB in step {step} ({parts} GiB), "
                         f"{(memory.total - capacity) / GiB:.3g} GiB more than its device's {capacity / GiB:.3g} GiB; "
                         f"the largest term is {name} ({terms[biggest] / GiB:.3g} GiB)")
