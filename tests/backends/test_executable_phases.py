"""An executable's step in phases, as the drop-in optimizers drive it: the first collective launched ahead of the
step (from a backward hook), the state all-gathers left in flight until `wait` (overlapped with the next forward),
a pause before any stage with a collective's result provided by the caller (one global norm over many buckets).
Every way of running it gives the result of running it through."""

from __future__ import annotations

import torch

import cocoweave as cw
from cocoweave.backends import reference
from cocoweave.backends.inputs import make_inputs
from cocoweave.backends.torch.executable import Executable
from cocoweave.equivalence.compare import compare
from cocoweave.plan import lower
from cocoweave.schedule.schedule import Schedule
from cocoweave.workloads import adamw


def _sliced_adamw(n: int) -> Schedule:
    s = Schedule(adamw(n))
    _, ag = s.split(s.find("all_reduce")[0])
    s.reorder(ag)
    s.as_slice("m", "v")
    for stage in [x for x in s.stages if x.kind == "compute"]:
        s.fuse(stage)
    return s


def _copy(inputs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _phases(rank: int, world_size: int, schedule: Schedule, inputs: list) -> dict:
    """The same step four ways on this rank: through, launched early, deferred gathers, paused at every stage."""
    mine = inputs[rank]
    out = {}
    for how in ("through", "launched", "deferred", "paused"):
        exe = Executable(lower(schedule), rank, world_size, {}, "cpu")
        given = _copy(mine)
        if how == "launched":
            out["launched_early"] = exe.launch({"g": given["g"]})
        if how == "paused":
            steps, seen = exe.steps(given), []
            try:
                while True:
                    index, reads = next(steps)
                    seen.append((index, sorted(reads)))
            except StopIteration as done:
                res = done.value
            out["pauses"] = seen
        else:
            res = exe.run(given, defer_gathers=how == "deferred")
            if how == "deferred":
                out["in_flight"] = len(exe.ctx.deferred)
                exe.wait()
        out[how] = {n: t.clone() for n, t in res.state.items()}
        out[f"{how}_w_in_place"] = res.state["w"].data_ptr() == given["w"].data_ptr()
    return out


def test_launched_deferred_and_paused_steps_equal_the_step_run_through(local_world):
    schedule = _sliced_adamw(37)
    inputs = make_inputs(schedule.original, 2, {}, seed=4)
    want = reference.run(schedule.original, inputs, {}, whole_state=True)
    per_rank = local_world(2).run(_phases, schedule, inputs)
    for r, got in enumerate(per_rank):
        assert got["launched_early"] is True and got["in_flight"] == 1
        assert [i for i, _ in got["pauses"]] == [0, 1, 2]
        assert got["pauses"][0][1] == ["g"]
        for how in ("through", "launched", "deferred", "paused"):
            assert compare(got[how]["w"], want[r].state["w"]).ok, how
            assert got[f"{how}_w_in_place"], how  # the gather wrote the weights in place: no copy at the end


def _provided(rank: int, world_size: int) -> list[float]:
    p = cw.Program("norm")
    g = p.tensor("g", (8,), "float32", cw.Local)
    total = cw.all_reduce(cw.sum(g * g), "sum")
    p.output(cw.sqrt(total), "norm")
    exe = Executable(lower(Schedule(p)), rank, world_size, {}, "cpu")
    given = {"g": torch.full((8,), float(rank + 1))}
    steps = exe.steps(given)
    index, reads = next(steps)
    while not any(v.op == "all_reduce" for v in exe.plan.stages[index].values):
        index, reads = next(steps)
    (name,) = [v.name for v in exe.plan.stages[index].values]
    exe.provide(name, torch.tensor(100.0))  # the caller's result instead of the collective
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return [float(done.value.outputs["norm"]), float(next(iter(reads.values())))]


def test_a_provided_result_replaces_the_collective(local_world):
    per_rank = local_world(2).run(_provided)
    assert per_rank == [[10.0, 8.0], [10.0, 32.0]]  # sqrt(100) on both; each paused with its own partial
