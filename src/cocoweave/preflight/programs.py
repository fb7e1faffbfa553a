"""What the tensor-parallel layers' compiled programs keep between calls, predicted from their plans without a process
group: per collective its result buffer (unless it is an output, which the layer takes and the executable drops), a
library reduce-scatter's part (and, for uneven parts, padding) buffers, a shared-memory collective's segment (every
rank's slot, mapped by each rank) and the second set an all-reduce, reduce-scatter or all-gather of at most
shm.ALTERNATE_BYTES per slot alternates with; per dropout its logical index (int64, the operand's whole index, of
which a sliced rank keeps a view). These are the torch backend's allocation rules (backends/torch/runtime.py,
shm.py); tests/preflight/test_programs.py checks `plan_bytes` against `Executable.held_bytes` for every schedule the
layers may choose, so the two cannot drift apart.

A TransformerBlock's layers run, per micro-batch shape, the row-parallel forward and backward programs (proj, fc2) and
the column-parallel backward (qkv, fc1: the program or, on one host without sequence parallelism, ASYNC_SHM's posted
all-reduce); with sequence parallelism also the column-parallel forward and the sum of its LayerNorm's gradients. Their
schedule "auto" is chosen by measurement when the job runs, so each layer counts the largest of the candidates it
measures."""

from __future__ import annotations

import functools
import math

from ..ir.graph import Program
from ..ir.types import DTYPES, bind_shape
from ..plan import Plan
from ..plan.lower import lower
from ..schedule.stages import Collective, FusedCollective, Overlap, Stage
from .job import PipelineJob


