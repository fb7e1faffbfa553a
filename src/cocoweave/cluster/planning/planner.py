"""Recommend a cluster configuration for a deadline or a budget, and the time/cost Pareto front.

A configuration is a machine type, a pricing (on-demand or spot), a worker count and a
parameter-server count. Time = startup + steps x step time. On spot machines we count, conservatively,
each revocation as a restart of the whole job from its last checkpoint: with cluster revocation
rate L (workers x per-machine rate), checkpoint time d and Young's interval t = sqrt(2 d / L),

    T = (startup + compute x (1 + d / t)) / (1 - L x (startup + t / 2)),

i.e. checkpoint overhead plus, per expected revocation, a new machine's startup and half an interval
of lost work. Parameter servers are on-demand. Cost = T x hourly price of all machines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cocoweave.cluster.catalog import Catalog, MachineType
from cocoweave.cluster.planning.checkpoint_model import young_interval
from cocoweave.cluster.planning.resize import SECONDS_PER_HOUR, predict_resizes
from cocoweave.cluster.planning.step_times import WorkloadProfile
from cocoweave.elastic import BatchPolicy
from cocoweave.errors import PlanningError

Pricing = Literal["on-demand", "spot"]


@dataclass(frozen=True)
class Option:
    """One evaluated configuration: expected wall-clock hours and dollars."""

    machine: MachineType
    pricing: Pricing
    workers: int
    ps: int
    step_time_s: float
    hours: float
    cost: float
    checkpoint_interval_s: float | None
    expected_revocations: float

    def describe(self) -> str:
        ps = f", {self.ps} PS" if self.ps else ""
        return f"{self.workers} x {self.machine.gpu} {self.pricing} ({self.machine.name}){ps}"


@dataclass(frozen=True)
class ClusterPlan:
    """All evaluated options, their Pareto front (fastest first) and the recommendation."""

    steps: int
    deadline_h: float | None
    budget_usd: float | None
    options: tuple[Option, ...]
    front: tuple[Option, ...]
    best: Option
    unfinishable: int


def spot_hours(compute_h: float, machines: int, revocations_per_hour: float, startup_h: float,
               checkpoint_h: float) -> tuple[float, float | None, float] | None:
    """Expected hours, checkpoint interval (hours) and revocations of a spot job on `machines` revocable
    machines; None if it is expected never to finish (revocations arrive faster than it can make progress)."""
    rate = machines * revocations_per_hour
    if rate == 0:
        return startup_h + compute_h, None, 0.0
    interval_h = young_interval(checkpoint_h, 1.0 / rate)
    denominator = 1.0 - rate * (startup_h + interval_h / 2.0)
    if denominator <= 0:
        return None
    hours = (startup_h + compute_h * (1.0 + checkpoint_h / interval_h)) / denominator
    return hours, interval_h, rate * hours


def points_for(profile: WorkloadProfile, machine: MachineType) -> list:
    """The profile's points that apply to `machine`: its GPU, and that machine or none named."""
    return [p for p in profile.points if p.gpu == machine.gpu and p.machine in (None, machine.name)]


def evaluate_options(profile: WorkloadProfile, catalog: Catalog, steps: int) -> tuple[list[Option], int]:
    """Every configuration the catalog and profile allow, and how many spot ones can never finish.
    Whole machines are rented: a configuration's price counts every machine its workers occupy."""
    if steps < 1:
        raise PlanningError(f"the number of training steps must be positive, got {steps}.")
    usable = [m for m in catalog.machines if points_for(profile, m)]
    if not usable:
        covered = ", ".join(sorted(profile.gpus))
        raise PlanningError(f"no catalog machine has a GPU the profile covers ({covered}).")
    if catalog.ps_per_hour is None and any(p.ps for p in profile.points):
        raise PlanningError(f"the profile {profile.name} needs parameter servers and the catalog {catalog.source} "
                            "prices none (add a 'parameter_server' entry).")
    options, unfinishable = [], 0
    checkpoint_h = profile.checkpoint_s / SECONDS_PER_HOUR
    for machine in usable:
        startup_h = machine.startup_s / SECONDS_PER_HOUR
        for point in points_for(profile, machine):
            compute_h = steps * point.step_time_s / SECONDS_PER_HOUR
            ps_cost = point.ps * (catalog.ps_per_hour or 0.0)
            nodes = machine.nodes(point.workers)
            hours = startup_h + compute_h
            options.append(Option(machine, "on-demand", point.workers, point.ps, point.step_time_s, hours,
                                  hours * (nodes * machine.on_demand_per_hour + ps_cost), None, 0.0))
            if machine.spot_per_hour is None:
                continue
            spot = spot_hours(compute_h, nodes, machine.revocations_per_hour, startup_h, checkpoint_h)
            if spot is None:
                unfinishable += 1
                continue
            hours, interval_h, revocations = spot
            options.append(Option(machine, "spot", point.workers, point.ps, point.step_time_s, hours,
                                  hours * (nodes * machine.spot_per_hour + ps_cost),
                                  None if interval_h is None else interval_h * SECONDS_PER_HOUR, revocations))
    return options, unfinishable


