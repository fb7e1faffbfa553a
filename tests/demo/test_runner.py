"""The demo's timing loop: a fresh dropout mask every step, the all-gathers of state kept sliced timed with the
step, and a headline that never is a schedule keeping the weights sliced."""

from __future__ import annotations

import math

import torch

from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.executable import Executable
from cocoweave.demo.runner import FIRST_SEED, WORKLOADS, Row, WorkloadResult, timed_run
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.workloads import adam, layer


def _executable(program, name: str) -> Executable:
    schedule = next(s for s in enumerate_schedules(program) if s.name == name)
    return Executable(lower(schedule), 0, 1, {}, "cpu")


def test_every_step_draws_a_fresh_mask_and_computes_the_program_with_its_seed():
    program = layer(2, 4, 8, dtype="float32")
    exe = _executable(program, "MM-AR-C")
    inputs = make_inputs(program, 1, {}, seed=0)[0]
    run, seen = exe.run, []
    exe.run = lambda given, **kw: seen.append((given["seed"], run(given, **kw).outputs["out"].clone()))
    times = timed_run(exe, dict(inputs), [], iters=3, warmup=1)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert [seed for seed, _ in seen] == [FIRST_SEED + 1 + i for i in range(5)]  # warm-up, timed, traced
    outs = [out for _, out in seen]
    assert all(not torch.equal(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])
    for seed, out in seen:
        expected = reference.run(program, [dict(inputs, seed=seed)], {})[0].outputs["out"]
        torch.testing.assert_close(out, expected)
    assert exe.ctx.events  # the last step was traced


def test_the_demo_times_only_programs_whose_dropout_seed_changes_at_run_time():
    for wl in WORKLOADS.values():
        program = wl.program(wl.quick_sizes, "cpu")
        assert all(v.attrs["seed"] is None for v in program.values if v.op == "dropout")
    assert any(v.op == "dropout" for v in WORKLOADS["model_parallel"].program({"B": 1, "S": 2, "H": 4}, "cpu").values)


def test_state_kept_sliced_that_the_next_step_reads_whole_is_gathered_in_every_step():
    program = adam(64)
    exe = _executable(program, "RS-C+slice(m,v,w)")
    gathered = []
    exe.gather_state = gathered.append
    timed_run(exe, make_inputs(program, 1, {}, seed=0)[0], ["w"], iters=2, warmup=1)
    assert gathered == ["w"] * 4


def test_the_headline_is_the_fastest_checked_schedule_that_keeps_the_weights_whole():
    def row(name: str, ms: float, gathers=(), ok: bool = True) -> Row:
        return Row(name, [], list(gathers), ms=ms, reference_ok=True, torch_ok=ok)

    w = WorkloadResult("adam", "Adam", {"N": 8}, {"N": 8}, "float32", rows=[
        row("AR-c", 9.0), row("RS-C+slice(m,v,w)", 1.0, ["w"]), row("wrong", 0.5, ok=False), row("AR@shm-C", 3.0),
        row("not timed", math.nan)])
    assert w.fastest.schedule == "AR@shm-C"
    w.rows = [row("RS-C+slice(m,v,w)", 1.0, ["w"])]
    assert w.fastest is None
