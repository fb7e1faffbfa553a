"""Adasum: the reference's pairing against the formula written out in tree order, its properties and its
numerical range; the torch backend's vector-halving distance-doubling algorithm (directly, on sub-groups, and
through generated code) against the reference on group sizes 1 to 8."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.backends import adasum, reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.equivalence.compare import compare_results

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The pairing written out: fold (r0 + r1) .. until a power of two remains, then a balanced tree.
TREES: dict[int, Any] = {
    1: 0,
    2: (0, 1),
    3: ((0, 1), 2),
    4: ((0, 1), (2, 3)),
    5: (((0, 1), 2), (3, 4)),
    6: (((0, 1), (2, 3)), (4, 5)),
    7: (((0, 1), (2, 3)), ((4, 5), 6)),
    8: (((0, 1), (2, 3)), ((4, 5), (6, 7))),
}
# (atol, rtol) against the formula: float64 coefficients, one rounding to the dtype per pair
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 4e-3), torch.bfloat16: (1e-2, 3e-2)}


def formula(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b in float64, rounded to a's dtype."""
    x, y = a.double().flatten().tolist(), b.double().flatten().tolist()
    dot, na, nb = (sum(p * q for p, q in zip(u, v)) for u, v in ((x, y), (x, x), (y, y)))
    ca = 1 - dot / (2 * na) if na > 0 else 1.0
    cb = 1 - dot / (2 * nb) if nb > 0 else 1.0
    return (ca * a.double() + cb * b.double()).to(a.dtype)


def explicit(parts: list[torch.Tensor], tree: Any) -> torch.Tensor:
    if isinstance(tree, int):
        return parts[tree]
    return formula(explicit(parts, tree[0]), explicit(parts, tree[1]))


def assert_near(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
    """Close within the dtype's tolerance relative to `scale` (the inputs' magnitude)."""
    atol, rtol = TOL[want.dtype]
    tiny = torch.finfo(want.dtype).smallest_normal * torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, atol=max(atol * scale, 4 * tiny), rtol=rtol)


def rand_parts(n: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype) for _ in range(n)]


