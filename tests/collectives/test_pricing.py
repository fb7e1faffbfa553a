"""One pricing model of collectives (collectives/pricing.py): a tree all-reduce registered once, with its traffic and
message steps, is priced by the tuner's cost model, the profiler's hardware model and the LLM planner's comm pricing
exactly as its formula says, and forgotten by all three when it is removed. The LLM planner's NCCL (ring or tree,
whichever is faster) reads the library's registered variants: NCCL's tree is one registration, not a formula of
the planner's."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

import cocoweave.tune as tune
from cocoweave import collectives
from cocoweave.cluster.catalog import Catalog, GPUSpec, MachineType, NetworkSpec
from cocoweave.cluster.planning.llm.comm import collective_s, priced
from cocoweave.cluster.profiling.hardware_model import comm_ms
from cocoweave.cluster.profiling.host_scaling import Traffic
from cocoweave.collectives.pricing import Link
from cocoweave.errors import CocoweaveError
from cocoweave.ir.loader import load_example
from cocoweave.perf.costmodel import AlphaBeta, Calibration, PlanCoster
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules

LINK = Link("l", 1e11, 1e-6)  # 100 GB/s, 1 us a step
NVL = NetworkSpec("nvl", 100.0, 2.0, "s")
CATALOG = Catalog((MachineType("node", "G", 1.0, None, 0.0, 0.0, 8, "nvl", "ib"),), None, None,
                  {"G": GPUSpec("G", "g", {"float32": 10.0}, 1000.0, 80.0, "s")}, {"nvl": NVL},
                  {"compute": 1.0, "memory": 1.0, "network": 0.5}, 0.0, "test")


def depth(p: int) -> int:
    return math.ceil(math.log2(p))


def binomial_moved(op: str, p: int) -> float:
    """A binomial tree all-reduce: reduce to a root, broadcast back; the root takes the whole tensor at every level."""
    return 2.0 * depth(p) if op == "all_reduce" else collectives.moved(op, p)


def binomial_steps(op: str, p: int) -> int:
    return 2 * depth(p) if op == "all_reduce" else collectives.steps(op, p)


def _register() -> collectives.Algorithm:
    """The one registration: what it runs, where enumeration moves it, what it moves and in how many steps."""
    return collectives.register(collectives.Algorithm(
        "binomial", ("all_reduce",), ("sum", "avg"), enumerated=(("written", ("collective",)),), auto="never",
        traffic=binomial_moved, steps=binomial_steps))


@pytest.fixture
def binomial(monkeypatch) -> Iterator[collectives.Algorithm]:
    monkeypatch.setattr(tune, "cached_schedule", lambda *a, **k: None)
    algorithm = _register()
    try:
        yield algorithm
    finally:
        collectives.unregister("binomial")


def _tuner_terms(p: int, cal: Calibration) -> dict[str, tuple[float, float]]:
    """(bytes a rank moves, predicted ms) of the all-reduce of Adam as written and on the binomial tree, at p."""
    found = {s.name: s for s in enumerate_schedules(load_example("adam.py:adam", N=64))}
    out = {}
    for name in ("AR-C", "AR@binomial-C"):
        plan = lower(found[name])
        coster = PlanCoster(plan, {}, p, cal)
        term = coster.terms(plan.stages[0])[0]
        out[name] = (term.amount, coster.price(term))
    return out


def test_the_tuner_prices_it_by_its_formula(binomial):
    alpha, beta = 0.5, 2.0  # the library's line: ms per call, ms per MB a rank moves
    cal = Calibration("torch", "cpu", 8, {"all_reduce/library": AlphaBeta(alpha, beta)}, {}, {})
    terms = _tuner_terms(8, cal)
    whole = terms["AR-C"][0] / collectives.moved("all_reduce", 8)  # the tensor's bytes
    assert terms["AR-C"][1] == pytest.approx(alpha + beta * whole * 2 * 7 / 8 / 1e6)
    # the library's line carried to the tree: its latency per step (alpha / 14 steps) x 6 steps, 6 x the tensor
    assert terms["AR@binomial-C"][0] == pytest.approx(whole * 6)
    assert terms["AR@binomial-C"][1] == pytest.approx(alpha * 6 / 14 + beta * whole * 6 / 1e6)


def test_the_profilers_hardware_model_prices_it_by_its_formula(binomial):
    traffic = Traffic({"all_reduce": (3.0, 1e9), "all_gather": (2.0, 1e8)})
    bw, lat = 100e9 * 0.5, 2e-6
    gather = 2 * (7 * lat) + 7 / 8 * 1e8 / bw  # not a collective the tree runs: the library's
    assert comm_ms(traffic, NVL, 8, CATALOG) == pytest.approx(1e3 * (3 * 14 * lat + 2 * 7 / 8 * 1e9 / bw + gather))
    assert comm_ms(traffic, NVL, 8, CATALOG, "binomial") == pytest.approx(1e3 * (3 * 6 * lat + 6 * 1e9 / bw + gather))


def test_the_llm_planner_prices_it_by_its_formula(binomial):
    n = 1e8
    assert collective_s("all_reduce", n, 8, LINK, "binomial") == pytest.approx(6 * 1e-6 + 6 * n / 1e11)
    assert collective_s("all_reduce", n, 8, LINK) == pytest.approx(14 * 1e-6 + 2 * 7 / 8 * n / 1e11)  # NCCL's ring


def test_all_three_forget_it_when_it_is_removed():
    _register()
    collectives.unregister("binomial")
    assert not any("@binomial" in s.name for s in enumerate_schedules(load_example("adam.py:adam", N=64)))
    cal = Calibration("torch", "cpu", 8, {"all_reduce/library": AlphaBeta(0.5, 2.0)}, {}, {})
    traffic = Traffic({"all_reduce": (1.0, 1e9)})
    for call in (lambda: cal.collective_at("all_reduce", "binomial", 8),
                 lambda: comm_ms(traffic, NVL, 8, CATALOG, "binomial"),
                 lambda: collective_s("all_reduce", 1e8, 8, LINK, "binomial")):
        with pytest.raises(collectives.UnknownAlgorithmError, match="unknown collective algorithm 'binomial'"):
            call()


def _ring(n: float, g: int) -> float:
    return 2 * (g - 1) * 1e-6 + 2 * (g - 1) / g * n / 1e11


def test_the_planners_nccl_picks_among_the_librarys_registered_variants():
    tree = next(a for a in collectives.variants(collectives.DEFAULT) if a.name == "tree")
    small = 1e3  # latency bound at 1024 ranks: NCCL's tree, as its registration prices it
    assert priced("all_reduce", small, 1024, LINK) == pytest.approx((2 * 10 * 1e-6 + 2 * small / 1e11, "tree"))
    collectives.unregister("tree")
    try:
        assert priced("all_reduce", small, 1024, LINK) == pytest.approx((_ring(small, 1024), "ring"))
        # an in-network reduction registered inside the library: each rank sends and receives the tensor once
        collectives.register(collectives.Algorithm("collnet", ("all_reduce",), inside=collectives.DEFAULT,
                                                   traffic=lambda op, p: 1.0, steps=lambda op, p: 2))
        try:
            assert priced("all_reduce", 1e9, 64, LINK) == pytest.approx((2 * 1e-6 + 1e9 / 1e11, "collnet"))
            assert priced("all_gather", 1e9, 64, LINK)[1] == "ring"  # it runs all-reduces only
            # the profiler's model of a step's summed calls does not model NCCL's choice per message
            assert comm_ms(Traffic({"all_reduce": (1.0, 1e9)}), NVL, 64, CATALOG) == pytest.approx(
                1e3 * (126 * 2e-6 + 2 * 63 / 64 * 1e9 / 50e9))
        finally:
            collectives.unregister("collnet")
        assert priced("all_reduce", 1e9, 64, LINK) == pytest.approx((_ring(1e9, 64), "ring"))
    finally:
        collectives.register(tree)
    assert priced("all_reduce", small, 1024, LINK)[1] == "tree"


def test_a_variant_runs_only_inside_its_algorithms_call():
    assert "tree" not in collectives.names()  # not a schedule's choice: the library's call picks it
    with pytest.raises(collectives.UnknownAlgorithmError, match="unknown collective algorithm 'tree'"):
        collectives.implement("torch", "tree", all_reduce=lambda *a: None)
    with pytest.raises(CocoweaveError, match="runs inside the library algorithm's call"):
        collectives.register(collectives.Algorithm("nvls", ("all_reduce",), inside=collectives.DEFAULT,
                                                   enumerated=(("written", ("collective",)),)))
    with pytest.raises(CocoweaveError, match="'tree' is already registered"):
        collectives.register(collectives.Algorithm("tree", ("all_reduce",)))
