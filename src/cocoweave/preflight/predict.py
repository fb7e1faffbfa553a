"""The communication trace of one training step of a pipeline job, predicted without tensors: torch's own
schedule (the class `Pipeline` runs, or torch's runtime on a user-written action list) runs its step code on
stand-in stages whose send and receive operations are descriptions, with torch's `_batch_p2p` and
`_wait_batch_p2p` swapped for functions that write them down. The order of posts, waits and compute is therefore
torch's, not a second description of it. What a stage itself communicates is added where `StageModule` does it:
the all-gather over the tensor-parallel group of a sliced boundary (forward on the receiving stage, backward on
the sending one) and, after the schedule, `Pipeline.step`'s loss all-reduces over pp and dp.

Not predicted (documented in docs/preflight.md): the tensor-parallel collectives inside the blocks and the
data-parallel reductions of the optimizer's buckets."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ParallelConfigError, PreflightError
from ..ir.layout import slice_bounds
from .job import PipelineJob
from .trace import Event, Op, Trace

_PATCH_LOCK = threading.Lock()


def mesh_rank(dp_c: int, pp_c: int, tp_c: int, pp: int, tp: int) -> int:
    """The global rank of mesh coordinate (dp, pp, tp) in parallel_mesh's order (tp ranks adjacent)."""
    return (dp_c * pp + pp_c) * tp + tp_c


def coords(rank: int, pp: int, tp: int) -> tuple[int, int, int]:
    return rank // (pp * tp), rank // tp % pp, rank % tp


def groups_of(rank: int, job: PipelineJob) -> dict[str, tuple[int, ...]]:
    """The global ranks of `rank`'s dp, pp and tp groups."""
    d, p, t = coords(rank, job.pp, job.tp)
    return {"dp": tuple(mesh_rank(i, p, t, job.pp, job.tp) for i in range(job.dp)),
            "pp": tuple(mesh_rank(d, i, t, job.pp, job.tp) for i in range(job.pp)),
            "tp": tuple(mesh_rank(d, p, i, job.pp, job.tp) for i in range(job.tp))}


def stage_split(job: PipelineJob, num_stages: int) -> list[int]:
    """Blocks of each stage: the job's stated split (checked against the model) or Pipeline's balanced one."""
    if job.stage_split is None:  # nn.pipeline.stage_blocks's split (not imported: nn.pipeline imports this package)
        if job.n_blocks < num_stages:
            raise ParallelConfigError(f"{job.n_blocks} blocks cannot be cut into {num_stages} pipeline stages (each "
                                      "stage needs at least one block)")
        return [b - a for a, b in (slice_bounds(job.n_blocks, num_stages, s) for s in range(num_stages))]
    split = [int(n) for n in job.stage_split]
    if len(split) != num_stages or sum(split) != job.n_blocks or min(split) < 1:
        raise ParallelConfigError(f"the stage split {split} does not match the model: the schedule runs "
                                  f"{num_stages} stages, which must hold the {job.n_blocks} blocks, at least one "
                                  "each")
    return split


class _Handle(list):  # type: ignore[type-arg]
    """What the swapped `_batch_p2p` returns: the ids of the operations it posted."""