def _bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def _collectives(stages: list[Stage] | tuple[Stage, ...]) -> list[tuple[Collective, str]]:
    """(collective stage, its algorithm) of a plan's stages, those inside fused collectives included."""
    out: list[tuple[Collective, str]] = []
    for s in stages:
        if isinstance(s, Collective):
            out.append((s, s.algorithm))
        elif isinstance(s, FusedCollective | Overlap):
            out += [(p, getattr(s, "algorithm", "library")) for p in s.parts if isinstance(p, Collective)]
    return out


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up as shm.ShmGroup.slots places each slot (on a cache line)."""
    from ..backends.torch.shm import SLOT_ALIGN

    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def _collective_bytes(op: str, algorithm: str, x: tuple[int, ...], v: tuple[int, ...], dim: int, n: int,
                      itemsize: int, output: bool) -> int:
    """What one collective keeps on a rank: operand part `x`, result part `v` (local shapes) along `dim` over `n`
    ranks (nothing of the result when it is an output, which the layer takes and the executable drops)."""
    from ..backends.torch.ring import parts
    from ..backends.torch.shm import ALTERNATE_BYTES

    row = math.prod(x[:dim] + x[dim + 1:]) * itemsize  # bytes of one index along `dim`
    result = 0 if output else math.prod(v) * itemsize
    if n == 1:  # a group of one: the identity, into the result buffer
        return result
    size = x[dim] if op == "reduce_scatter" else v[dim]  # the whole extent the parts split
    bounds = parts(size, n, None)
    c = max(stop - start for start, stop in bounds)
    if algorithm == "shm":
        slot = (math.prod(x) * itemsize) if op != "all_gather" else c * row
        segments = _aligned(slot) * n * (2 if slot <= ALTERNATE_BYTES else 1)  # and the set it alternates with
        if op == "reduce_scatter":  # reduced in place in this rank's slot along dim 0, else via a part buffer
            return segments + (0 if dim == 0 else math.prod(v) * itemsize + result)
        if op == "all_gather" and dim != 0:  # gathered in pieces, then placed along `dim`
            return segments + result + sum(stop - start for start, stop in bounds) * row
        return segments + result
    even = size % n == 0 and dim == 0
    if op == "reduce_scatter":  # torch's equal-size reduce-scatter: each rank's segment padded to c indices
        return result + c * row + (0 if even else c * n * row)
    if op == "all_gather" and not even:
        return result + c * row + c * n * row
    return result


def plan_bytes(plan: Plan, rank: int, world_size: int, shared_host: bool = True) -> int:
    """Bytes the torch backend's executable of `plan` keeps between calls on `rank` of `world_size` (its outputs
    released, as the layers do), its shared-memory collectives on one host when `shared_host`."""
    view = plan.view(rank, world_size, {})
    outputs = {id(v) for _, v in plan.outputs}
    total = 0
    for v in plan.program.values:
        if v.op == "dropout" and view.in_group(v):  # Executable._dropout_indices: a view of the whole index
            total += _bytes(tuple(bind_shape(v.args[0].shape, view.sizes)), "int64")
    for stage, algorithm in _collectives(plan.stages):
        v = stage.values[0]
        if not view.in_group(v):
            continue
        n = view.group_rank(v)[1] if v.group is not None else world_size
        total += _collective_bytes(stage.op, algorithm if shared_host else "library",
                                   tuple(view.local_shape(v.args[0])), tuple(view.local_shape(v)),
                                   v.attrs.get("dim", 0), n, DTYPES[v.dtype].itemsize, id(v) in outputs)
    return total


def _layer(program: Program, schedule: str, shared_host: bool, world_size: int) -> int:
    """What `program` keeps on rank 0 under the layer's `schedule`: a name (nn.compiled.named's choice), or for
    "auto" the most of any candidate it measures."""
    from ..nn.compiled import candidates, named

    if schedule != "auto":
        return plan_bytes(lower(named(program, schedule, shared_host)), 0, world_size, shared_host)
    return max(plan_bytes(lower(s), 0, world_size, shared_host) for s in candidates(program, shared_host))


def _posted_bytes(rows: int, d_in: int, dtype: str, tp: int) -> int:
    """ASYNC_SHM's posted all-reduce (Programs.posted_all_reduce): a segment of every rank's slot of the input
    gradient, and the set it alternates with."""
    from ..backends.torch.shm import ALTERNATE_BYTES

    slot = _bytes((rows, d_in), dtype)
    return _aligned(slot) * tp * (2 if slot <= ALTERNATE_BYTES else 1)


@functools.lru_cache(maxsize=64)
def _block_bytes(rows: int, d: int, d_ff: int, dtype: str, drop: float, sp: bool, tp: int, schedule: str) -> int:
    from ..nn import programs as P
    from ..nn.compiled import _library
    from ..nn.programs import ASYNC, ASYNC_SHM

    shared = tp > 1  # the layers' ranks on one host (the shared-memory candidates apply)
    total = 0
    for d_in, d_out in ((d, d), (d_ff, d)):  # proj, fc2: row-parallel forward and backward
        total += _layer(P.row_forward(rows, d_in, d_out, dtype, drop, True, True, sp), schedule, shared, tp)
        total += _layer(P.row_backward(rows, d_in, d_out, dtype, drop, True, sp), schedule, shared, tp)
    for d_in, d_out in ((d, 3 * d), (d, d_ff)):  # qkv, fc1: column-parallel (nn.functional._ColumnProgram)
        program = P.column_backward(rows, d_in, d_out, dtype, True, sp)
        launched = plan_bytes(lower(_library(P.grad_all_reduce(rows, d_in, dtype, sp))), 0, tp, shared)
        routes = {"program": lambda program=program: _layer(program, schedule, shared, tp),  # noqa: B023
                  ASYNC: lambda: launched}  # noqa: B023
        if shared and not sp:
            routes[ASYNC_SHM] = lambda d_in=d_in: _posted_bytes(rows, d_in, dtype, tp)
        if schedule in routes:
            total += routes[schedule]()
        elif schedule == "auto" and tp > 1:  # Programs._route: measured among these
            total += max(routes[n]() for n in ([ASYNC_SHM, "program"] if ASYNC_SHM in routes else routes))
        else:
            total += routes["program"]()
        if sp:  # the gathered input's program, and the LayerNorm before it: its gradients summed (sum_grads)
            total += _layer(P.column_forward_sp(rows, d_in, d_out, dtype), schedule, shared, tp)
            total += _layer(P.grad_all_reduce(1, 2 * d_in, dtype), schedule, shared, tp)
    return total


def block_program_bytes(job: PipelineJob) -> int:
    """Bytes one TransformerBlock's tensor-parallel layers keep in their compiled programs on one rank (0 when the
    job's blocks take the hand-written path: `layer_schedule` None)."""
    if job.layer_schedule is None:
        return 0
    rows = job.micro_batch * job.seq
    return _block_bytes(rows, job.d_model, job.d_ff or 4 * job.d_model, job.dtype, float(job.dropout),
                        job.sequence_parallel, job.tp, job.layer_schedule)
