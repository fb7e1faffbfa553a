"""tune.choose, the one answer to schedule="auto": this process's earlier answer, else the tuner's cached choice where
it may run, else the caller's fallback (a Measure is measured once and kept for the next run)."""

from __future__ import annotations

import pytest

from cocoweave import tune
from cocoweave.ir.loader import load_example
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.tune import Context, Measure, TuneCache, cache_key, choose


@pytest.fixture
def cache(tmp_path, monkeypatch) -> TuneCache:
    monkeypatch.setenv("COCOWEAVE_TUNE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setattr(tune, "_CHOSEN", {})
    return TuneCache()


def _program(n: int = 64):
    return load_example("adam.py:adam", N=n)


def _tuned(cache: TuneCache, program, world_size: int, index: int):
    chosen = enumerate_schedules(program)[index]
    key = cache_key(program, {}, world_size, "torch", "cpu")
    cache.put(key, {"schedule": chosen.name, "steps": chosen.steps_json()})
    return chosen


def test_the_tuned_choice_comes_first_where_it_may_run_else_the_fallback(cache):
    program = _program()
    every = enumerate_schedules(program)
    tuned, fallback = _tuned(cache, program, 2, 1), every[2]
    assert choose(program, Context(2, "cpu"), lambda: fallback).name == tuned.name
    assert choose(program, Context(2, "cpu", allowed={fallback.name}), lambda: fallback) is fallback
    assert choose(program, Context(2, "cpu", tuned=False), lambda: fallback) is fallback
    assert choose(program, Context(4, "cpu"), lambda: fallback) is fallback  # nothing tuned for 4 ranks


def test_a_kept_answer_is_given_again_without_asking_the_cache_or_the_fallback(cache):
    program = _program()
    first = enumerate_schedules(program)[3]
    asked = []
    context = Context(2, "cpu", keep=("schedule", True))
    assert choose(program, context, lambda: asked.append(1) or first).name == first.name
    _tuned(cache, program, 2, 1)  # tuned since: this process keeps its answer
    again = _program()  # the same program, another object: its own schedule comes back
    got = choose(again, context, lambda: asked.append(2) or first)
    assert asked == [1] and got.name == first.name and got.program is again
    assert choose(again, Context(2, "cpu", keep="other place"), lambda: first).name != first.name  # tuned one


def test_a_measured_answer_is_kept_for_the_next_run_when_every_rank_kept_it(cache):
    program = _program()
    measured: list[int] = []

    def measure(agree=lambda index: index if index >= 0 else None) -> Measure[str]:
        return Measure("nn-route|test", ["a", "b", "c"], ["a", "b", "c"], lambda: measured.append(1) or 2, agree)

    context = Context(2, "cpu", tuned=False, keep="route")
    assert choose(program, context, measure) == "c" and measured == [1]
    assert cache.get("nn-route|test")["schedule"] == "c"
    tune._CHOSEN.clear()  # a new process: the cache remembers, nothing is measured
    assert choose(program, context, measure) == "c" and measured == [1]
    tune._CHOSEN.clear()  # the ranks remember different answers: measured again, together
    assert choose(program, context, lambda: measure(lambda index: None)) == "c" and measured == [1, 1]
