"""The CLI's `./.cocoweave` state folder in a shared working directory: a symbolic link, a folder of another user
or one every user may write into is refused with a sentence (cocoweave neither follows it nor writes there), and a
training run's tuned-schedule lookup treats that as no tuned schedule, with a warning."""

from __future__ import annotations

import os

import pytest

from cocoweave.errors import CocoweaveError
from cocoweave.ir.loader import load_example
from cocoweave.perf.store import MeasurementStore
from cocoweave.storage import statedir
from cocoweave.tune.cache import TuneCache, cached_schedule


@pytest.fixture(autouse=True)
def _default_tuning_cache(monkeypatch):
    """The tuning cache where a user's is by default: under the state folder (the suite points it elsewhere)."""
    monkeypatch.delenv("COCOWEAVE_TUNE_CACHE", raising=False)


def test_a_symlinked_state_folder_is_refused_and_nothing_is_written_through_it(tmp_path, monkeypatch):
    target = tmp_path / "someone-elses"
    target.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / ".cocoweave").symlink_to(target)
    monkeypatch.chdir(work)
    for make in (TuneCache, MeasurementStore):
        with pytest.raises(CocoweaveError, match=r"\.cocoweave is a symbolic link \(to .*someone-elses\); cocoweave "
                                                 "does not follow it"):
            make()
    assert list(target.iterdir()) == []
    with pytest.warns(UserWarning, match="is a symbolic link.*; using no tuned schedule"):
        assert cached_schedule(load_example("adam.py:adam", N=8), {}, 2, "torch", "cpu") is None


def test_a_state_folder_of_another_user_or_writable_by_all_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / ".cocoweave"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert statedir.state_dir() == folder  # ours: used
    monkeypatch.setattr(statedir.os, "geteuid", lambda: os.stat(folder).st_uid + 1)
    with pytest.raises(CocoweaveError, match=r"belongs to another user \(uid \d+, you are \d+\)"):
        statedir.state_dir()
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    folder.chmod(0o777)
    with pytest.raises(CocoweaveError, match=r"writable by every user \(mode 777\)"):
        statedir.state_dir()
    folder.rmdir()
    assert statedir.state_dir() == folder  # absent: cocoweave will make it, as this user
