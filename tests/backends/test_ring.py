"""Ring reduce-scatter / all-gather and the fused RS-C-AG ring against torch.distributed's all_reduce, on Gloo.

One run per world size sends every case to the ranks; each rank compares its results with the library's
and returns the failures (a rank never raises mid-way, which would leave the others blocked)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cocoweave.backends.torch.ring import fused_ring, ring_all_gather, ring_reduce_scatter
from cocoweave.errors import BackendError
from cocoweave.ir.layout import slice_bounds

_LIB_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# (shape, dim): uneven splits, parts that are empty at 3 or 4 ranks, both dims of a 2-D tensor, a 1-D tensor
_SHAPES = [((7, 5), 0), ((2, 3), 0), ((5, 7), 1), ((3, 2), -1), ((10,), 0)]
_DTYPES = [torch.float32, torch.float16]


def _rand(shape: tuple[int, ...], seed: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _narrow(t: torch.Tensor, dim: int, bounds: tuple[int, int]) -> torch.Tensor:
    return t.narrow(dim, bounds[0], bounds[1] - bounds[0])


def _lib_all_reduce(x: torch.Tensor, op: str, p: int) -> torch.Tensor:
    """The library's all_reduce, in float32 (Gloo would reduce half tensors in half), cast back."""
    buf = x.to(torch.float32, copy=True)
    dist.all_reduce(buf, _LIB_OP[op])
    return (buf / p if op == "avg" else buf).to(x.dtype)


def _lib_all_gather(part: torch.Tensor, dim: int, shape: tuple[int, ...], rank: int, p: int) -> torch.Tensor:
    """The library's all-gather of tensor_split parts: a sum of tensors that are zero outside each part."""
    full = torch.zeros(shape, dtype=torch.float32)
    _narrow(full, dim, slice_bounds(shape[dim], p, rank)).copy_(part)
    dist.all_reduce(full)
    return full.to(part.dtype)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # half: both sides round the same float32 value summed in another order; one half ulp apart at most
    return {"rtol": 2e-3, "atol": 1e-3} if dtype == torch.float16 else {"rtol": 1e-5, "atol": 1e-5}


