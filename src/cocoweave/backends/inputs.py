"""Per-rank inputs: random valid inputs for a program, validation of given ones, and gathering
per-rank values back into logical tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import settings
from ..errors import InputError
from ..ir import registry as R
from ..ir.graph import Program, Value
from ..ir.layout import Layout, Replicated, cut, local_shape, part_bounds, placements
from ..ir.semantics import local_rank
from ..ir.types import DTYPES, bind_shape

RankInputs = dict[str, Any]
# Whether check_rank_inputs rejects NaN/Inf inputs by default (one pass over every input; off by default).
CHECK_FINITE = settings.CHECK_FINITE.get()


def bound_sizes(program: Program, sizes: Mapping[str, int] | None) -> dict[str, int]:
    """Check that every symbolic size of the program is bound to a non-negative int."""
    sizes = dict(sizes or {})
    missing = [n for n in program.size_names() if n not in sizes]
    if missing:
        raise InputError(f"program `{program.name}`: size {', '.join(missing)} is not bound; "
                         f"pass sizes={{{', '.join(repr(m) + ': ...' for m in missing)}}}")
    for n, s in sizes.items():
        if not isinstance(s, int) or s < 0:
            raise InputError(f"program `{program.name}`: size {n} must be a non-negative int, got {s!r}")
    return sizes


def _random(shape: tuple[int, ...], dtype: str, init: str, gen: torch.Generator, device: str) -> torch.Tensor:
    if dtype == "bool":
        t = torch.rand(shape, generator=gen) < 0.5
    elif dtype.startswith("int"):
        t = torch.randint(0, 10, shape, generator=gen, dtype=DTYPES[dtype])
    elif init == "positive":
        t = (torch.rand(shape, generator=gen) + 0.1).to(DTYPES[dtype])
    elif init == "unit":
        t = torch.rand(shape, generator=gen).to(DTYPES[dtype])
    else:
        t = torch.randn(shape, generator=gen).to(DTYPES[dtype])
    return t.to(device)


def make_inputs(program: Program, world_size: int, sizes: Mapping[str, int] | None = None, seed: int = 0,
                device: str = "cpu", scalars: Mapping[str, float] | None = None) -> list[RankInputs]:
    """Random valid inputs per rank: identical for Replicated, different for Local, the rank's part
    of one logical tensor for Sliced. Scalars take their default, else a value in [0.1, 0.9)."""
    sizes = bound_sizes(program, sizes)
    gen = torch.Generator().manual_seed(seed)
    per_rank: list[RankInputs] = [{} for _ in range(world_size)]
    for v in program.tensor_inputs:
        full = bind_shape(v.shape, sizes)
        whole = [(0, n) for n in full]
        logical: dict[int, torch.Tensor] = {}  # one logical tensor per set of ranks holding the same values
        for r in v.group.ranks(world_size):
            pos = v.position(r, world_size)
            key = local_rank(v.layout, pos)
            if key not in logical:
                logical[key] = _random(full, v.dtype, v.attrs["init"], gen, device)
            per_rank[r][v.name] = cut(logical[key], whole, part_bounds(v.layout, full, pos)).clone()
    drawn: set[str] = set()
    for v in program.values:  # inputs that must agree (all_to_all_v's, grouped_matmul's counts): the op draws them
        draw = R.opdef(v.op).draw
        if draw is not None:
            draw(v, per_rank, sizes, gen, drawn)
    for v in program.scalar_inputs:
        given = (scalars or {}).get(v.name, v.attrs.get("default"))
        value = float(given) if given is not None else 0.1 + 0.8 * torch.rand((), generator=gen).item()
        for r in range(world_size):
            per_rank[r][v.name] = value
    return per_rank


def check_inputs(program: Program, inputs: Sequence[RankInputs], sizes: Mapping[str, int]) -> None:
    """Every rank has exactly its inputs, with the right local shape and dtype, on one device."""
    world_size = len(inputs)
    if world_size < 1:
        raise InputError(f"program `{program.name}`: inputs for at least one rank are needed")
    devices: set = set()
    for r, given in enumerate(inputs):
        mine = check_rank_inputs(program, r, world_size, given, sizes)
        if devices and mine and mine != devices:
            raise InputError(f"rank {r}: inputs are on {next(iter(mine))}, those of the ranks before it on "
                             f"{next(iter(devices))}; put every input on one device")
        devices |= mine


def check_rank_inputs(program: Program, r: int, world_size: int, given: RankInputs,
                      sizes: Mapping[str, int], check_finite: bool | None = None) -> set:
    """Rank r's inputs are exactly the program's, with its local shapes and dtypes; returns their devices.
    With `check_finite` (default: $COCOWEAVE_CHECK_FINITE=1) floating inputs must hold no NaN or Inf."""
    finite = CHECK_FINITE if check_finite is None else check_finite
    devices = set()
    first = ""
    expected = {v.name for v in program.scalar_inputs}
    for v in program.tensor_inputs:
        if r in v.group.ranks(world_size):
            expected.add(v.name)
    missing = sorted(expected - set(given))
    extra = sorted(set(given) - expected)
    if missing:
        raise InputError(f"rank {r}: input `{missing[0]}` of program `{program.name}` is missing")
    if extra:
        raise InputError(f"rank {r}: `{extra[0]}` is not an input of program `{program.name}` on this rank")
    for v in program.tensor_inputs:
        if v.name not in given:
            continue
        t = given[v.name]
        want = local_shape(v, sizes, v.position(r, world_size))
        if not isinstance(t, torch.Tensor):
            raise InputError(f"rank {r}: input `{v.name}` must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise InputError(f"rank {r}: input `{v.name}` has shape {list(t.shape)}, expected {list(want)} "
                             f"(its {v.layout!r} part of {list(bind_shape(v.shape, sizes))})")
        if t.dtype != DTYPES[v.dtype]:
            raise InputError(f"rank {r}: input `{v.name}` is {t.dtype}, expected {DTYPES[v.dtype]}")
        if finite and t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise InputError(f"rank {r}: input `{v.name}` has {bad} NaN or Inf value{'s' if bad > 1 else ''} "
                                 f"(of {t.numel()}); inputs are checked because finite checks are on")
        if devices and t.device not in devices:
            raise InputError(f"rank {r}: input `{v.name}` is on {t.device}, input `{first}` on "
                             f"{next(iter(devices))}; put every input on one device")
        first = first or v.name
        devices.add(t.device)
    for v in program.scalar_inputs:
        s = given[v.name]
        if isinstance(s, torch.Tensor) and s.numel() != 1 or not isinstance(s, int | float | torch.Tensor):
            raise InputError(f"rank {r}: scalar `{v.name}` must be a number, got {s!r}")
        if finite and not math.isfinite(float(s)):
            raise InputError(f"rank {r}: scalar `{v.name}` is {float(s)}; inputs are checked because finite "
                             "checks are on")
    return devices


def gather_axes(v: Value, parts: Sequence[torch.Tensor | None], world_size: int) -> list[torch.Tensor | None]:
    """Per world rank, the whole of a value's parts along every axis that slices it (the innermost slicing
    first, so each gather concatenates contiguous parts); Local and Replicated axes are left as they are."""
    out = list(parts)
    axes = v.axes
    for axis, p in reversed(list(zip(axes, placements(v.layout, len(axes))))):
        if not p.is_sliced:
            continue
        for line in v.group.lines(world_size, axis):
            whole = torch.cat([out[r] for r in line], dim=p.dim)
            for r in line:
                out[r] = whole
    return [None if t is None else t.clone() for t in out]


def gather_logical(v: Value, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rebuild a logical tensor from its group's per-rank parts (in group order): put Sliced parts together,
    take rank 0's copy of a Replicated tensor, stack Local values along a new leading rank dimension (on a mesh,
    every rank's value with its sliced axes put together)."""
    parts = list(parts)
    if v.layout.is_sliced:
        world = len(parts) * v.group.count
        offset = v.group.ranks(world)[0]
        by_rank: list[torch.Tensor | None] = [None] * world
        for i, t in enumerate(parts):
            by_rank[offset + i] = t
        parts = gather_axes(v, by_rank, world)[offset:offset + len(parts)]
    if v.layout.is_local:
        return torch.stack(parts)
    return parts[0]


def reshard_inputs(program: Program, inputs: Sequence[RankInputs], names: Sequence[str],
                   sizes: Mapping[str, int], unsliced: Mapping[str, Layout] | None = None) -> list[RankInputs]:
    """Inputs given in the original layouts (`unsliced`, Replicated by default), adapted to `program` (a
    scheduled version) for the tensors `names` it stores sliced (as_slice): each rank keeps its part of what
    it was given. Tensors already given in their new part are left as they are."""
    world = len(inputs)
    out = [dict(i) for i in inputs]
    for name in names:
        v = program.inputs[name]
        was = (unsliced or {}).get(name, Replicated)
        full = bind_shape(v.shape, sizes)
        for r in v.group.ranks(world):
            t = inputs[r].get(name)
            pos = v.position(r, world)
            have = part_bounds(was, full, pos)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(b - a for a, b in have):
                continue  # missing, malformed (check_inputs says so) or already sliced
            out[r][v.name] = cut(t, have, part_bounds(v.layout, full, pos)).clone()
    return out