def pareto_front(options: list[Option]) -> list[Option]:
    """Options no other option beats on both time and cost, fastest first."""
    front: list[Option] = []
    for opt in sorted(options, key=lambda o: (o.hours, o.cost)):
        if not front or opt.cost < front[-1].cost:
            front.append(opt)
    return front


def _money(x: float) -> str:
    return f"${x:,.2f}"


def recommend(options: list[Option], steps: int, deadline_h: float | None,
              budget_usd: float | None) -> Option:
    """The cheapest option meeting the deadline (and budget), or the fastest within the budget."""
    if deadline_h is None and budget_usd is None:
        raise PlanningError("give a deadline in hours or a budget in dollars (or both).")
    for name, value in (("deadline", deadline_h), ("budget", budget_usd)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise PlanningError(f"the {name} must be a positive number, got {value}.")
    feasible = [o for o in options if (deadline_h is None or o.hours <= deadline_h)
                and (budget_usd is None or o.cost <= budget_usd)]
    if feasible:
        if deadline_h is not None:
            return min(feasible, key=lambda o: (o.cost, o.hours))
        return min(feasible, key=lambda o: (o.hours, o.cost))
    fastest = min(options, key=lambda o: (o.hours, o.cost))
    cheapest = min(options, key=lambda o: (o.cost, o.hours))
    wanted = " and ".join(part for part in (
        f"within {deadline_h:g} h" if deadline_h is not None else "",
        f"for at most {_money(budget_usd)}" if budget_usd is not None else "") if part)
    raise PlanningError(
        f"No configuration finishes {steps:,} steps {wanted}: the fastest achievable is "
        f"{fastest.hours:.2f} h ({fastest.describe()}, {_money(fastest.cost)}) and the cheapest is "
        f"{_money(cheapest.cost)} ({cheapest.describe()}, {cheapest.hours:.2f} h).")


def plan_cluster(profile: WorkloadProfile, catalog: Catalog, steps: int, deadline_h: float | None = None,
         budget_usd: float | None = None) -> ClusterPlan:
    """Evaluate every configuration, build the Pareto front and pick the recommendation."""
    options, unfinishable = evaluate_options(profile, catalog, steps)
    best = recommend(options, steps, deadline_h, budget_usd)
    return ClusterPlan(steps, deadline_h, budget_usd, tuple(options), tuple(pareto_front(options)), best,
                unfinishable)


def resize_predictions(profile: WorkloadProfile, option: Option, steps: int, resize_plan: Sequence) -> dict:
    """The job of `steps` steps under a resize plan (`resize.parse_resize_plan`) on `option`'s machine type and
    pricing, under each batch policy (`steps` counted at the profiled global batch, which the plan's first
    world size runs):

    - keep_global: the profiled global batch at every size, so a step takes the profile's time at that size;
    - scale (linear learning-rate rule): each rank keeps the first size's batch, so a step makes k = W / W0 steps
      of progress and takes, approximately, the profile's time at W0 (a rank's compute is unchanged; a ring's
      per-rank communication grows by at most (W - 1) / W over (W0 - 1) / W0, not modelled).

    A restart (the machine's startup) starts each phase, one checkpoint (the profile's) ends it; priced per GPU
    (a node's price over its GPUs)."""
    machine = option.machine
    times = {p.workers: p.step_time_s for p in points_for(profile, machine) if p.ps == option.ps}
    node_price = machine.spot_per_hour if option.pricing == "spot" else machine.on_demand_per_hour
    price = node_price / machine.gpus_per_node
    base = next(r.world for r in resize_plan if r.world)
    kw = {"restart_s": machine.startup_s, "checkpoint_s": profile.checkpoint_s}
    keep = predict_resizes(BatchPolicy.keep_global(base), steps, times, resize_plan, price, **kw)
    if base not in times:  # keep_global has said which size has no step time
        return {"keep_global": keep}
    scaled = {r.world: times[base] for r in resize_plan if r.world}
    scale = predict_resizes(BatchPolicy.scale(base, base, "linear"), steps, scaled, resize_plan, price, **kw)
    return {"keep_global": keep, "scale (linear lr)": scale}
