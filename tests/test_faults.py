"""Fault injection (cocoweave.faults): a rank that exits, hangs or raises at a chosen stage of a generated
step makes the whole world fail with an error naming the rank and the stage, within the timeout; ranks
given different schedules are told apart before any collective."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from cocoweave import faults
from cocoweave.errors import BackendError, CocoweaveError
from cocoweave.ir.loader import load_example
from cocoweave.launch import LocalWorld
from cocoweave.schedule.schedule import Schedule

TIMEOUT_S = 4.0  # short: two of these tests wait for it


def adam_schedule(sliced: bool = True) -> Schedule:
    """Adam on N=10 as RS, c, AG (stages 0, 1, 2) with m and v kept sliced, or as the plain program."""
    s = Schedule(load_example("adam.py:adam", N=10))
    if sliced:
        _, ag = s.split(s.find("all_reduce")[0])
        s.reorder(ag)
        s.as_slice("m", "v")
    return s


def run_steps(rank: int, world_size: int, schedule: Schedule, spec: str | None, steps: int = 3) -> int:
    """Arm `spec`, run `steps` steps of `schedule` on this rank; returns the steps run."""
    from cocoweave.backends.inputs import make_inputs
    from cocoweave.backends.torch import Executable
    from cocoweave.plan import lower

    faults.configure(spec)
    try:
        exe = Executable(lower(schedule), rank, world_size, {}, "cpu")  # agrees on the plan first
        inputs = make_inputs(schedule.original, world_size, {}, seed=0)[rank]
        for _ in range(steps):
            exe.run(inputs)
        return steps
    finally:
        faults.configure(None)


def run_rank_schedule(rank: int, world_size: int, schedules: list[Schedule]) -> int:
    """Every rank runs its own schedule: a mismatch must be caught before any collective."""
    return run_steps(rank, world_size, schedules[rank], None, 1)


@pytest.fixture(scope="module")
def world() -> Iterator[LocalWorld]:
    """A world of 2 ranks of this module only: these tests break it (restarted by `fresh`)."""
    w = LocalWorld(2, timeout_s=TIMEOUT_S, threads_per_rank=1)
    yield w
    w.close()


def fresh(world: LocalWorld) -> LocalWorld:
    if world.broken:
        world.restart()
    return world


def test_parse_reads_every_key_and_rejects_malformed_specs():
    f = faults.parse("rank=1, stage=2, action=sleep, seconds=0.5, label=RS, hit=3, once=/tmp/x")
    assert f == faults.Fault("sleep", rank=1, stage=2, label="RS", hit=3, seconds=0.5, once="/tmp/x")
    assert f.matches(1, 2, "RS") and not f.matches(0, 2, "RS") and not f.matches(1, 2, "AG")
    with pytest.raises(CocoweaveError, match="action must be one of exit, kill, sleep, raise, got 'explode'"):
        faults.parse("rank=1,action=explode")
    with pytest.raises(CocoweaveError, match="unknown key 'rnak'"):
        faults.parse("rnak=1,action=exit")
    with pytest.raises(CocoweaveError, match="must look like KEY=VALUE"):
        faults.parse("action=exit,stage")
    with pytest.raises(CocoweaveError, match="invalid literal"):
        faults.parse("action=exit,stage=two")


def test_raise_fault_fires_on_the_chosen_hit_once_per_marker(tmp_path):
    marker = tmp_path / "fired"
    faults.configure(f"rank=0,stage=1,action=raise,hit=2,once={marker}")
    try:
        assert faults.ACTIVE
        faults.enter(0, 1, "c")  # first hit: not yet
        faults.enter(1, 1, "c")  # another rank: never
        with pytest.raises(faults.InjectedFault, match=r"rank 0 at stage 1 \(c\)"):
            faults.enter(0, 1, "c")
        assert faults.current_stage() == (1, "c") and marker.exists()
        faults.configure(f"rank=0,stage=1,action=raise,once={marker}")
        faults.enter(0, 1, "c")  # the marker exists: a restarted run goes on
    finally:
        faults.configure(None)
    assert not faults.ACTIVE


def test_ranks_with_different_schedules_fail_before_any_collective(world):
    schedules = [adam_schedule(sliced=True), adam_schedule(sliced=False)]
    with pytest.raises(BackendError, match=r"ranks disagree on the plan to run \(fingerprint and sizes\): "
                                           r"rank 0 has '[0-9a-f]+ \{\}', rank 1 has '[0-9a-f]+ \{\}'"):
        fresh(world).run(run_rank_schedule, schedules)
    assert not world.broken  # no collective was left half done: the world is still usable


def test_ranks_that_raise_report_the_stage_and_the_world_survives(world):
    with pytest.raises(BackendError, match=r"^rank 0 failed: at stage 0 \(RS\): InjectedFault: injected fault "
                                           r"on rank 0 at stage 0 \(RS\) \(rank 1 failed too\)$"):
        fresh(world).run(run_steps, adam_schedule(), "stage=0,action=raise")
    assert not world.broken  # both ranks raised before the collective: nothing is left half done
    assert world.run(run_steps, adam_schedule(), None, 2) == [2, 2]


def test_rank_that_exits_at_a_stage_is_named_with_its_stage(world):
    with pytest.raises(BackendError) as info:
        fresh(world).run(run_steps, adam_schedule(), "rank=1,stage=1,action=exit,hit=2")
    msg = str(info.value)
    assert msg.startswith("rank 1 exited with code 13 during run of `run_steps`"), msg
    assert "rank 1 at stage 1 (c)" in msg
    assert info.value.ranks == [1] and world.broken


def run_then_die(rank: int, world_size: int, schedule: Schedule) -> int:
    """Run a step of `schedule`, then (past its last stage: a pipeline's send, a data loader) rank 1 dies while rank
    0 waits for it in a barrier."""
    run_steps(rank, world_size, schedule, None, 1)
    if rank == 1:
        os._exit(13)
    dist.barrier()
    return 1


def test_a_rank_that_dies_after_a_step_is_not_named_with_a_stale_stage(world):
    with pytest.raises(BackendError) as info:
        fresh(world).run(run_then_die, adam_schedule())
    msg = str(info.value)
    assert msg.startswith("rank 1 exited with code 13"), msg
    assert "at stage" not in msg, msg  # before: "rank 1 at stage 2 (AG)", the last stage of a step long finished


def test_rank_that_hangs_is_named_within_the_timeout(world):
    with pytest.raises(BackendError) as info:
        fresh(world).run(run_steps, adam_schedule(), "rank=0,stage=1,action=sleep,seconds=60")
    msg = str(info.value)
    # Either the world's timeout or rank 1's Gloo timeout (the same length) reports it first.
    assert "rank 0 at stage 1 (c)" in msg, msg
    assert "did not finish" in msg and world.broken


def test_cli_run_on_the_torch_backend_names_the_failed_rank_and_stage_and_exits_4(monkeypatch):
    from typer.testing import CliRunner

    from cocoweave.cli import app
    from cocoweave.ir.loader import examples_dir

    monkeypatch.setenv(faults.ENV_VAR, "rank=1,stage=1,action=exit")  # read by the spawned ranks
    r = CliRunner().invoke(app, ["run", f"{examples_dir() / 'adam.py'}:adam", "-s", "N=10", "--backend", "torch",
                                 "-n", "2", "--timeout", str(TIMEOUT_S)])
    assert r.exit_code == 4, r.output  # a rank failed: not bad input (2), not a mismatch (1)
    assert "error: rank 1 exited with code 13 during run of" in r.stderr and "(rank 1 at stage 1 (c))" in r.stderr
    assert "Traceback" not in r.output