# -- the reference ----------------------------------------------------------------------------------------------
def test_pairing_folds_neighbours_until_a_power_of_two_remains():
    assert adasum.adasum_survivors(1) == [[0]]
    assert adasum.adasum_survivors(4) == [[0], [1], [2], [3]]
    assert adasum.adasum_survivors(7) == [[0, 1], [2, 3], [4, 5], [6]]
    assert adasum.adasum_survivors(12) == [[0, 1], [2, 3], [4, 5], [6, 7], [8], [9], [10], [11]]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), length=st.integers(1, 23), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_reference_is_the_formula_in_tree_order(n, length, dtype, seed):
    parts = rand_parts(n, (length,), dtype, seed)
    got = reference.combine("adasum", parts)
    assert got.dtype == dtype
    assert_near(got, explicit(parts, TREES[n]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_orthogonal_inputs_give_their_sum_and_identical_inputs_the_input(dtype, n):
    scales = torch.linspace(0.5, 4.0, n, dtype=torch.float64)
    orthogonal = [(torch.eye(n + 1, dtype=torch.float64)[r] * scales[r]).to(dtype) for r in range(n)]
    assert_near(reference.combine("adasum", orthogonal), torch.stack(orthogonal).double().sum(0).to(dtype))
    same = rand_parts(1, (2, 3), dtype, seed=n)[0]
    assert torch.equal(reference.combine("adasum", [same] * n), same)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["smallest normal", "largest"])
def test_extreme_magnitudes_neither_overflow_nor_lose_the_coefficients(dtype, where):
    """float32 squares of ~1e-38 underflow to 0 and of ~1e38 overflow; the float64 accumulation keeps both."""
    info = torch.finfo(dtype)
    scale = info.smallest_normal * 4 if where == "smallest normal" else info.max / 64
    n = 6
    parts = rand_parts(n, (9,), dtype, seed=3, scale=scale)
    got = reference.combine("adasum", parts)
    assert torch.isfinite(got).all()
    assert_near(got, explicit(parts, TREES[n]), scale)
    same = parts[0]
    assert torch.equal(reference.combine("adasum", [same] * n), same)  # coefficients 1/2, not 1 (no 2x)
    big = torch.tensor([info.max / 2, 0.0], dtype=torch.float64).to(dtype)
    assert torch.equal(reference.combine("adasum", [big, big.flip(0)]), torch.full((2,), info.max / 2).to(dtype))


def test_a_zero_tensor_keeps_its_coefficient_at_one():
    a = torch.tensor([1.0, -2.0, 0.5])
    zero = torch.zeros(3)
    assert torch.equal(adasum.adasum_pair(zero, a), a)
    assert torch.equal(adasum.adasum_pair(a, zero), a)
    assert torch.equal(reference.combine("adasum", [zero, zero, zero]), zero)


# -- the torch backend ------------------------------------------------------------------------------------------
# (shape, dtype, kind): sizes that do not divide, fewer elements than ranks, a 0-dim tensor, every dtype
CASES = [((7, 5), torch.float32, "random"), ((3,), torch.float32, "random"), ((), torch.float32, "random"),
         ((2, 3, 4), torch.float16, "random"), ((11,), torch.bfloat16, "random"), ((8,), torch.float32, "orthogonal"),
         ((5,), torch.float16, "identical"), ((13,), torch.float32, "tiny"), ((13,), torch.float32, "huge")]
# group sizes 5, 6 and 7 as sub-groups of a world of 8 (non-contiguous ranks: group rank != world rank)
SUBGROUPS = [(1, 2, 4, 6, 7), (0, 1, 2, 3, 5, 7), (0, 1, 2, 3, 4, 5, 6)]


def case_parts(n: int, case: tuple[Any, ...], seed: int) -> list[torch.Tensor]:
    shape, dtype, kind = case
    if kind == "orthogonal":
        return [(torch.eye(*shape, dtype=torch.float64)[r % shape[0]] * (r + 1)).to(dtype) for r in range(n)]
    if kind == "identical":
        return rand_parts(1, shape, dtype, seed) * n
    scale = {"tiny": torch.finfo(dtype).smallest_normal * 4, "huge": torch.finfo(dtype).max / 64}.get(kind, 1.0)
    return rand_parts(n, shape, dtype, seed, scale)


def program() -> cw.Program:
    p = cw.Program("adasum")
    g = p.tensor("g", (7, 3), "float32", cw.Local)
    h = p.tensor("h", (5,), "float16", cw.Local)
    p.output(cw.all_reduce(g * 2.0, "adasum") + 1.0, "g")
    p.output(cw.all_reduce(h, "adasum"), "h")
    return p


def _rank_adasum(rank: int, world_size: int, subgroups: list[tuple[int, ...]]) -> dict[str, Any]:
    """Every case on the whole world and on each sub-group this rank belongs to, then the program through
    generated code. Sub-groups are created once per rank process, in the same order on every rank."""
    import torch.distributed as dist

    from cocoweave.backends.torch.adasum import adasum_all_reduce
    from cocoweave.backends.torch.worker import run_schedules
    from cocoweave.launch import rank_state
    from cocoweave.schedule.schedule import Schedule

    groups = rank_state().setdefault("adasum_groups", {})
    for ranks in subgroups:
        if ranks not in groups:
            groups[ranks] = dist.new_group(list(ranks))
    direct: dict[tuple[int, int], torch.Tensor] = {}
    for ranks, group in [(tuple(range(world_size)), None), *((r, groups[r]) for r in subgroups)]:
        if rank in ranks:
            for i, case in enumerate(CASES):
                direct[(len(ranks), i)] = adasum_all_reduce(case_parts(len(ranks), case, i)[ranks.index(rank)], group)
    p = program()
    inputs = make_inputs(p, world_size, seed=5)
    return {"direct": direct, "program": run_schedules(rank, world_size, [Schedule(p)], inputs, {})[0]}


def check_world(results: list[dict[str, Any]], world_size: int, subgroups: list[tuple[int, ...]]) -> None:
    for ranks in [tuple(range(world_size)), *subgroups]:
        n = len(ranks)
        for i, case in enumerate(CASES):
            parts = case_parts(n, case, i)
            want = adasum.adasum_tree(parts)
            got = [results[r]["direct"][(n, i)] for r in ranks]
            assert all(torch.equal(g, got[0]) for g in got), f"group size {n}, case {case}: ranks differ"
            assert got[0].dtype == want.dtype and got[0].shape == want.shape
            scale = {"tiny": torch.finfo(case[1]).smallest_normal * 4, "huge": torch.finfo(case[1]).max / 64}
            assert_near(got[0], want, scale.get(case[2], 1.0))
            if case[2] == "identical":
                assert torch.equal(got[0], parts[0])
            if case[2] == "orthogonal":
                assert_near(got[0], torch.stack(parts).sum(0))
    p = program()
    inputs = make_inputs(p, world_size, seed=5)
    diff = compare_results(p, [r["program"] for r in results], reference.run(p, inputs))
    assert diff.ok, diff


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_torch_backend_matches_reference(local_world, world_size):
    check_world(local_world(world_size).run(_rank_adasum, []), world_size, [])


def test_torch_backend_matches_reference_on_eight_ranks_and_subgroups_of_five_to_seven(local_world):
    check_world(local_world(8).run(_rank_adasum, SUBGROUPS), 8, SUBGROUPS)


def test_combining_reads_nothing_back_to_the_host() -> None:
    """The coefficients of each level stay on the data's device: on a GPU a read-back would sync every level
    (meta tensors have no values to read: the combination must still go through)."""
    from cocoweave.backends.torch.adasum import _combine, _triple

    a, b = torch.empty(10, device="meta"), torch.empty(10, device="meta")
    _combine(a, b, _triple(a, b), a)
    x, y = torch.randn(100), torch.randn(100)
    out = torch.empty(100)
    _combine(x, y, _triple(x, y), out)
    assert torch.equal(out, adasum.adasum_pair(x, y))
