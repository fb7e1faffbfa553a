"""Checkpoints (cocoweave.checkpoint): sharded save/load through torch.distributed.checkpoint, atomic
against crashes, and resharding of sliced state across world sizes (4 ranks, then 2, then 3) with
results identical to an uninterrupted run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cocoweave import checkpoint as ck
from cocoweave import faults
from cocoweave.checkpoint import files as ck_files
from cocoweave.errors import CheckpointError
from cocoweave.ir.layout import split_sizes
from cocoweave.ir.loader import load_example
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
    whole = torch.zeros(3)  # a whole tensor takes a sliced one's parts (a tensor-parallel checkpoint at tp 1)
    ck.load(tmp_path / "c", {"x": whole})
    assert torch.equal(whole, torch.ones(3))
    with pytest.raises(CheckpointError, match="was saved split along dim 0 of size 3, not dim 0 of size 4"):
        ck.load(tmp_path / "c", {"x": torch.zeros(4)})
    with pytest.raises(CheckpointError, match="`x` is sliced there; load it into a checkpoint.Shard"):
        ck.load(tmp_path / "c", {"x": torch.zeros(())})
    with pytest.raises(CheckpointError, match="needs 2 rows there"):
        ck.Shard(torch.zeros(3), 0, 4, 0, 2)
    (Path(tmp_path / "c") / ck.MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete \(no COMPLETE.json\): its save was interrupted"):
        ck.load(tmp_path / "c", {"w": torch.zeros(4)})
    assert ck.latest(tmp_path) is None


# -- integrity: a manifest of sizes and sha256, checked before anything is read ------------------------------


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "c"
    ck.save(path, {"w": torch.arange(8.0), "x": ck.Shard(torch.ones(6), 0, 6, 0, 1), "step": 4, "lr": 0.5})
    return path


def _shard_file(path: Path) -> Path:
    return next(f for f in path.iterdir() if f.suffix == ".distcp")


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    (lambda p: _flip(_shard_file(p)), r"file __0_0.distcp does not match its sha256 checksum \(damaged\)"),
    (lambda p: _shard_file(p).write_bytes(_shard_file(p).read_bytes()[:-10]), r"has \d+ bytes, its manifest says"),
    (lambda p: _shard_file(p).write_bytes(b""), r"file __0_0.distcp has 0 bytes"),
    (lambda p: _shard_file(p).unlink(), r"lacks its file __0_0.distcp"),
    (lambda p: (p / ".metadata").unlink(), r"lacks its file .metadata"),
    (lambda p: (p / "__1_0.distcp").write_bytes(b"x"), r"has a file __1_0.distcp that its manifest does not list"),
])
def test_a_damaged_checkpoint_is_refused_before_anything_is_read(tmp_path, damage, words):
    path = _saved(tmp_path)
    damage(path)
    w = torch.full((8,), -1.0)
    with pytest.raises(CheckpointError, match=words):
        ck.load(path, {"w": w, "step": 0})
    assert torch.equal(w, torch.full((8,), -1.0))  # untouched


def _load_counting_hashes(rank: int, world_size: int, path: str) -> tuple[int, str]:
    """Load `path` on every rank; (files this rank hashed, the error it got or its loaded w as text)."""
    hashed = []
    real = ck_files._sha256
    ck_files._sha256 = lambda f: hashed.append(f) or real(f)
    try:
        w = torch.zeros(8)
        ck.load(path, {"w": w})
        return len(hashed), str(w.tolist())
    except CheckpointError as exc:
        return len(hashed), str(exc)
    finally:
        ck_files._sha256 = real


def test_rank_0_alone_hashes_the_files_and_every_rank_gets_its_verdict(local_world, tmp_path):
    path = _saved(tmp_path)
    files = len(ck.info(path)["files"])
    got = local_world(2).run(_load_counting_hashes, str(path))
    assert got == [(files, str(torch.arange(8.0).tolist())), (0, str(torch.arange(8.0).tolist()))]
    _flip(_shard_file(path))
    (h0, e0), (h1, e1) = local_world(2).run(_load_counting_hashes, str(path))
    assert h1 == 0 and 0 < h0 <= files and e0 == e1 and "does not match its sha256 checksum (damaged)" in e1


def test_plain_values_round_trip_as_json_and_state_is_checked(tmp_path):
    values = {"step": 7, "big": 2**70, "lr": float("nan"), "name": "ünï", "none": None, "flag": True,
              "nested": {1: [0.25, "a", (None, False)]}}
    ck.save(tmp_path / "c", {"v": values, "t": torch.ones(2)})
    record = ck.verify(tmp_path / "c")
    assert record["format"] == ck.FORMAT and set(record["files"]) == {".metadata", "__0_0.distcp"}
    out = ck.load(tmp_path / "c", {"v": {}})["v"]
    assert out["lr"] != out["lr"] and {k: v for k, v in out.items() if k != "lr"} == \
        {k: v for k, v in values.items() if k != "lr"}


# -- trust: loading never runs code from a checkpoint unless asked to -----------------------------------------


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('EVIL_MARKER', '/nonexistent/x')}",))


def _rewrite_manifest(path: Path) -> None:
    import json

    record = json.loads((path / ck.MARKER).read_text())
    record["files"] = {f.name: {"size": f.stat().st_size, "sha256": ck_files._sha256(f)}
                       for f in path.iterdir() if f.name != ck.MARKER}
    (path / ck.MARKER).write_text(json.dumps(record))


def test_crafted_metadata_does_not_run_code_on_load(tmp_path, monkeypatch):
    import pickle

    marker = tmp_path / "ran"
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    path = _saved(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    _rewrite_manifest(path)  # an attacker writes a matching manifest too
    with pytest.raises(CheckpointError, match=r"is refused: its DCP metadata refers to `posix.system`, which a safe "
                                              r"load does not allow; load it with trusted=True only if you trust"):
        ck.load(path, {"w": torch.zeros(8)})
    assert not marker.exists()


@dataclass
class Point:
    """A value of a class of the user's: DCP pickles it."""

    x: int


