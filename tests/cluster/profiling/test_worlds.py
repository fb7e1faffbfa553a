"""Profiling a torchrun script on local worlds: a real 2-rank DDP run is recorded step by step and ended
after warmup + steps; a world's step is the slowest rank's median step; failures are one sentence."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cocoweave.cluster.profiling.worlds import (
    ProfileError,
    default_script_args,
    merge_rounds,
    profile_worlds,
    run_world,
    summarise,
)

DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(sys.argv[1])):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
open(sys.argv[2], "w").write("the loop ended")  # must not run: profiling ends the script first
dist.destroy_process_group()
"""


def write_rank(folder, rank, walls, collectives=None):
    lines = [{"type": "header", "optimizer": "torch.optim.sgd.SGD", "param_bytes": 100, "state_bytes": 0,
              "threads": 1, "load_avg": [0.1, 0.1, 0.1]}]
    for i, wall in enumerate(walls):
        lines.append({"type": "step", "step": i, "timed": i >= 1, "wall_ms": wall, "data_ms": 0.0,
                      "forward_ms": wall / 2, "backward_ms": wall / 4, "update_ms": wall / 4, "cpu_main_ms": wall / 2,
                      "cpu_other_ms": 1.0, "collectives": collectives or {}, "optimizer_phases_ms": None})
    lines.append({"type": "counts"})
    (folder / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_a_world_is_the_slowest_ranks_median_step(tmp_path):
    """Not the median of the per-step maxima (30 here): that keeps whichever rank's step boundary fell late."""
    write_rank(tmp_path, 0, [99, 10, 30, 10], {"all_reduce/p2": [1, 400, 2.0]})
    write_rank(tmp_path, 1, [99, 20, 10, 40], {"all_reduce/p2": [1, 400, 2.0]})
    run = summarise(2, tmp_path, 1.0)
    assert run.steps_ms == [20, 30, 40] and run.step_ms == 20  # step 0 is warm-up; rank 1's median
    per_rank_and_step = {"count": 1.0, "bytes": 400.0, "ms": 2.0}
    assert run.collectives["all_reduce/p2"] == pytest.approx(per_rank_and_step)
    assert run.per_rank_step_ms == [10, 20]


def test_missing_records_are_one_sentence(tmp_path):
    write_rank(tmp_path, 0, [10, 10])
    with pytest.raises(ProfileError, match="wrote no step records for rank1.jsonl"):
        summarise(2, tmp_path, 1.0)
    write_rank(tmp_path, 1, [10])
    with pytest.raises(ProfileError, match="ended before any timed step"):
        summarise(2, tmp_path, 1.0)


def test_a_ddp_script_on_two_ranks_is_recorded_and_ended_after_its_steps(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    marker = tmp_path / "after-the-loop"
    run = run_world(script, ["100", str(marker)], 2, steps=3, warmup=2, threads=1, timeout_s=240)
    assert run.world_size == 2 and len(run.steps_ms) == 3 and run.step_ms > 0
    grads = 4 * (32 * 32 + 32 + 32 * 4 + 4)
    assert run.collectives["all_reduce/ddp/p2"]["bytes"] == grads  # DDP's gradient all-reduce, once a step
    forward = 2 * 8 * 32 * (32 + 4)  # two matmuls on a batch of 8
    assert run.counts["forward_backward"]["flops"] == 3 * forward - 2 * 8 * 32 * 32  # no input gradient for layer 1
    assert run.optimizer == "torch.optim.sgd.SGD" and run.param_bytes == grads
    assert not marker.exists()  # the script ended after warmup + steps


def test_failures_name_the_cause(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('the data folder is empty')\n")
    with pytest.raises(ProfileError, match="failed on 1 rank .*the data folder is empty"):
        run_world(bad, [], 1, steps=1, warmup=2, threads=1, timeout_s=120)
    idle = tmp_path / "idle.py"
    idle.write_text("print('no optimizer here')\n")
    with pytest.raises(ProfileError, match="never finished an optimizer step: does the script step a torch.optim"):
        run_world(idle, [], 1, steps=1, warmup=2, threads=1, timeout_s=120)
    with pytest.raises(ProfileError, match="does not exist"):
        profile_worlds(tmp_path / "missing.py", [], [1, 2])


def test_the_root_cause_is_the_rank_that_raised_not_a_rank_that_logged_an_error_word(tmp_path):
    script = tmp_path / "half.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    print('UserWarning: an Error-looking line', file=sys.stderr, flush=True)\n"
                      "    time.sleep(60)\n"
                      "raise ValueError('rank 1 lost its shard')\n")
    with pytest.raises(ProfileError, match=r"failed on 2 ranks \(exit code 1\): rank 1: ValueError: rank 1 lost its "
                                           r"shard$"):
        run_world(script, [], 2, steps=1, warmup=2, threads=1, timeout_s=120)


def test_a_script_can_name_its_profiling_arguments(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("# cocoweave profile: --batch 24 --name 'two words'\nprint('hi')\n")
    assert default_script_args(script) == ["--batch", "24", "--name", "two words"]
    script.write_text("print('no line')\n")
    assert default_script_args(script) == []


def test_rounds_of_one_world_merge_into_one(make_run):
    a = make_run(2, 10.0, 8.0, 1.0, 1e9, {"all_reduce": (1.0, 400.0)})
    b = make_run(2, 30.0, 10.0, 3.0, 1e9, {"all_reduce": (1.0, 400.0)})
    a.steps_ms, b.steps_ms = [9.0, 10.0, 11.0], [29.0, 30.0, 31.0, 32.0]
    a.per_rank_step_ms, b.per_rank_step_ms = [9.0, 10.0], [30.0, 31.0]
    a.other_load, b.other_load = 0.1, 0.3
    merged = merge_rounds([a, b])
    assert merged.steps_ms == [9.0, 10.0, 11.0, 29.0, 30.0, 31.0, 32.0]
    assert merged.per_rank_step_ms == [19.5, 20.5] and merged.step_ms == 20.5  # the slowest rank over the rounds
    c = dataclasses.replace(a, per_rank_step_ms=[11.0, 10.5])
    assert merge_rounds([a, b, c]).step_ms == 11.0  # rank 0: median of 9, 30, 11; the slow round (b) drops out
    assert merged.cpu_ms == {"cpu_main_ms": 9.0, "cpu_other_ms": 2.0} and merged.other_load == pytest.approx(0.2)
    assert merged.collectives["all_reduce/p2"]["bytes"] == 400.0 and merge_rounds([a]) is a
