"""The compiled route, the CPU default for users: every fused computation stage runs as one loop compiled by
torch.compile (Inductor's C++ on CPU). Every schedule of every example (one of those that differ only in a
collective's algorithm), run that way on live Gloo ranks, equals the unscheduled program on the reference backend
(random programs x random schedules: test_torch_properties.py); a stage that cannot be compiled still runs (op by
op) with a warning."""

from __future__ import annotations

import re
import warnings
import weakref

import pytest
import torch

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch import runtime
from cocoweave.backends.torch.executable import Executable
from cocoweave.equivalence.check import check_schedules, torch_runner
from cocoweave.equivalence.compare import compare
from cocoweave.ir.loader import load_example
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule

EXAMPLES = [("adam.py:adam", {"N": 13}), ("lamb.py:lamb", {"N": 13}),
            ("model_parallel.py:layer", {"B": 3, "S": 4, "H": 8}),
            ("pipeline_parallel.py:boundary", {"B": 2, "S": 5, "H": 8})]


def _one_per_compute_shape(schedules: list[Schedule]) -> list[Schedule]:
    """The schedules with distinct compute stages: those differing only in a collective's algorithm (`AR@ring-C`,
    `AR@shm-C`, `AR-C`) compile the same fused loops (their algorithms are checked op by op elsewhere); of the chunk
    counts 2, 4 and 8 of an overlap, 2 and 8 (4's loops are the same code at sizes between theirs)."""
    kept: dict[str, Schedule] = {}
    for schedule in schedules:
        if not re.search(r",4\)", schedule.name):
            kept.setdefault(re.sub(r"@\w+", "", schedule.name), schedule)
    return list(kept.values())


@pytest.mark.parametrize("spec, sizes", EXAMPLES, ids=[e[0].split(".")[0] for e in EXAMPLES])
def test_every_schedule_of_every_example_equals_the_reference_compiled(local_world, spec, sizes):
    program = load_example(spec, **sizes)
    schedules = _one_per_compute_shape(enumerate_schedules(program))
    assert any(s.name.count("C") for s in schedules)  # fused stages are among them
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a stage falling back to op by op fails the test
        rows = check_schedules(program, schedules, 2, {}, seed=2,
                               batch=torch_runner(local_world(2), kernels="compiled"))
    bad = [r for r in rows if not r.ok]
    assert len(rows) == len(schedules) and not bad, bad


def _dropout_program() -> cw.Program:
    p = cw.Program("drop")
    x = p.tensor("x", (6, 40), "float32", cw.Sliced(1))
    r = p.tensor("r", (6, 40), "float32", cw.Sliced(1))
    seed = p.scalar("seed", "int64")
    p.output(cw.dropout(x * 2.0, 0.3, seed=seed) + r, "y")
    return p


def test_a_compiled_stage_draws_the_dropout_mask_of_the_reference_bit_for_bit():
    """Fresh seeds every step, indices computed inside the loop: the mask is the counter-based hash's."""
    program = _dropout_program()
    s = Schedule(program)
    s.fuse(*s.stages)
    exe = Executable(lower(s), 0, 1, {}, "cpu", kernels="compiled")
    for seed in (1, 2, 12345):
        inputs = make_inputs(program, 1, {}, seed=seed, scalars={"seed": seed})
        want = reference.run(program, inputs, {})[0].outputs["y"]
        got = exe.run(dict(inputs[0])).outputs["y"]
        assert torch.equal(got, want), seed
    assert isinstance(exe.ctx.stage(0, lambda: None), runtime.CompiledStage)


def test_a_stage_that_cannot_be_compiled_runs_op_by_op_with_a_warning(monkeypatch):
    program = load_example("adam.py:adam", N=16)
    s = Schedule(program)
    for stage in [x for x in s.stages if x.kind == "compute"]:
        s.fuse(stage)

    def broken(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("no C++ compiler found")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(runtime, "_COMPILED", weakref.WeakValueDictionary())  # nothing compiled by an earlier test
    exe = Executable(lower(s), 0, 1, {}, "cpu", kernels="compiled")
    inputs = make_inputs(program, 1, {}, seed=0)
    want = reference.run(program, inputs, {})[0].state
    with pytest.warns(RuntimeWarning, match="could not be compiled .*no C\\+\\+ compiler found.*op by op"):
        got = exe.run({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs[0].items()}).state
    assert all(compare(got[n], want[n]).ok for n in want)


def test_a_compiled_stage_under_a_dispatch_mode_runs_op_by_op_and_the_mode_sees_its_ops():
    """A FLOP counter (as `cocoweave profile`'s counted step) watching a step: torch.compile refuses to run under a
    dispatch mode, so the stage runs eagerly for that call, counted, with the same results and no warning."""
    from torch.utils.flop_counter import FlopCounterMode

    program = load_example("adam.py:adam", N=64)
    s = Schedule(program)
    for stage in [x for x in s.stages if x.kind == "compute"]:
        s.fuse(stage)
    exe = Executable(lower(s), 0, 1, {}, "cpu", kernels="compiled")
    inputs = make_inputs(program, 1, {}, seed=0)
    want = reference.run(program, inputs, {})[0].state
    ops = []

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Seen(), FlopCounterMode(display=False):
            got = exe.run({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs[0].items()}).state
    assert all(compare(got[n], want[n]).ok for n in want)
    assert torch.ops.aten.sqrt.default in ops  # Adam's update ran op by op where the mode could see it


def test_executables_of_one_stage_and_shape_share_one_compilation():
    """An optimizer's buckets of one size are executables of one plan: the first compiles the fused stage, the others
    run that compilation (the compiler's time and memory paid once); another size compiles its own."""
    compiled = []
    for n in (16, 16, 24):
        program = load_example("adam.py:adam", N=n)
        s = Schedule(program)
        s.fuse(*[x for x in s.stages if x.kind == "compute"])
        exe = Executable(lower(s), 0, 1, {}, "cpu", kernels="compiled")
        exe.run(dict(make_inputs(program, 1, {}, seed=0)[0]))
        compiled += [f.fn for f in exe.ctx._stages.values() if isinstance(f, runtime.CompiledStage)]
    assert len(compiled) == 3 and compiled[0] is compiled[1] is not None
    assert compiled[2] is not compiled[0]