def test_pickled_objects_load_only_when_trusted(tmp_path):
    ck.save(tmp_path / "c", {"p": Point(3), "w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"holds a pickled object at `p`; load it with trusted=True only if"):
        ck.load(tmp_path / "c", {"p": None, "w": torch.zeros(2)})
    assert ck.load(tmp_path / "c", {"p": None}, trusted=True)["p"] == Point(3)


def test_dcp_failures_become_checkpoint_errors(tmp_path, monkeypatch):
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    path = _saved(tmp_path)

    def broken(*args, **kwargs):
        raise CheckpointException("failed", {0: (OSError(5, "Input/output error"), traceback.StackSummary())})

    monkeypatch.setattr(dcp, "load", broken)
    with pytest.raises(CheckpointError, match=r"loading checkpoint .* failed: OSError: \[Errno 5\] Input/output"):
        ck.load(path, {"w": torch.zeros(8)})
    monkeypatch.setattr(dcp, "save", broken)
    with pytest.raises(CheckpointError, match=r"saving checkpoint .* failed: OSError"):
        ck.save(tmp_path / "d", {"w": torch.zeros(8)})


def test_a_full_disk_is_named_however_deep_the_writer_wrapped_it(tmp_path, monkeypatch):
    """DCP's writer threads wrap the OSError (and only one rank's failure is quoted): the sentence still says the disk
    is full, and nothing of the checkpoint is left to load."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    def wrapped(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("writer thread failed") from exc

    def on_another_rank(*args, **kwargs):
        raise CheckpointException("failed", {0: (RuntimeError("rank 0 stopped"), traceback.StackSummary()),
                                             1: (OSError(errno.EDQUOT, "Disk quota exceeded"),
                                                 traceback.StackSummary())})

    for broken, words in ((wrapped, "No space left on device"), (on_another_rank, "Disk quota exceeded")):
        monkeypatch.setattr(dcp, "save", broken)
        with pytest.raises(CheckpointError, match=rf"saving checkpoint .* failed: the disk is full \({words}\); "):
            ck.save(tmp_path / "d", {"w": torch.zeros(8)})
        assert not (tmp_path / "d").exists()  # nothing at the checkpoint's path (its .partial folder is not one)


# -- missing or extra state ----------------------------------------------------------------------------------


def _exe_state(schedule: Schedule) -> dict:
    from cocoweave.backends.torch import Executable
    from cocoweave.plan import lower

    return ck.executable_state(Executable(lower(schedule), 0, 1, {}, "cpu"))


def test_state_the_checkpoint_lacks_or_has_too_much_of_is_refused(tmp_path):
    from cocoweave.schedule.enumerate import enumerate_schedules

    program = load_example("adam.py:adam", N=N)
    mv = sliced_adam()
    mvw = next(s for s in enumerate_schedules(program) if s.sliced_state == ["m", "v", "w"])
    ck.save(tmp_path / "mv", {"exe": _exe_state(mv)})
    ck.save(tmp_path / "mvw", {"exe": _exe_state(mvw)})
    with pytest.raises(CheckpointError, match=r"has no entry `exe/w`, which the state to load into has"):
        ck.load(tmp_path / "mv", {"exe": _exe_state(mvw)})  # schedule="auto" chose one that keeps w sliced too
    with pytest.raises(CheckpointError, match=r"holds sliced state `exe/w` that the state to load into lacks"):
        ck.load(tmp_path / "mvw", {"exe": _exe_state(mv)})
    ck.load(tmp_path / "mv", {"exe": _exe_state(mv)})  # the same schedule loads
    ck.save(tmp_path / "v", {"w": 3})
    with pytest.raises(CheckpointError, match=r"`w` is a plain value there, the state to load into has a tensor"):
        ck.load(tmp_path / "v", {"w": torch.zeros(2)})


# -- re-saving over a checkpoint: never a moment without one -------------------------------------------------


@pytest.mark.parametrize("swap", [True, False], ids=["atomic swap", "two renames"])
def test_re_saving_a_step_never_leaves_latest_without_a_checkpoint(tmp_path, monkeypatch, swap):
    import threading

    if not swap:
        monkeypatch.setattr(ck_files, "_exchange", lambda a, b: False)
    root = tmp_path / "ckpt"
    ck.save(ck.step_path(root, 1), {"w": torch.zeros(4), "step": 1})
    seen, done = [], threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(ck.latest(root))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for k in range(15):
            ck.save(ck.step_path(root, 1), {"w": torch.full((4,), float(k)), "step": 1})
    finally:
        done.set()
        watcher.join()
    assert seen and None not in seen
    w = torch.zeros(4)
    ck.load(ck.latest(root), {"w": w})
    assert torch.equal(w, torch.full((4,), 14.0)) and sorted(p.name for p in root.iterdir()) == ["step-00000001"]


@pytest.mark.parametrize("swap", [True, False], ids=["atomic swap", "two renames"])
def test_a_crash_while_replacing_a_checkpoint_leaves_one_that_loads(tmp_path, monkeypatch, swap):
    if not swap:
        monkeypatch.setattr(ck_files, "_exchange", lambda a, b: False)
    root = tmp_path / "ckpt"
    ck.save(ck.step_path(root, 2), {"w": torch.ones(4)}, step=2)
    faults.configure("stage=2,label=checkpoint,action=raise")  # between the swap (or renames) and the cleanup
    try:
        with pytest.raises(faults.InjectedFault):
            ck.save(ck.step_path(root, 2), {"w": torch.full((4,), 2.0)}, step=2)
    finally:
        faults.configure(None)
    found = ck.latest(root)
    assert found == (ck.step_path(root, 2) if swap else root / "step-00000002.old")
    w = torch.zeros(4)
    ck.load(found, {"w": w})
    assert torch.equal(w, torch.full((4,), 2.0 if swap else 1.0))  # the new one, or the old one intact
    ck.save(ck.step_path(root, 2), {"w": torch.full((4,), 3.0)}, step=2)  # the next save cleans up
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]


def _save_over_a_stale_file(rank: int, world_size: int, folder: str) -> str:
    try:
        ck.save(Path(folder) / "step-3", {"x": torch.ones(2)}, step=3)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_stale_partial_file_is_a_sentence_on_every_rank_not_a_raw_error(local_world, tmp_path):
    (tmp_path / "step-3.partial").write_text("not ours")
    got = local_world(2).run(_save_over_a_stale_file, str(tmp_path))
    assert got[0] == got[1] and "step-3.partial is in the way and is not a folder cocoweave left (a file)" in got[0]
    assert (tmp_path / "step-3.partial").read_text() == "not ours"  # refused, not removed
    (tmp_path / "step-3.partial").unlink()
    (tmp_path / "step-3.partial").symlink_to(tmp_path / "elsewhere")
    assert "(a symbolic link)" in _save_over_a_stale_file(0, 1, str(tmp_path))
