"""The time and cost of a job under a resize plan, for each batch policy (the planner's question for elastic
jobs): restarts, checkpoints, the steps a revocation loses, and the progress a step makes under the policy
(`cocoweave.elastic.BatchPolicy`, the runtime's). `cocoweave plan --resizes` applies it to a planned job.

    predict_resizes(policy, base_steps, step_time_s, parse_resize_plan("8:2,4:1.5,8"), price_per_rank_hour)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cocoweave.errors import ElasticError

if TYPE_CHECKING:  # the model reads a policy's batch arithmetic; the runtime (torch, the sampler) stays out
    from cocoweave.elastic import BatchPolicy

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Resize:
    """One phase of a resize plan: `world` ranks (0: none, the job waits) for `hours` (None: until the end)."""

    world: int
    hours: float | None = None


def parse_resize_plan(text: str) -> list[Resize]:
    """'8:2,4:1.5,0:0.5,8' -> 8 ranks for 2 hours, 4 for 1.5, none for 0.5, then 8 until the job ends."""
    phases = []
    items = [s.strip() for s in text.split(",")]
    for i, item in enumerate(items):
        world, colon, hours = item.partition(":")
        try:
            phase = Resize(int(world), float(hours) if colon else None)
        except ValueError:
            raise ElasticError(f"resize plan item {item!r} must look like RANKS:HOURS, e.g. 8:2,4:1.5,8") \
                from None
        if phase.world < 0 or (phase.hours is not None and not (0 < phase.hours < math.inf)):
            raise ElasticError(f"resize plan item {item!r} needs a rank count of at least 0 and a positive, "
                               "finite number of hours")
        if phase.hours is None and i != len(items) - 1:
            raise ElasticError(f"only the last item of a resize plan may leave out its hours, not {item!r}")
        phases.append(phase)
    return phases


def parse_schedule(text: str) -> list[Resize]:
    """Deprecated name of `parse_resize_plan` (a "schedule" in cocoweave is a CoCoNet Schedule); kept for one
    release."""
    warnings.warn("parse_schedule is renamed parse_resize_plan; the old name goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return parse_resize_plan(text)


@dataclass(frozen=True)
class PhaseCost:
    """What the job does in one phase: steps run, steps kept (those after the phase's last checkpoint are lost
    at a resize), base-batch steps of progress, hours and dollars."""

    world: int
    hours: float
    steps: int
    kept: int
    progress: float
    cost: float


@dataclass(frozen=True)
class ElasticPrediction:
    """The predicted run of a job under a resize plan and a batch policy."""

    policy: str
    finished: bool
    hours: float
    cost: float
    progress: float  # base-batch steps done (the job needs `base_steps`)
    phases: tuple[PhaseCost, ...]

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def lost_steps(self) -> int:
        return sum(p.steps - p.kept for p in self.phases)


def progress_per_step(policy: BatchPolicy, world: int, noise_scale: float | None = None) -> float:
    """Base-batch steps of progress one optimizer step makes at `world` ranks: 1 under keep_global; under scale
    k = B / B0 for linear and sqrt (they train on the same number of samples: Goyal et al.'s recipe keeps the
    epochs), and AdaScale's expected gain (1 + n / B0) / (1 + n / B) for a gradient noise scale n (samples;
    `AdaScale.noise_scale` of a measured run), which it counts towards its scale-invariant iterations."""
    if policy.mode == "keep_global":
        return 1.0
    batch = policy.batch_at(world)
    if policy.lr_rule != "adascale":
        return batch / policy.global_batch
    if noise_scale is None or not (0 <= noise_scale < math.inf):
        raise ElasticError("predicting AdaScale needs the gradient noise scale (a finite number of samples, at "
                           f"least 0; AdaScale.noise_scale of a measured run), got {noise_scale!r}")
    return (1 + noise_scale / policy.global_batch) / (1 + noise_scale / batch)


def _run_phase(needed: int, step_s: float, budget_s: float | None, restart_s: float, every: int | None,
               checkpoint_s: float) -> tuple[float, int, int, bool]:
    """(seconds, steps run, steps kept, finished) of a phase that has `budget_s` seconds (None: no limit) to run
    the `needed` steps left; periodic checkpoints every `every` steps, else one before the phase ends."""

    def elapsed(steps: int) -> float:
        return restart_s + steps * step_s + (steps // every * checkpoint_s if every else 0.0)

    if budget_s is None or elapsed(needed) <= budget_s:
        return elapsed(needed), needed, needed, True
    room = budget_s - (0.0 if every else checkpoint_s)  # a drained resize checkpoints before its end
    steps = max(0, int((room - restart_s) // step_s))
    while steps > 0 and elapsed(steps) > room:  # the periodic checkpoints' time
        steps -= 1
    return budget_s, steps, steps // every * every if every else steps, False


def predict_resizes(policy: BatchPolicy, base_steps: int, step_time_s: Mapping[int, float],
                    resize_plan: Sequence[Resize], price_per_rank_hour: float, *, restart_s: float = 60.0,
                    checkpoint_every: int | None = None, checkpoint_s: float = 0.0,
                    noise_scale: float | None = None) -> ElasticPrediction:
    """Time and cost of a job of `base_steps` optimizer steps at the base global batch, run under `policy` through
    `resize_plan`, from its step time at each world size (`step_time_s[world]`, seconds: measured or predicted for the
    per-rank batch the policy gives there).

    Every phase with ranks starts with `restart_s` (start, rendezvous, load the checkpoint). With
    `checkpoint_every` steps, each checkpoint costs `checkpoint_s` and a resize loses the steps after the last one
    (a revocation); without, the job checkpoints once (`checkpoint_s`) when a phase ends and loses nothing (a
    drained resize). Ranks are paid from their phase's start until it ends or the job does; a phase of 0 ranks
    waits for free. Unfinished when the plan ends first."""
    counts = {"the job's base steps": base_steps}
    if checkpoint_every is not None:
        counts["the checkpoint interval"] = checkpoint_every
    for name, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ElasticError(f"{name} must be an integer of at least 1, got {count!r}")
    for name, value in (("restart_s", restart_s), ("checkpoint_s", checkpoint_s),
                        ("price_per_rank_hour", price_per_rank_hour)):
        if not (0 <= value < math.inf):
            raise ElasticError(f"{name} must be a finite number of at least 0, got {value!r}")
    if not resize_plan:
        raise ElasticError("the resize plan is empty")
    for n, phase in enumerate(resize_plan):
        if phase.hours is None and n != len(resize_plan) - 1:
            raise ElasticError(f"only the last phase of a resize plan may be open-ended, not phase {n + 1}")
        t = step_time_s.get(phase.world)
        if phase.world and (t is None or not (0 < t < math.inf)):
            raise ElasticError(f"no positive step time for {phase.world} ranks (step times are known for "
                               f"{', '.join(map(str, sorted(step_time_s))) or 'no world size'})")
        progress_per_step(policy, phase.world or 1, noise_scale)  # AdaScale without a noise scale
    done, hours, cost, phases = 0.0, 0.0, 0.0, []
    for phase in resize_plan:
        if phase.world == 0:
            if phase.hours is None:
                break  # no ranks until the end: the job never finishes
            hours += phase.hours
            phases.append(PhaseCost(0, phase.hours, 0, 0, 0.0, 0.0))
            continue
        t = step_time_s[phase.world]
        per_step = progress_per_step(policy, phase.world, noise_scale)
        needed = math.ceil((base_steps - done) / per_step - 1e-9)
        budget = None if phase.hours is None else phase.hours * SECONDS_PER_HOUR
        seconds, steps, kept, finished = _run_phase(needed, t, budget, restart_s, checkpoint_every, checkpoint_s)
        spent = seconds / SECONDS_PER_HOUR
        done = min(float(base_steps), done + kept * per_step)
        hours += spent
        cost += spent * phase.world * price_per_rank_hour
        phases.append(PhaseCost(phase.world, spent, steps, kept, kept * per_step, spent * phase.world *
                                price_per_rank_hour))
        if finished:
            return ElasticPrediction(policy.describe(), True, hours, cost, float(base_steps), tuple(phases))
    return ElasticPrediction(policy.describe(), False, hours, cost, done, tuple(phases))
