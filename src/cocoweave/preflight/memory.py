"""Predicted peak memory of one rank in one step: weights, gradients, DistributedAdamW's state (two moments,
1/dp of the parameters each; fp32 masters too when the weights are 16-bit), the activations of the micro-batches
in flight (counted from the trace: forwards done whose backward has not run, with the stage outputs torch keeps
for their backward or for a send still in flight and the input gradients whose send is still in flight: torch
waits on sends late, some schedules only at the step's end), torch's receive buffers (one per
micro-batch and direction, which its stages allocate up front) and the optimizer's bucket buffer (its programs
keep one full-size buffer of each bucket besides the parameters, gradients and state). One layer's activations per
micro-batch are the LLM planner's (cluster/planning/llm/memory.py: Korthikanti et al. 2022; fused attention keeps
no scores), scaled from its 16-bit values to the job's dtype. `programs`: what the blocks' tensor-parallel layers'
compiled programs keep between calls (result buffers, shared-memory segments, dropout indices), from their plans
(preflight.programs)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import PreflightError
from .job import PipelineJob
from .programs import block_program_bytes
from .trace import Op, Trace

GiB = 2**30
_SEND = re.compile(r"(\d+)SEND_([FB])(\d+)")


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
    programs: float = 0.0

    TERMS = ("weights", "gradients", "optimizer", "activations", "buffers", "programs")

    @property
    def total(self) -> float:
        return sum(getattr(self, t) for t in self.TERMS)

    def to_json(self) -> dict[str, float]:
        return {t: getattr(self, t) for t in self.TERMS} | {"total": self.total, "in_flight": self.in_flight}


def layer_activation(job: PipelineJob) -> float:
    """Bytes one block keeps for backward per micro-batch on one rank (the planner's formula; with sequence
    parallelism, plus the whole inputs cocoweave's column-parallel layers keep)."""
    from ..cluster.planning.llm.memory import layer_activation_bytes
    from ..cluster.planning.llm.parallelism import ParallelConfig
    from ..cluster.planning.llm.spec import TransformerSpec

    spec = TransformerSpec(layers=job.n_blocks, hidden=job.d_model, heads=job.heads, ffn=job.d_ff,
                           vocab=max(job.vocab, 1), seq_len=job.seq, global_batch=job.batch * job.dp,
                           flash_attention=job.fused_attention)
    cfg = ParallelConfig(tp=job.tp, pp=job.pp, dp=job.dp, micro_batch=job.micro_batch, sp=job.sequence_parallel)
    kept = layer_activation_bytes(spec, cfg, recompute="none") * job.value_bytes / 2
    if job.sequence_parallel and job.tp > 1:  # the formula keeps the column layers' inputs (qkv, fc1) as 1/tp slices;
        # cocoweave's keep the gathered input for the weight gradient (nn/functional.py, _ColumnProgram)
        kept += 2 * job.activation_numel() * job.value_bytes * (1 - 1 / job.tp)
    return kept


def _params(job: PipelineJob, stages: list[int], split: list[int]) -> int:
    if job.stage_params is not None:
        return sum(int(job.stage_params.get(s, 0)) for s in stages)
    last = len(split) - 1
    return sum(split[s] * job.block_params + (job.first_params if s == 0 else 0)
               + (job.last_params if s == last else 0) for s in stages)


def _send(op: Op) -> tuple[str, int, int] | None:
    """(F or B, stage, micro-batch) of a stage's send (labelled as torch's action, e.g. 1SEND_F3), else None."""
    m = _SEND.fullmatch(op.label) if op.kind == "send" else None
    return None if m is None else (m[2], int(m[1]), int(m[3]))


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
    one = job.boundary_numel() * b  # one micro-batch's tensor at a stage boundary, as a stage sends it
    ops = trace.ops.get(rank, [])
    held: dict[int, int] = {}
    outputs: set[tuple[int, int]] = set()  # (stage, micro-batch) outputs torch keeps from forward to backward
    sending: dict[int, tuple[str, int, int]] = {}  # send op id -> (F or B, stage, micro-batch), posted, not waited
    peak, peak_n, now = 0.0, 0, 0.0
    for ev in trace.events.get(rank, []):
        if ev.what == "post":
            sending |= {i: m for i in ev.ops if (m := _send(ops[i])) is not None}
        elif ev.what == "wait":
            for i in ev.ops:
                sending.pop(i, None)
        elif ev.what == "compute" and ev.stage is not None:
            kind = ev.label[len(str(ev.stage))]
            if kind == "F":
                held[ev.stage] = held.get(ev.stage, 0) + 1
                now += split[ev.stage] * per_block
                if ev.stage < num_stages - 1:
                    outputs.add((ev.stage, ev.microbatch or 0))
            elif kind in "BI":
                held[ev.stage] -= 1
                now -= split[ev.stage] * per_block
                outputs.discard((ev.stage, ev.microbatch or 0))
        # the stage outputs kept for backward, or for a send still in flight; the input gradients still being sent
        kept = outputs | {(s, m) for kind, s, m in sending.values() if kind == "F"}
        total = now + one * (len(kept) + sum(kind == "B" for kind, _, _ in sending.values()))
        if total > peak:
            peak, peak_n = total, sum(held.values())
    boundary = job.boundary_numel() * b * job.microbatches
    buffers = sum(boundary * ((s > 0) + (s < num_stages - 1)) for s in stages)
    if job.optimizer:  # DistributedAdamW's bucket programs keep one full-size buffer of the bucket (measured: dp 1, 2)
        buffers += params * b
    programs = sum(split[s] for s in stages) * block_program_bytes(job)
    return RankMemory(rank, params * b, params * b, optimizer, peak, float(buffers), peak_n, float(programs))


def check_fits(memory: RankMemory, capacity: float, step: int = 0) -> None:
    """PreflightError naming the rank, its need and the term that does not fit when it exceeds `capacity`."""
    if memory.total <= capacity:
        return
    terms = {t: getattr(memory, t) for t in RankMemory.TERMS}
    biggest = max(terms, key=terms.__getitem__)
    parts = ", ".join(f"{t} {v / GiB:.3g}" for t, v in terms.items())
    name = {"optimizer": "the optimizer state", "buffers": "the receive buffers",
            "programs": "the tensor-parallel programs' buffers",
            "activations": f"the activations of {memory.in_flight} micro-batch stages in flight"}.get(
        biggest, f"the {biggest}")
    raise PreflightError(f"rank {memory.rank} would need {memory.total / GiB:.3g} GiB in step {step} ({parts} GiB), "
                         f"{(memory.total - capacity) / GiB:.3g} GiB more than its device's {capacity / GiB:.3g} GiB; "
                         f"the largest term is {name} ({terms[biggest] / GiB:.3g} GiB)")
