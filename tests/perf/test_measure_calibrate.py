"""Measuring on live ranks: schedule timings and the calibration microbenchmarks (tiny sizes, 2 ranks)."""

from __future__ import annotations

from cocoweave.ir.loader import load_example
from cocoweave.perf.calibrate import Spec, combine, fit, microbench
from cocoweave.perf.measure import measure_schedules
from cocoweave.schedule.enumerate import enumerate_schedules


def test_measure_schedules_takes_turns_and_reports_every_iteration(local_world):
    world = local_world(2)
    program = load_example("adam.py:adam", N=128)
    schedules = enumerate_schedules(program)[:2]
    seen = []
    ms = measure_schedules(world, schedules, {}, iters=3, warmup=1, rounds=2, progress=lambda s: seen.append(s.name))
    assert seen == [s.name for s in schedules] * 2
    assert [m.name for m in ms] == [s.name for s in schedules]
    for m in ms:
        assert len(m.times_ms) == 3 and m.total_ms > 0 and m.world_size == 2
        assert any(k.endswith(":AR") or ":RS" in k for k in m.stage_ms)


def test_calibration_microbenchmarks_fit_every_term(local_world):
    world = local_world(2)
    spec = Spec(collective_elements=(64, 4096), kernel_elements=(64, 4096), matmul_sizes=(8, 16),
                dtypes=("float32",), iters=2, warmup=1)
    rows = combine(world.run(microbench, spec))
    cal = fit(rows, "torch", "cpu", 2)
    assert {"all_reduce/library", "all_to_all/library", "reduce_scatter/ring", "all_gather/ring",
            "p2p/library"} <= set(cal.collectives)
    assert set(cal.kernels) == {"float32"} and set(cal.matmuls) == {"float32"}
    for line in [*cal.collectives.values(), *cal.kernels.values(), *cal.matmuls.values()]:
        assert line.alpha_ms >= 0 and line.beta_ms_per_mb >= 0 and line(1e6) > 0
