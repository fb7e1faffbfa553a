"""The reference backend: every rank simulated in one process, collectives over lists of tensors.

Slow and obvious on purpose: it is the oracle every schedule and every other backend is tested
against. It never modifies its inputs; updated state is returned per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError
from ..ir.graph import Program, Value
from ..ir.layout import slice_bounds
from ..ir.types import bind_shape
from ..plan import Chunked, Plan, PlanStage, lower
from ..schedule.schedule import Schedule
from .inputs import RankInputs, bound_sizes, check_inputs, reshard_inputs
from .local_ops import HALF, RankContext, compute

# A squared norm below this keeps its adasum coefficient at 1 (no division by ~0). It is
# sqrt(float64's smallest normal) = 2**-511, Horovod's value: float64 accumulation keeps every nonzero
# fp32/fp16/bf16 tensor above it (fp32's smallest subnormal squared is ~2e-90) and dot/|a|^2 finite.
ADASUM_EPS = 2.0 ** -511


@dataclass
class RankResult:
    """What one rank holds after a run: its outputs and its updated state tensors."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict)


# -- collectives over the group's list of per-rank tensors ------------------------------------
def adasum_coefficients(dot: float, na: float, nb: float) -> tuple[float, float]:
    """Adasum's scalars (ca, cb) for a·b = `dot`, |a|^2 = `na`, |b|^2 = `nb` (float64): a coefficient
    is 1 - a·b / (2|x|^2), or 1 where |x|^2 < ADASUM_EPS."""
    ca = 1.0 - dot / (2.0 * na) if na >= ADASUM_EPS else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb >= ADASUM_EPS else 1.0
    return ca, cb


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors: (1 - a·b / 2|a|^2) a + (1 - a·b / 2|b|^2) b, with per-tensor coefficients
    from a dot product and norms accumulated in float64; the sum is formed in float64, rounded once."""
    a64, b64 = a.double(), b.double()
    dot, na, nb = (float(torch.sum(x * y)) for x, y in ((a64, b64), (a64, a64), (b64, b64)))
    ca, cb = adasum_coefficients(dot, na, nb)
    return (ca * a64 + cb * b64).to(a.dtype)


def adasum_survivors(n: int) -> list[list[int]]:
    """Adasum's pairing for n ranks, n = 2^k + e with 0 <= e < 2^k: the first e odd ranks fold into
    their even left neighbour (rank 2i+1 into rank 2i, i < e); the 2^k groups that remain, in rank
    order, are combined by a balanced binary tree. Returns those 2^k groups of ranks."""
    k = n.bit_length() - 1
    e = n - (1 << k)
    return [[2 * i, 2 * i + 1] for i in range(e)] + [[r] for r in range(2 * e, n)]


def adasum_tree(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum over a group's ranks in the order of `adasum_survivors`: fold pairs (r0 + r1) ... until
    a power of two remains, then ((s0 + s1) + (s2 + s3)) ...; exactly the torch backend's order."""
    level = [parts[g[0]] if len(g) == 1 else adasum_pair(parts[g[0]], parts[g[1]])
             for g in adasum_survivors(len(parts))]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def combine(op: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reduce the ranks' tensors with `op` in rank order (half types accumulate in float32; adasum in
    float64, in adasum_tree's order)."""
    dtype = parts[0].dtype
    if op == "adasum":
        return adasum_tree(parts)
    acc = [p.float() if dtype in HALF else p for p in parts]
    if op in ("sum", "avg"):
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
    """Result per group rank of communication value `v` given the group's operands."""
    n, op, a = len(parts), v.op, v.attrs
    if op == "all_reduce":
        res = combine(a["op"], parts)
        return [res.clone() for _ in range(n)]
    if op == "reduce_scatter":
        res, d = combine(a["op"], parts), a["dim"]
        return [res.narrow(d, *_start_len(res.shape[d], n, r)).clone() for r in range(n)]
    if op == "all_gather":
        res = torch.cat(parts, dim=a["dim"])
        return [res.clone() for _ in range(n)]
    if op in ("broadcast", "reduce"):
        if a["root"] >= n:
            raise InputError(f"{op} `{v.name}`: root {a['root']} is outside its group of {n} ranks")
        if op == "broadcast":
            return [parts[a["root"]].clone() for _ in range(n)]
        res = combine(a["op"], parts)
        return [res if r == a["root"] else parts[r].clone() for r in range(n)]
    if op == "send":
        return [p.clone() for p in parts]
    raise NotImplementedError(f"no reference semantics for communication {op!r}")


def _start_len(size: int, parts: int, index: int) -> tuple[int, int]:
    start, stop = slice_bounds(size, parts, index)
    return start, stop - start


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
    for g in program.groups:
        g.ranks(world)  # raises if the world does not split into the program's stages
    inputs = reshard_inputs(program, inputs, plan.sliced_state, sizes)
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
            ranks = v.group.ranks(world)
            full = torch.cat([parts[r] for r in ranks], dim=v.layout.dim)
            parts = [full.clone() if r in ranks else None for r in range(world)]
        for r, t in enumerate(parts):
            if t is not None:
                results[r].state[name] = t
    return results


def _get(env: Mapping[Value, list[Any]], a: Value) -> list[Any]:
    """An updated state reads as its new value (updates are written in place, not computed)."""
    return env[a.args[1]] if a.op == "update" else env[a]


def _run_stage(stage: PlanStage, env: dict[Value, list[Any]], inputs: Sequence[RankInputs],
               sizes: Mapping[str, int], world: int) -> None:
    if isinstance(stage, Chunked):
        _run_chunked(stage, env, inputs, sizes, world)
        return
    for v in stage.values:  # a fused collective is RS, its kernel, then the AGs: the same values in order
        env[v] = _evaluate(v, env, inputs, sizes, world)


def _run_chunked(stage: Chunked, env: dict[Value, list[Any]], inputs: Sequence[RankInputs],
                 sizes: Mapping[str, int], world: int) -> None:
    """Run the chain chunk by chunk along stage.dim, then concatenate each value's chunks."""
    nd, dim = stage.values[0].ndim, stage.dim
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
        val = compute(v, [_get(env, a)[0] for a in v.args], RankContext(0, 1, sizes))
        return [val] * world
    ranks = v.group.ranks(world)
    out: list[Any] = [None] * world
    if v.op == "input":
        for r in ranks:
            out[r] = inputs[r][v.name]
    elif v.op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "send"):
        src = v.args[0].group.ranks(world)
        for r, t in zip(ranks, collective(v, [_get(env, v.args[0])[s] for s in src])):
            out[r] = t
    else:
        for gr, r in enumerate(ranks):
            out[r] = compute(v, [_get(env, a)[r] for a in v.args], RankContext(gr, len(ranks), sizes, chunk))
    return out
