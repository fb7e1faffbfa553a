"""The tuner's choice on fake cost tables and fake timers: it measures the k best predicted schedules
and the baseline, chooses the fastest measured, is never slower than the baseline, and caches it."""

from __future__ import annotations

import pytest

from cocoweave.ir.loader import load_example
from cocoweave.perf.measure import Measurement
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.tune import TuneCache, cache_key, cached_schedule, tune

PROGRAM = load_example("adam.py:adam", N=256)
SCHEDULES = enumerate_schedules(PROGRAM)
BASE = SCHEDULES[0].name  # the program as written


class FakeTimer:
    """Measures from a table of 'true' times and remembers what it was asked to measure."""

    def __init__(self, table: dict[str, float]):
        self.table, self.asked = table, []

    def __call__(self, schedules):
        self.asked += [s.name for s in schedules]
        return [Measurement(s, 4, self.table[s.name], [self.table[s.name]]) for s in schedules]


def _table(fast: dict[str, float], default: float = 10.0) -> dict[str, float]:
    return {s.name: fast.get(s.name, default) for s in SCHEDULES}


def test_measures_the_k_best_predicted_and_the_baseline_and_picks_the_fastest_measured():
    names = [s.name for s in SCHEDULES]
    ranked = [9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 8.5, 8.7] + [9.5 + i for i in range(len(names))]
    predicted = dict(zip(names, ranked[:len(names)], strict=False))
    truth = _table({names[1]: 6.0, names[2]: 4.0, names[3]: 5.0, BASE: 8.0}, default=1.0)  # the 4th is best
    timer = FakeTimer(truth)
    result = tune(PROGRAM, {}, 4, measure=timer, predict=lambda s: predicted[s.name], k=3)
    assert sorted(timer.asked) == sorted([names[1], names[2], names[3], BASE])
    assert result.choice.name == names[2] and result.choice.measured_ms == 4.0
    assert result.speedup == pytest.approx(2.0)
    assert [c.predicted_ms for c in result.candidates] == sorted(predicted.values())


def test_a_misleading_model_never_makes_the_choice_slower_than_the_baseline():
    predicted = {s.name: (100.0 if s.name == BASE else 1.0) for s in SCHEDULES}
    result = tune(PROGRAM, {}, 4, measure=FakeTimer(_table({BASE: 3.0}, default=7.0)),
                  predict=lambda s: predicted[s.name], k=2)
    assert result.choice.name == BASE and result.speedup == 1.0


def test_without_a_cost_model_every_schedule_is_measured_and_a_tie_keeps_the_baseline():
    timer = FakeTimer(_table({}, default=5.0))
    result = tune(PROGRAM, {}, 4, measure=timer)
    assert sorted(timer.asked) == sorted(s.name for s in SCHEDULES)
    assert result.choice.name == BASE and "every schedule was measured" in result.notes[0]


def test_the_choice_is_cached_and_replays_to_the_same_schedule(tmp_path):
    cache = TuneCache(tmp_path / "cache.json")
    best = SCHEDULES[-1].name
    result = tune(PROGRAM, {}, 4, measure=FakeTimer(_table({best: 1.0})), cache=cache)
    entry = cache.get(cache_key(PROGRAM, {}, 4, "torch", "cpu"))
    assert entry["schedule"] == best and entry["baseline_ms"] == 10.0 and entry["measured_ms"] == 1.0
    replayed = cached_schedule(load_example("adam.py:adam", N=256), {}, 4, "torch", "cuda:0", cache)
    assert replayed is None  # another device is another problem
    replayed = cached_schedule(load_example("adam.py:adam", N=256), {}, 4, "torch", "cpu", cache)
    assert replayed.fingerprint() == result.choice.schedule.fingerprint()
    assert cached_schedule(load_example("adam.py:adam", N=512), {}, 4, "torch", "cpu", cache) is None


def test_the_program_as_written_is_measured_even_when_the_given_schedules_leave_it_out():
    others = [s for s in SCHEDULES if s.steps]
    timer = FakeTimer(_table({BASE: 2.0}, default=5.0))
    result = tune(PROGRAM, {}, 4, measure=timer, predict=lambda s: 1.0, k=1, schedules=others)
    assert BASE in timer.asked and result.baseline.name == BASE
    assert result.choice.name == BASE and result.speedup == 1.0  # every given schedule measured slower


def test_a_schedule_that_failed_to_measure_is_never_chosen():
    nan = float("nan")
    result = tune(PROGRAM, {}, 4, measure=FakeTimer(_table({SCHEDULES[1].name: nan, SCHEDULES[2].name: 1.0})))
    assert result.choice.name == SCHEDULES[2].name
    result = tune(PROGRAM, {}, 4, measure=FakeTimer(_table({BASE: nan}, default=1.0)))
    assert result.choice.name == BASE and "stays the choice" in result.notes[0]  # nothing is shown to be faster


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_never_slower_than_the_program_as_written_whatever_the_model_says(seed):
    import random

    rnd = random.Random(seed)
    truth = {s.name: rnd.uniform(1.0, 10.0) for s in SCHEDULES}
    predicted = {s.name: rnd.uniform(1.0, 10.0) for s in SCHEDULES}
    result = tune(PROGRAM, {}, 4, measure=FakeTimer(truth), predict=lambda s: predicted[s.name], k=rnd.randint(1, 4))
    assert result.choice.measured_ms <= truth[BASE]
    assert result.choice.measured_ms == min(c.measured_ms for c in result.measured())


def test_a_cached_choice_that_measured_slower_than_the_program_as_written_is_not_used(tmp_path):
    cache = TuneCache(tmp_path / "cache.json")
    chosen = SCHEDULES[-1]
    cache.put(cache_key(PROGRAM, {}, 4, "torch", "cpu"), {"schedule": chosen.name, "steps": chosen.steps_json(),
                                                          "measured_ms": 9.0, "baseline_ms": 3.0})
    with pytest.warns(UserWarning, match="measured 9.0 ms against 3.0 ms for the program as written"):
        assert cached_schedule(PROGRAM, {}, 4, "torch", "cpu", cache) is None
    cache.put(cache_key(PROGRAM, {}, 4, "torch", "cpu"), {"schedule": chosen.name, "steps": chosen.steps_json(),
                                                          "measured_ms": 2.0, "baseline_ms": 3.0})
    assert cached_schedule(PROGRAM, {}, 4, "torch", "cpu", cache).fingerprint() == chosen.fingerprint()
