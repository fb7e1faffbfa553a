"""The reference backend: every rank simulated in one process, collectives over lists of tensors.

Slow and obvious on purpose: it is the oracle every schedule and every other backend is tested
against. It never modifies its inputs; updated state is returned per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import collectives
from ..ir import registry as R
from ..ir.graph import Program, Value
from ..ir.layout import Position, slice_bounds
from ..ir.semantics import HALF, Place, compute
from ..ir.types import bind_shape
from ..plan import Overlap, Plan, Stage, lower
from ..schedule import rows
from ..schedule.schedule import Schedule
from ..schedule.stages import RowChunks
from .adasum import adasum_tree
from .inputs import RankInputs, bound_sizes, check_inputs, gather_axes, reshard_inputs
from .results import RankResult


def combine(op: str, parts: Sequence[torch.Tensor], weights: Sequence[int] | None = None) -> torch.Tensor:
    """Reduce the ranks' tensors with `op` in rank order (half types accumulate in float32; adasum in
    float64, in adasum_tree's order). `weights` make "avg" the weighted average sum(w_r x_r) / sum(w_r)."""
    dtype = parts[0].dtype
    if op == "adasum":
        return adasum_tree(parts)
    acc = [p.float() if dtype in HALF else p for p in parts]
    if weights is not None:
        out = acc[0] * (weights[0] / sum(weights))
        for p, w in zip(acc[1:], weights[1:]):
            out = out + p * (w / sum(weights))
    elif op in ("sum", "avg"):
        out = acc[0].clone()
        for p in acc[1:]:
            out = out + p
        if op == "avg":
            out = out / len(parts)
    elif op == "max":
        out = torch.stack(acc).amax(dim=0)
    elif op == "min":
        out = torch.stack(acc).amin(dim=0)
    else:
        raise ValueError(f"unknown reduction {op!r}")
    return out.to(dtype)


def collective(v: Value, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Result per group rank of communication value `v` given the group's operands (fresh tensors; where it has
    several, a tuple per rank of them and the result's shape, its sizes bound): a send hands each its own, a
    collective kind means what its registration says (collectives/kinds.py)."""
    out = list(parts) if v.op == "send" else collectives.kind(v.op).reference(v, parts, combine)
    return [t.clone() for t in out]


# -- driver -----------------------------------------------------------------------------------
Target = Program | Schedule | Plan


def run(target: Target, inputs: Sequence[RankInputs], sizes: Mapping[str, int] | None = None,
        whole_state: bool = False) -> list[RankResult]:
    """Run a program, schedule or plan for len(inputs) ranks; returns each rank's outputs and updated
    state. Inputs are given in the program's original layouts (tensors a schedule stores sliced are
    sliced here). With `whole_state`, sliced state comes back whole on every rank."""
    plan = target if isinstance(target, Plan) else lower(target)
    program = plan.program
    world = len(inputs)
    sizes = bound_sizes(program, sizes)
    program.check_world(world)  # raises if the world does not split into the program's stages or mesh
    inputs = reshard_inputs(program, inputs, plan.sliced_state, sizes, plan.unsliced)
    check_inputs(program, inputs, sizes)
    env: dict[Value, list[Any]] = {}
    for v in program.values:
        if v.op in ("input", "scalar", "const"):
            env[v] = _evaluate(v, env, inputs, sizes, world)
    for v in plan.host:
        env[v] = _evaluate(v, env, inputs, sizes, world)
    for stage in plan.stages:
        _run_stage(stage, env, inputs, sizes, world)
    results = [RankResult() for _ in range(world)]
    for name, v in plan.outputs:
        for r, t in enumerate(env[v]):
            if t is not None:
                results[r].outputs[name] = t
    for name, v in plan.state.items():
        parts = env[v]
        if whole_state and v.layout.is_sliced:
            parts = gather_axes(v, parts, world)
        for r, t in enumerate(parts):
            if t is not None:
                results[r].state[name] = t
    return results


def _get(env: Mapping[Value, list[Any]], a: Value) -> list[Any]:
    """An updated state reads as its new value (updates are written in place, not computed)."""
    return env[a.args[1]] if a.op == "update" else env[a]


def _run_stage(stage: Stage, env: dict[Value, list[Any]], inputs: Sequence[RankInputs],
               sizes: Mapping[str, int], world: int) -> None:
    if isinstance(stage, RowChunks):
        _run_row_chunks(stage, env, inputs, sizes, world)
        return
    if isinstance(stage, Overlap):
        _run_chunked(stage, env, inputs, sizes, world)
        return
    for v in stage.values:  # a fused collective is RS, its kernel, then the AGs: the same values in order
        env[v] = _evaluate(v, env, inputs, sizes, world)


def _run_chunked(stage: Overlap, env: dict[Value, list[Any]], inputs: Sequence[RankInputs],
                 sizes: Mapping[str, int], world: int) -> None:
    """Run the chain chunk by chunk along stage.dim, then concatenate each value's chunks."""
    nd, dim = stage.values[0].ndim, stage.chunk_dim
    size = bind_shape(stage.values[0].shape, sizes)[dim]  # the chunk dimension is never sliced
    inside = {id(v) for v in stage.values}
    pieces: dict[Value, list[list[Any]]] = {v: [] for v in stage.values}
    for k in range(stage.chunks):
        start, stop = slice_bounds(size, stage.chunks, k)
        cenv: dict[Value, list[Any]] = {}
        for v in stage.values:
            operands: dict[Value, list[Any]] = {}
            for i, a in enumerate(v.args):
                if id(a) in inside:
                    operands[a] = cenv[a]
                elif a.is_scalar or (v.op == "matmul" and i == 1) or dim - (nd - a.ndim) < 0:
                    operands[a] = _get(env, a)
                else:
                    j = dim - (nd - a.ndim)
                    operands[a] = [t if t is None or t.shape[j] == 1 else _chunk(t, j, stage.chunks, k)
                                   for t in _get(env, a)]
            cenv[v] = _evaluate(v, operands, inputs, sizes, world, chunk=(dim, nd, start, stop - start))
            pieces[v].append(cenv[v])
    for v, chunks in pieces.items():
        env[v] = [None if chunks[0][r] is None else torch.cat([c[r] for c in chunks], dim=dim) for r in range(world)]