def _check(failures: list[str], name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(got, want, **_tolerance(want.dtype))
    except AssertionError as exc:
        failures.append(f"{name}: " + " ".join(str(exc).split()))


def _rank_collectives(rank: int, p: int, cases: list[tuple[Any, ...]]) -> list[str]:
    failures: list[str] = []
    for seed, (shape, dim, op, dtype) in enumerate(cases):
        name = f"shape={shape} dim={dim} op={op} {dtype}"
        bounds = slice_bounds(shape[dim], p, rank)
        x = _rand(shape, seed, rank, dtype)
        want = _narrow(_lib_all_reduce(x, op, p), dim, bounds)
        out = torch.full(want.shape, float("nan"), dtype=dtype)
        ring_reduce_scatter(x, dim, op, None, out)
        _check(failures, "reduce_scatter " + name, out, want)
        again = torch.empty_like(out)
        ring_reduce_scatter(x, dim, op, None, again)
        if not torch.equal(again, out):
            failures.append(f"reduce_scatter {name}: two runs differ")
        if op == "sum":
            part = _narrow(x, dim, bounds)
            full = torch.full(shape, float("nan"), dtype=dtype)
            ring_all_gather(part, dim, None, full)
            _check(failures, "all_gather " + name, full, _lib_all_gather(part, dim, shape, rank, p))
    return failures


def _affine(g: torch.Tensor, offset: int, length: int) -> list[torch.Tensor]:
    return [g * 2 + 1, g.square()]


def _state(m_part: torch.Tensor, dim: int, g: torch.Tensor, offset: int, length: int) -> list[torch.Tensor]:
    """Reads this rank's part of the state m at the piece's offsets, as Adam reads its moments."""
    m1 = 0.9 * m_part.narrow(dim, offset, length) + 0.1 * g
    return [m1, g - 0.5 * m1]


def _shift(g: torch.Tensor, offset: int, length: int) -> list[torch.Tensor]:
    return [g * 2 + 1]


def _rowsum(g: torch.Tensor, offset: int, length: int) -> list[torch.Tensor]:
    """An output whose other dims differ from the input's."""
    return [g.sum(dim=1, keepdim=True)]


def _compute(kind: str, shape: tuple[int, ...], m_part: torch.Tensor, dim: int) -> tuple[Any, list[tuple[int, ...]]]:
    """The compute function of a fused case and the shapes of its outputs."""
    if kind == "affine":
        return _affine, [shape, shape]
    if kind == "state":
        return functools.partial(_state, m_part, dim), [shape, shape]
    if kind == "inplace":
        return _shift, [shape]
    return _rowsum, [(shape[0], 1)]


def _rank_fused(rank: int, p: int, cases: list[tuple[Any, ...]]) -> list[str]:
    failures: list[str] = []
    for seed, (shape, dim, op, dtype, subchunks, kind) in enumerate(cases):
        name = f"fused {kind} shape={shape} dim={dim} op={op} {dtype} subchunks={subchunks}"
        d = dim % len(shape)
        part = slice_bounds(shape[d], p, rank)
        x = _rand(shape, 100 + seed, rank, dtype)
        m = _rand(shape, 200 + seed, -1, dtype)  # Replicated optimizer state: the same on every rank
        compute, out_shapes = _compute(kind, shape, m.narrow(d, part[0], part[1] - part[0]), d)
        reduced = _narrow(_lib_all_reduce(x, op, p), d, part)
        wants = [_lib_all_gather(r, d, s, rank, p) for r, s in zip(compute(reduced, 0, part[1] - part[0]), out_shapes)]
        outs = [x] if kind == "inplace" else [torch.full(s, float("nan"), dtype=dtype) for s in out_shapes]
        fused_ring(x, dim, op, None, compute, outs, subchunks=subchunks)
        for i, (got, want) in enumerate(zip(outs, wants)):
            _check(failures, f"{name} output {i}", got, want)
    return failures


def _collective_cases() -> list[tuple[Any, ...]]:
    return [(shape, dim, op, dtype) for shape, dim in _SHAPES for op in _LIB_OP for dtype in _DTYPES]


def _fused_cases() -> list[tuple[Any, ...]]:
    cases: list[tuple[Any, ...]] = []
    for shape, dim in _SHAPES:
        for subchunks in (1, 2, 3):
            cases.append((shape, dim, "sum", torch.float32, subchunks, "affine"))
        cases.append((shape, dim, "avg", torch.float32, 2, "state"))
        cases.append((shape, dim, "max", torch.float16, 2, "affine"))
        cases.append((shape, dim, "sum", torch.float32, 3, "inplace"))
    cases.append(((7, 5), 0, "min", torch.float32, 2, "rowsum"))
    cases.append(((9, 4), 0, "avg", torch.float16, 4, "rowsum"))
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_collectives_match_library(local_world, world_size: int) -> None:
    results = local_world(world_size).run(_rank_collectives, _collective_cases())
    assert [f for r, fs in enumerate(results) for f in (f"rank {r}: {x}" for x in fs)] == []


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fused_ring_matches_reduce_scatter_compute_all_gather(local_world, world_size: int) -> None:
    results = local_world(world_size).run(_rank_fused, _fused_cases())
    assert [f for r, fs in enumerate(results) for f in (f"rank {r}: {x}" for x in fs)] == []


def test_bad_arguments_are_refused_before_any_message() -> None:
    x = torch.zeros(4, 2)
    with pytest.raises(BackendError, match="one of sum, avg, max, min"):
        ring_reduce_scatter(x, 0, "prod", None, x)
    with pytest.raises(BackendError, match="subchunks >= 1"):
        fused_ring(x, 0, "sum", None, _affine, [x], subchunks=0)


def test_under_nccl_every_rank_joins_the_communicator_before_its_first_messages(monkeypatch) -> None:
    """A rank of a 3-rank NCCL ring reducing 2 elements has an empty chunk and would post no message in the
    group's first batch_isend_irecv, which torch requires of every rank: it joins with one all-reduce first, once
    per group (faked NCCL; the device faked as meta)."""
    from cocoweave.backends.torch import placement, ring

    joined, posted = [], []
    monkeypatch.setattr(ring, "_JOINED", set())
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1, 2])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(placement, "compute_device", lambda: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: joined.append(t.device.type))
    monkeypatch.setattr(dist, "P2POp", lambda *args: args)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted.append(len(ops)) or [])
    group = object()
    for _ in range(2):
        ring_all_gather(torch.ones(0), 0, group, torch.zeros(2))
    assert joined == ["meta"]
    assert posted and posted[0] >= 1
