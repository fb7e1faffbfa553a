"""The planner: deadlines and budgets are respected, infeasible requests say what is achievable,
spot overhead grows with the revocation rate, the Pareto front is right, inputs are validated."""

from __future__ import annotations

import math

import pytest

from cocoweave.cluster.catalog import Catalog, MachineType, parse_catalog
from cocoweave.cluster.planning.planner import evaluate_options, pareto_front, plan_cluster, spot_hours
from cocoweave.cluster.planning.step_times import ProfilePoint, WorkloadProfile, parse_profile
from cocoweave.errors import PlanningError

STEPS = 100_000


def profile(checkpoint_s: float = 10.0) -> WorkloadProfile:
    points = []
    for gpu, single, cap in (("K80", 0.40, 30.0), ("P100", 0.15, 40.0)):
        for ps in (1, 2):
            for w in range(1, 9):
                rate = min(w / single, cap * ps ** 0.5)
                points.append(ProfilePoint(gpu, ps, w, 1.0 / rate))
    return WorkloadProfile("synthetic", checkpoint_s, tuple(points))


def catalog(revocations: float = 0.1) -> Catalog:
    return Catalog((MachineType("k80", "K80", 0.60, 0.18, revocations, 80.0),
                    MachineType("p100", "P100", 1.60, 0.45, revocations, 90.0)), "ps", 0.30)


def test_deadline_is_met_at_the_lowest_cost():
    result = plan_cluster(profile(), catalog(), STEPS, deadline_h=2.0)
    assert result.best.hours <= 2.0
    feasible = [o for o in result.options if o.hours <= 2.0]
    assert result.best.cost == min(o.cost for o in feasible)


def test_budget_is_met_in_the_shortest_time():
    result = plan_cluster(profile(), catalog(), STEPS, budget_usd=5.0)
    assert result.best.cost <= 5.0
    feasible = [o for o in result.options if o.cost <= 5.0]
    assert result.best.hours == min(o.hours for o in feasible)


def test_each_deadline_picks_the_cheapest_front_point_meeting_it():
    front = plan_cluster(profile(), catalog(), STEPS, deadline_h=100.0).front
    assert len(front) >= 3
    for point in front:
        best = plan_cluster(profile(), catalog(), STEPS, deadline_h=point.hours).best
        assert best.cost == point.cost  # later front points are cheaper but miss the deadline
    assert front[0].cost > front[-1].cost  # a tighter deadline costs more


def test_infeasible_deadline_says_what_is_achievable():
    fastest = min(o.hours for o in evaluate_options(profile(), catalog(), STEPS)[0])
    with pytest.raises(PlanningError) as info:
        plan_cluster(profile(), catalog(), STEPS, deadline_h=fastest / 2)
    message = str(info.value)
    assert "within" in message and f"fastest achievable is {fastest:.2f} h" in message


def test_infeasible_budget_says_what_is_achievable():
    cheapest = min(o.cost for o in evaluate_options(profile(), catalog(), STEPS)[0])
    with pytest.raises(PlanningError, match=rf"cheapest is \${cheapest:,.2f}"):
        plan_cluster(profile(), catalog(), STEPS, budget_usd=cheapest / 2)


def test_a_constraint_is_required_and_must_be_positive():
    with pytest.raises(PlanningError, match="deadline"):
        plan_cluster(profile(), catalog(), STEPS)
    with pytest.raises(PlanningError, match="positive"):
        plan_cluster(profile(), catalog(), STEPS, budget_usd=-3.0)


def test_spot_overhead_grows_with_revocation_rate():
    hours = [spot_hours(10.0, 4, rate, 0.025, 10.0 / 3600)[0] for rate in (0.0, 0.01, 0.05, 0.2, 0.5)]
    assert hours[0] == pytest.approx(10.025)  # no revocations: startup + compute, no checkpoints
    assert all(a < b for a, b in zip(hours, hours[1:]))
    spots = {rate: [o for o in evaluate_options(profile(), catalog(rate), STEPS)[0] if o.pricing == "spot"]
             for rate in (0.05, 0.3)}
    assert all(hi.hours > lo.hours and hi.cost > lo.cost for lo, hi in zip(spots[0.05], spots[0.3]))


