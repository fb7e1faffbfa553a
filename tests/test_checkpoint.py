"""Checkpoints (cocoweave.checkpoint): sharded save/load through torch.distributed.checkpoint, atomic
against crashes, and resharding of sliced state across world sizes (4 ranks, then 2, then 3) with
results identical to an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cocoweave import checkpoint as ck
from cocoweave import faults
from cocoweave.errors import CheckpointError
from cocoweave.ir.layout import split_sizes
from cocoweave.loader import load_example
from cocoweave.schedule.schedule import Schedule

N = 10  # uneven on 3 and 4 ranks
SCALARS = {"lr": 0.05, "beta1": 0.9, "beta2": 0.99, "eps": 1e-3}


def sliced_adam(shares: tuple[int, ...] | None = None) -> Schedule:
    """Adam with m and v kept sliced (1/p of them on each rank, or in proportion to `shares`): RS, c, AG."""
    s = Schedule(load_example("adam.py:adam", N=N))
    _, ag = s.split(s.find("all_reduce")[0], shares=shares)
    s.reorder(ag)
    s.as_slice("m", "v")
    return s


def grad(step: int) -> torch.Tensor:
    """The same gradient on every rank, in quarters: averaging it over any number of ranks is exact."""
    return (((torch.arange(N) * (step + 3)) % 7) - 3).float() / 4


def train(rank: int, world_size: int, schedule: Schedule, first: int, steps: int, resume: str | None,
          save_to: str | None) -> dict[str, torch.Tensor]:
    """Steps first..first+steps-1 of sliced Adam on this rank, from a checkpoint or from scratch; then
    save one. Returns w and the gathered m, v."""
    from cocoweave.backends.torch import Executable
    from cocoweave.plan import lower

    exe = Executable(lower(schedule), rank, world_size, {}, "cpu")
    w = torch.linspace(-1, 1, N)
    given: dict[str, torch.Tensor] = {}
    if resume is None:
        given = {"m": torch.zeros(N), "v": torch.zeros(N)}
    else:
        loaded = ck.load(resume, {"w": w, "step": -1, "exe": ck.executable_state(exe)})
        assert loaded["step"] == first
    for k in range(first, first + steps):
        exe.run({"g": grad(k), "w": w, **given, **SCALARS, "step": float(k)})
        given = {}
    if save_to is not None:
        ck.save(save_to, {"w": w, "step": first + steps, "exe": ck.executable_state(exe)}, step=first + steps)
    return {"w": w, "m": exe.gather_state("m"), "v": exe.gather_state("v")}


def test_sliced_state_reshards_4_then_2_then_3_ranks_like_an_uninterrupted_run(local_world, tmp_path):
    s = sliced_adam()
    a, b, c = (str(tmp_path / f"step-{k}") for k in (2, 4, 6))
    local_world(4).run(train, s, 1, 2, None, a)
    local_world(2).run(train, s, 3, 2, a, b)
    resumed = local_world(3).run(train, s, 5, 2, b, c)
    whole = local_world(4).run(train, s, 1, 6, None, None)
    for name in ("w", "m", "v"):
        assert all(torch.equal(r[name], whole[0][name]) for r in resumed), name
    assert ck.info(c)["world_size"] == 3 and ck.info(c)["step"] == 7
    assert not torch.equal(whole[0]["m"], torch.zeros(N))


def test_uneven_sliced_state_reshards_to_other_shares_and_world_sizes(local_world, tmp_path):
    a, b = str(tmp_path / "step-2"), str(tmp_path / "step-4")
    local_world(2).run(train, sliced_adam((3, 1)), 1, 2, None, a)  # rank 0 keeps 8 of 10 elements
    local_world(3).run(train, sliced_adam((1, 2, 2)), 3, 2, a, b)
    resumed = local_world(2).run(train, sliced_adam(), 5, 1, b, None)
    whole = local_world(2).run(train, sliced_adam(), 1, 5, None, None)
    for name in ("w", "m", "v"):
        assert all(torch.equal(r[name], whole[0][name]) for r in resumed), name


def test_an_uneven_shard_saved_whole_loads_into_any_shares(tmp_path):
    whole = torch.arange(3 * N, dtype=torch.float64).reshape(3, N)
    ck.save(tmp_path / "c", {"x": ck.Shard(whole.clone(), 1, N, 0, 1)})
    for shares in ((3, 1), (1, 2, 1), (5, 1, 1, 3)):
        parts = [torch.zeros(p.shape, dtype=p.dtype) for p in torch.split(whole, split_sizes(N, shares), 1)]
        for i, part in enumerate(parts):
            ck.load(tmp_path / "c", {"x": ck.Shard(part, 1, N, i, len(shares), shares)})
        assert torch.equal(torch.cat(parts, 1), whole), shares
    with pytest.raises(CheckpointError, match="needs 2 positive int shares"):
        ck.Shard(torch.zeros(3, 2), 1, N, 1, 2, (3,))


def test_nested_state_with_a_fresh_torch_optimizer_round_trips(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ck.save(ck.step_path(tmp_path, 3), {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}, step=3)

    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)  # no step yet: its state dict has no state
    path = ck.latest(tmp_path)
    assert path == ck.step_path(tmp_path, 3)
    out = ck.load(path, {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0})
    opt2.load_state_dict(out["optim"])
    assert out["step"] == 3 and opt2.param_groups[0]["lr"] == 0.1
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state[model2.weight]["exp_avg_sq"], opt.state[model.weight]["exp_avg_sq"])


def test_a_shard_saved_by_one_rank_loads_into_any_split(tmp_path):
    whole = torch.arange(2 * N, dtype=torch.float64).reshape(2, N)
    ck.save(tmp_path / "c", {"x": ck.Shard(whole.clone(), 1, N, 0, 1)})
    for count in (2, 3, 4, 7):
        parts = [torch.zeros(p.shape, dtype=p.dtype) for p in torch.tensor_split(whole, count, 1)]
        for i, part in enumerate(parts):
            ck.load(tmp_path / "c", {"x": ck.Shard(part, 1, N, i, count)})
        assert torch.equal(torch.cat(parts, 1), whole), count


@pytest.mark.parametrize("stage", [0, 1])
def test_a_crash_during_a_save_never_leaves_a_checkpoint_that_loads(tmp_path, stage):
    root = tmp_path / "ckpt"
    ck.save(ck.step_path(root, 1), {"w": torch.ones(4), "step": 1}, step=1)
    faults.configure(f"stage={stage},label=checkpoint,action=raise")  # before the writes / before the marker
    try:
        with pytest.raises(faults.InjectedFault):
            ck.save(ck.step_path(root, 2), {"w": torch.full((4,), 2.0), "step": 2}, step=2)
    finally:
        faults.configure(None)
    assert ck.latest(root) == ck.step_path(root, 1)
    with pytest.raises(CheckpointError, match="step-00000002 cannot be loaded: only an interrupted save was found"):
        ck.load(ck.step_path(root, 2), {"w": torch.zeros(4), "step": 0})
    w = torch.zeros(4)
    assert ck.load(ck.latest(root), {"w": w, "step": 0})["step"] == 1 and torch.equal(w, torch.ones(4))
    # the next save of step 2 succeeds and cleans the interrupted one up
    ck.save(ck.step_path(root, 2), {"w": torch.full((4,), 2.0), "step": 2}, step=2)
    assert ck.latest(root) == ck.step_path(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]


def test_incomplete_or_mismatched_checkpoints_are_refused(tmp_path):
    ck.save(tmp_path / "c", {"w": torch.ones(4), "x": ck.Shard(torch.ones(3), 0, 3, 0, 1)})
    with pytest.raises(CheckpointError, match=r"tensor `w` has shape \[4\] there, the state to load into has \[5\]"):
        ck.load(tmp_path / "c", {"w": torch.zeros(5)})
    with pytest.raises(CheckpointError, match="has no entry `q`; it has: w, x"):
        ck.load(tmp_path / "c", {"q": torch.zeros(4)})
    with pytest.raises(CheckpointError, match="was saved split along dim 0 of size 3, not dim 0 of size 4"):
        ck.load(tmp_path / "c", {"x": ck.Shard(torch.zeros(2), 0, 4, 0, 2)})
    with pytest.raises(CheckpointError, match="`x` is sliced there; load it into a checkpoint.Shard"):
        ck.load(tmp_path / "c", {"x": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="needs 2 rows there"):
        ck.Shard(torch.zeros(3), 0, 4, 0, 2)
    (Path(tmp_path / "c") / ck.MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete \(no COMPLETE.json\): its save was interrupted"):
        ck.load(tmp_path / "c", {"w": torch.zeros(4)})
    assert ck.latest(tmp_path) is None