class _StubStage:
    """Stands in for torch's PipelineStage: the attributes a schedule reads, send/recv ops as descriptions, and
    forward/backward that write compute events (and the boundary's collectives) to the trace."""

    def __init__(self, rec: _Recorder, index: int, num_stages: int, pp_rank: int, blocks: int) -> None:
        self.rec, self.stage_index, self.num_stages = rec, index, num_stages
        self.group_size, self.group_rank = rec.job.pp, pp_rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod, self.blocks = None, blocks
        self.stage_index_to_group_rank: dict[int, int] = {s: s % rec.job.pp for s in range(num_stages)}
        self.has_backward = True

    def _p2p(self, kind: str, other: int, mb: int, action: str) -> list[Op]:
        job, rec = self.rec.job, self.rec
        d, _, t = coords(rec.rank, job.pp, job.tp)
        peer = mesh_rank(d, self.stage_index_to_group_rank[other], t, job.pp, job.tp)
        return [Op(kind, rec.groups["pp"], peer, job.boundary_numel(), job.dtype, f"{self.stage_index}{action}{mb}")]

    def get_fwd_recv_ops(self, mb: int) -> list[Op]:
        return [] if self.is_first else self._p2p("recv", self.stage_index - 1, mb, "RECV_F")

    def get_fwd_send_ops(self, mb: int) -> list[Op]:
        return [] if self.is_last else self._p2p("send", self.stage_index + 1, mb, "SEND_F")

    def get_bwd_recv_ops(self, mb: int) -> list[Op]:
        return [] if self.is_last else self._p2p("recv", self.stage_index + 1, mb, "RECV_B")

    def get_bwd_send_ops(self, mb: int) -> list[Op]:
        return [] if self.is_first else self._p2p("send", self.stage_index - 1, mb, "SEND_B")

    def _gather(self, what: str, mb: int) -> None:
        job = self.rec.job
        self.rec.trace.collective(self.rec.rank, Op("all_gather", self.rec.groups["tp"], None,
                                                    job.activation_numel() // job.tp, job.dtype,
                                                    f"{self.stage_index}{what}{mb}"))

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        job = self.rec.job
        gathers = job.tp > 1  # StageModule.forward: gather a received slice; SP gathers before the output module
        if gathers and not self.is_first and job.sliced and not job.sequence_parallel:
            self._gather("GATHER_F", mb)
        self.rec.compute(f"{self.stage_index}F{mb}", self.stage_index, mb, job.compute_cost(self.stage_index, "F",
                                                                                            self.blocks))
        if gathers and self.is_last and job.sequence_parallel:
            self._gather("GATHER_F", mb)

    def backward_one_chunk(self, mb: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        job = self.rec.job  # the backward of StageModule.forward's slices: the gradient of a kept slice gathered
        gathers = job.tp > 1
        if gathers and not self.is_last and job.sliced and not job.sequence_parallel:
            self._gather("GATHER_B", mb)
        kind = "B" if full_backward else "I"
        self.rec.compute(f"{self.stage_index}{kind}{mb}", self.stage_index, mb,
                         job.compute_cost(self.stage_index, kind, self.blocks))
        if gathers and self.is_first and job.sequence_parallel:
            self._gather("GATHER_B", mb)

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        self.rec.compute(f"{self.stage_index}W{mb}", self.stage_index, mb,
                         self.rec.job.compute_cost(self.stage_index, "W", self.blocks))

    def perform_reduce_grad(self, *args: Any) -> None:
        """Where torch's runtime reduces this stage's gradients (a DDP/FSDP stage's reduction; cocoweave's
        optimizer reduces its own buckets): a marker event, checked to follow the stage's last backward."""
        self.rec.trace.events[self.rec.rank].append(Event("reduce_grad", (), f"{self.stage_index}REDUCE_GRAD",
                                                          self.stage_index))

    def clear_runtime_states(self) -> None: ...

    def set_local_fwd_input(self, *args: Any) -> None: ...

    def set_local_bwd_input(self, *args: Any) -> None: ...

    def get_local_bwd_output(self, mb: int) -> None: ...


class _Recorder:
    """Writes one rank's events while torch's step code runs on stub stages."""

    def __init__(self, job: PipelineJob, rank: int, trace: Trace) -> None:
        self.job, self.rank, self.trace = job, rank, trace
        self.groups = groups_of(rank, job)

    def compute(self, label: str, stage: int, mb: int, cost: float) -> None:
        self.trace.compute(self.rank, label, stage, mb, float(cost))

    def batch_p2p(self, ops: list[Op], desc: str | None = None) -> _Handle:
        return _Handle(self.trace.post(self.rank, list(ops), ",".join(op.label for op in ops)))

    def wait_batch_p2p(self, work: list[Any]) -> None:
        ids = tuple(i for w in work for i in (w if isinstance(w, list) else [w]))
        self.trace.wait(self.rank, ids, ",".join(self.trace.ops[self.rank][i].label for i in ids))


@contextmanager
def _swapped(rec: _Recorder) -> Iterator[None]:
    """torch's p2p batching functions replaced by `rec`'s while one rank's step runs (process-wide: locked)."""
    from torch.distributed.pipelining import schedules as S

    with _PATCH_LOCK:
        saved = S._batch_p2p, S._wait_batch_p2p
        S._batch_p2p, S._wait_batch_p2p = rec.batch_p2p, rec.wait_batch_p2p
        try:
            yield
        finally:
            S._batch_p2p, S._wait_batch_p2p = saved


def _no_loss(*args: Any, **kwargs: Any) -> None:
    return None


def _torch_error(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def build_schedule(job: PipelineJob, stages: list[_StubStage]) -> Any:
    """torch's schedule object over stub stages: the class a named schedule maps to, or torch's runtime with the
    user's actions loaded (validated by torch: each stage's forwards and backwards, the stage -> rank map)."""
    from torch.distributed.pipelining import schedules as S

    from ..nn.pipeline_engine import SCHEDULES

    actions = job.custom_actions()
    if actions is None:
        cls, per_rank = SCHEDULES[job.schedule]  # type: ignore[index]
        return cls(stages if per_rank > 1 else stages[0], job.microbatches, loss_fn=_no_loss, scale_grads=False)
    sch = S._PipelineScheduleRuntime(stages, job.microbatches, loss_fn=_no_loss, scale_grads=False)
    parsed = {r: [S._Action.from_str(a) for a in row] for r, row in actions.items()}
    if job.schedule_format == "compute_only":
        sch.pipeline_order = parsed
    try:
        sch._prepare_schedule_with_comms(parsed, format=job.schedule_format)
    except AssertionError as e:
        if "can't schedule sends/recvs" in str(e):
            raise PreflightError(f"the schedule would wait forever in every step: torch's lowering of its compute "
                                 f"actions ({', '.join(f'rank {r}: ' + ' '.join(row) for r, row in actions.items())}) "
                                 "finds no order of sends and receives in which each rank's next action can run"
                                 ) from None
        raise ParallelConfigError(f"the schedule is not valid for {job.microbatches} micro-batches and "
                                  f"{len(stages[0].stage_index_to_group_rank)} stages: {_torch_error(e)}") from None
    return sch


def _custom_layout(job: PipelineJob) -> tuple[int, dict[int, int]]:
    """Stages and the stage -> pipeline-rank map of a user-written schedule, as torch validates it."""
    from torch.distributed.pipelining import schedules as S

    actions = job.custom_actions() or {}
    try:
        parsed = {r: [S._Action.from_str(a) for a in row] for r, row in actions.items()}
    except RuntimeError as e:
        raise ParallelConfigError(f"the schedule has an action torch cannot read: {_torch_error(e)}") from None
    if sorted(parsed) != list(range(job.pp)):
        raise ParallelConfigError(f"the schedule has rows for pipeline ranks {sorted(parsed)}; the mesh has pp "
                                  f"{job.pp} (ranks 0..{job.pp - 1})")
    stage_ids = {a.stage_index for row in parsed.values() for a in row if a is not None and a.stage_index >= 0}
    num_stages = max(stage_ids) + 1 if stage_ids else 0
    compute = {r: [a for a in row if a is not None and a.is_compute_op] for r, row in parsed.items()}
    try:
        mapping = S._validate_schedule(compute, job.pp, num_stages, job.microbatches)
    except (AssertionError, KeyError) as e:
        raise ParallelConfigError(f"the schedule is not valid for {job.microbatches} micro-batches and "
                                  f"{num_stages} stages: {_torch_error(e)}") from None
    if num_stages % job.pp or any(mapping.get(s) != s % job.pp for s in range(num_stages)):
        raise ParallelConfigError(f"the schedule's stage split does not match the model: it puts stages on pipeline "
                                  f"ranks {[mapping.get(s) for s in range(num_stages)]}, but Pipeline places stage s "
                                  f"on rank s mod {job.pp} (interleaved: {num_stages // job.pp or 1} per rank)")
    return num_stages, mapping


def layout(job: PipelineJob) -> tuple[int, int]:
    """(stages, stages per pipeline rank) of the job; one sentence when the schedule cannot run it."""
    job.check_sizes()
    if job.custom_actions() is not None:
        num_stages, _ = _custom_layout(job)
        return num_stages, num_stages // job.pp
    from ..nn.pipeline_engine import check_schedule

    _, per_rank = check_schedule(str(job.schedule), job.microbatches, job.pp)
    return job.pp * per_rank, per_rank


def predict(job: PipelineJob, ranks: list[int] | None = None) -> Trace:
    """The trace of one training step of `job` for `ranks` (default: every rank of the mesh). torch's schedule runs
    once per pipeline rank (on the replica at dp 0, tp 0); the other ranks of the mesh issue the same operations
    with their own peers and groups."""
    num_stages, _ = layout(job)
    split = stage_split(job, num_stages)
    templates: dict[int, Trace] = {}
    trace = Trace()
    for rank in range(job.world) if ranks is None else ranks:
        d, pp_rank, t = coords(rank, job.pp, job.tp)
        if pp_rank not in templates:
            templates[pp_rank] = _run_torch(job, mesh_rank(0, pp_rank, 0, job.pp, job.tp), num_stages, split)
        src = templates[pp_rank]
        home = mesh_rank(0, pp_rank, 0, job.pp, job.tp)

        def move(r: int, d: int = d, t: int = t) -> int:  # the rank at the same place relative to this replica
            rd, rp, rt = coords(r, job.pp, job.tp)
            return mesh_rank((rd + d) % job.dp, rp, (rt + t) % job.tp, job.pp, job.tp)

        trace.ops[rank] = [Op(op.kind, tuple(sorted(map(move, op.group))), None if op.peer is None else move(op.peer),
                              op.numel, op.dtype, op.label) for op in src.ops[home]]
        trace.events[rank] = list(src.events[home])
    return trace


def _run_torch(job: PipelineJob, rank: int, num_stages: int, split: list[int]) -> Trace:
    """One rank's step: torch's schedule code on stub stages, then Pipeline.step's collectives."""
    trace = Trace()
    rec = _Recorder(job, rank, trace)
    _, pp_rank, _ = coords(rank, job.pp, job.tp)
    stages = [_StubStage(rec, s, num_stages, pp_rank, split[s]) for s in range(pp_rank, num_stages, job.pp)]
    sch = build_schedule(job, stages)
    for name in ("_initialize_stage", "_initialize_stages", "_maybe_compute_loss", "_update_losses"):
        setattr(sch, name, _no_loss)
    sch._maybe_get_loss = _no_loss
    with _swapped(rec):
        try:
            sch._step_microbatches(None, None, None, None, return_outputs=False)
        except AssertionError as e:  # torch's runtime refuses to compute before receiving: a schedule's error
            raise PreflightError(f"rank {rank} (pipeline rank {pp_rank}) would stop in training step 0: torch's "
                                 f"runtime says {_torch_error(e)}") from None
    _step_collectives(job, rec)
    return trace


def _step_collectives(job: PipelineJob, rec: _Recorder) -> None:
    """Pipeline.step after the schedule: the loss (one float64) summed over pp, then averaged over dp; then the
    optimizer's step over dp, when the job states it."""
    if job.pp > 1:
        rec.trace.collective(rec.rank, Op("all_reduce", rec.groups["pp"], None, 1, "float64", "loss over pp"))
    if job.dp > 1:
        rec.trace.collective(rec.rank, Op("all_reduce", rec.groups["dp"], None, 1, "float64", "loss over dp"))
    _, pp_rank, _ = coords(rec.rank, job.pp, job.tp)
    for k, (kind, numel, dtype) in enumerate((job.optimizer_steps or {}).get(pp_rank, ())):
        rec.trace.collective(rec.rank, Op(kind, rec.groups["dp"], None, int(numel), dtype, f"optimizer {k}"))


PredictFn = Callable[[PipelineJob], Trace]