def test_checkpoint_interval_follows_young_and_hopeless_spot_jobs_are_left_out():
    _, interval_h, revocations = spot_hours(10.0, 4, 0.1, 0.025, 10.0 / 3600)
    assert interval_h == pytest.approx(math.sqrt(2 * (10.0 / 3600) / (4 * 0.1)))
    assert revocations > 4 * 0.1 * 10.0  # the job runs longer than its compute time
    assert spot_hours(10.0, 8, 20.0, 0.5, 0.01) is None  # revoked faster than it progresses
    _, unfinishable = evaluate_options(profile(), catalog(revocations=20.0), STEPS)
    assert unfinishable > 0


def test_pareto_front_holds_exactly_the_undominated_options():
    options, _ = evaluate_options(profile(), catalog(), STEPS)
    front = pareto_front(options)

    def beats(a, b):
        return a.hours <= b.hours and a.cost <= b.cost and (a.hours < b.hours or a.cost < b.cost)

    assert [o.hours for o in front] == sorted(o.hours for o in front)
    assert not any(beats(o, f) for f in front for o in options)
    assert all(any(beats(f, o) or (f.hours, f.cost) == (o.hours, o.cost) for f in front) for o in options)


def test_catalog_validation_names_the_entry():
    good = {"parameter_server": {"name": "ps", "on_demand_per_hour": 0.3},
            "machines": [{"name": "k80", "gpu": "k80", "on_demand_per_hour": 0.6, "startup_s": 80}]}
    parsed = parse_catalog(good, "cat.yaml")
    assert parsed.machines[0].gpu == "K80" and parsed.machines[0].spot_per_hour is None
    with pytest.raises(PlanningError, match=r"machines\[0\]: 'on_demand_per_hour'"):
        parse_catalog({**good, "machines": [{**good["machines"][0], "on_demand_per_hour": -1}]}, "cat.yaml")
    with pytest.raises(PlanningError, match="parameter_server"):  # optional (run profiles need none), but valid
        parse_catalog({**good, "parameter_server": {"name": "ps"}}, "cat.yaml")
    assert parse_catalog({"machines": good["machines"]}, "cat.yaml").ps_per_hour is None


def test_profile_validation_and_machines_without_profiled_gpu():
    doc = {"name": "w", "checkpoint_s": 5, "step_time_s": {"p100": {1: 0.2, 2: 0.1}}}
    prof = parse_profile(doc, "p.yaml")
    assert prof.gpus == {"P100"} and {p.ps for p in prof.points} == {1}
    with pytest.raises(PlanningError, match="worker count"):
        parse_profile({**doc, "step_time_s": {"P100": {"two": 0.1}}}, "p.yaml")
    k80_only = Catalog((MachineType("k80", "K80", 0.6, None, 0.0, 80.0),), "ps", 0.3)
    with pytest.raises(PlanningError, match="P100"):
        plan_cluster(prof, k80_only, STEPS, budget_usd=10)


def test_whole_machines_are_rented_and_revoked():
    node = MachineType("node8", "P100", 8.0, 2.0, 0.1, 90.0, gpus_per_node=8)
    points = tuple(ProfilePoint("P100", 0, w, 0.1 / w) for w in (1, 8, 9))
    prof = WorkloadProfile("w", 10.0, points)
    options, _ = evaluate_options(prof, Catalog((node,), None, None), STEPS)
    by = {(o.workers, o.pricing): o for o in options}
    assert by[(1, "on-demand")].cost == pytest.approx(by[(1, "on-demand")].hours * 8.0)  # a whole node for 1 GPU
    assert by[(9, "on-demand")].cost == pytest.approx(by[(9, "on-demand")].hours * 16.0)  # two nodes
    assert by[(9, "spot")].expected_revocations > by[(8, "spot")].expected_revocations


def test_points_for_one_machine_stay_on_that_machine():
    a = MachineType("a", "P100", 1.0, None, 0.0, 60.0)
    b = MachineType("b", "P100", 1.0, None, 0.0, 60.0)
    prof = WorkloadProfile("w", 10.0, (ProfilePoint("P100", 0, 1, 0.5, machine="a"),))
    options, _ = evaluate_options(prof, Catalog((a, b), None, None), STEPS)
    assert {o.machine.name for o in options} == {"a"}


def test_parameter_servers_need_a_priced_parameter_server():
    with pytest.raises(PlanningError, match="needs parameter servers"):
        evaluate_options(profile(), Catalog(catalog().machines, None, None), STEPS)