def _run_row_chunks(stage: RowChunks, env: dict[Value, list[Any]], inputs: Sequence[RankInputs],
                    sizes: Mapping[str, int], world: int) -> None:
    """Run a chain through all_to_all_v in row-set chunks (schedule/rows.py): every rank derives chunk k's rows,
    counts and segment counts from its own counts; each chunk's values are computed on its rows alone, then put back
    in their rows of the whole tensors (a grouped_matmul_wgrad's chunks summed)."""
    facts = rows.of_stage(stage)
    inside = {id(v) for v in stage.values}
    ranks = [r for r in range(world) if all(_get(env, c)[r] is not None for c in facts.counts)]
    per = {r: facts.chunks(stage.chunks, lambda c, r=r: _get(env, c)[r], f"rank {r}: {stage.label}") for r in ranks}
    pieces: dict[Value, list[list[Any]]] = {v: [] for v in stage.values}
    for k in range(stage.chunks):
        cenv: dict[Value, list[Any]] = {}
        for v in stage.values:
            operands: dict[Value, list[Any]] = {}
            for a in v.args:
                if id(a) in inside:
                    operands[a] = cenv[a]
                elif any(a is c for c in facts.counts):
                    operands[a] = [facts.replaced(per[r], a, k) if r in per else None for r in range(world)]
                elif id(a) in facts.space:
                    space = facts.space[id(a)].name
                    operands[a] = [t if t is None else per[r].take(t, space, k) for r, t in enumerate(_get(env, a))]
                else:  # weights, broadcast operands, scalars: whole
                    operands[a] = _get(env, a)
            out = _evaluate(v, operands, inputs, sizes, world)
            if rows.exchanges_rows(v.op):  # the exchange pads to the whole result's rows: keep the chunk's
                out = [t if t is None else t[:per[r].rows(v.args[2].name, k)] for r, t in enumerate(out)]
            cenv[v] = out
            pieces[v].append(out)
    pad: dict[Value, list[Any]] = {}  # the rows no chunk holds of the elementwise values read after the chain
    for v in facts.tail:
        operands = {}
        for a in v.args:
            if a in pad:
                operands[a] = pad[a]
            elif id(a) in inside:  # an exchange's or a grouped GEMM's padding rows are zero
                operands[a] = [None if c is None else per[r].zeros(c, facts.space[id(a)].name,
                                                                   bind_shape(a.shape, sizes)[0])
                               for r, c in enumerate(pieces[a][0])]
            elif id(a) in facts.space:
                operands[a] = [t if t is None else per[r].padding(t, facts.space[id(a)].name)
                               for r, t in enumerate(_get(env, a))]
            else:
                operands[a] = _get(env, a)
        pad[v] = _evaluate(v, operands, inputs, sizes, world)
    for v, chunks in pieces.items():
        space = facts.space[id(v)]
        rows_ = bind_shape(v.shape, sizes)[0]
        env[v] = [None if chunks[0][r] is None else
                  rows.accumulate([c[r] for c in chunks]) if space is rows.ACCUMULATED else
                  per[r].assemble([c[r] for c in chunks], space.name, rows_, pad[v][r] if v in pad else None)
                  for r in range(world)]


def _chunk(t: torch.Tensor, dim: int, chunks: int, k: int) -> torch.Tensor:
    start, stop = slice_bounds(t.shape[dim], chunks, k)
    return t.narrow(dim, start, stop - start)


def _evaluate(v: Value, env: Mapping[Value, list[Any]], inputs: Sequence[RankInputs], sizes: Mapping[str, int],
              world: int, chunk: tuple[int, int, int, int] | None = None) -> list[Any]:
    """Per-world-rank values of `v` (None on ranks outside its process group)."""
    if v.op == "scalar":
        s = inputs[0][v.name]
        return [torch.as_tensor(s, dtype=torch.float64).reshape(())] * world
    if v.is_scalar:
        val = compute(v, [_get(env, a)[0] for a in v.args], Place(Position((0,), (1,)), sizes))
        return [val] * world
    ranks = v.group.ranks(world)
    out: list[Any] = [None] * world
    if v.op == "input":
        for r in ranks:
            out[r] = inputs[r][v.name]
    elif v.op == "send":
        src = v.args[0].group.ranks(world)
        for r, t in zip(ranks, collective(v, [_get(env, v.args[0])[s] for s in src])):
            out[r] = t
    elif R.group(v.op) == R.COLLECTIVE:
        ops = [_get(env, a) for a in v.args]  # several operands: per rank a tuple of them and v's bound shape
        whole = bind_shape(v.shape, sizes)
        for line in v.group.lines(world, v.attrs.get("axis")):
            parts = [ops[0][s] if len(ops) == 1 else (*(o[s] for o in ops), whole) for s in line]
            for r, t in zip(line, collective(v, parts)):
                out[r] = t
    else:
        for r in ranks:
            out[r] = compute(v, [_get(env, a)[r] for a in v.args], Place(v.position(r, world), sizes, chunk))
    return out
