"""The generated-code cache: readable files, bounded by pruning; a cache that cannot be written costs one
warning and never a run (step code runs from memory, Triton kernels from a private temporary folder)."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import stat
import sys
import warnings

import pytest
import torch

from cocoweave.backends.torch.executable import Executable
from cocoweave.ir.loader import load_example
from cocoweave.plan import lower
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.schedule.schedule import Schedule
from cocoweave.storage import codecache, statedir


@pytest.fixture
def unwritable(tmp_path, monkeypatch):
    """COCOWEAVE_CACHE at a regular file: nothing can be created beneath it (even as root)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(codecache.CACHE_ENV, str(blocker))
    monkeypatch.setattr(codecache, "_WARNED", set())
    return blocker


def _plant(plans, key: str, marker) -> None:
    """What a hostile user who may write into `plans` plants: KEY.py as cocoweave would write it, and beside it an
    unchecked-hash .pyc (Python runs it without looking at the source) that writes `marker`."""
    bad = plans / "bad.py"
    bad.write_text(f"open({str(marker)!r}, 'w').write('planted code ran')\n")
    pyc = plans / "__pycache__" / f"{key}.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(bad), cfile=str(pyc), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    bad.unlink()


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another user's"])
def test_a_cache_others_may_write_into_is_not_used_and_planted_code_never_runs(tmp_path, monkeypatch, how):
    from cocoweave.ir.loader import import_module_file  # how generated kernels are imported (kernels/codegen.py)

    shared, marker = tmp_path / "shared", tmp_path / "marker"
    plans = shared / "plans"
    (plans / "__pycache__").mkdir(parents=True)
    source, key = "x = 1\n", f"kern{abs(hash(how))}"
    (plans / f"{key}.py").write_text(source)
    _plant(plans, key, marker)
    for folder in (shared, plans, plans / "__pycache__"):
        folder.chmod({"world-writable": 0o777, "group-writable": 0o770, "another user's": 0o700}[how])
    if how == "another user's":
        monkeypatch.setattr(statedir.os, "geteuid", lambda: os.stat(shared).st_uid + 1)
    monkeypatch.setenv(codecache.CACHE_ENV, str(shared))
    monkeypatch.setattr(codecache, "_WARNED", set())
    why = {"world-writable": r"is writable by every user \(mode 777\)", "group-writable": r"is writable by its "
           r"group \(mode 770\)", "another user's": r"belongs to another user \(uid \d+, you are \d+\)"}[how]
    with pytest.warns(codecache.CacheWarning, match=f"the code cache {plans} cannot be written \\(the code cache "
                                                    f"folder {shared} {why}: point \\$COCOWEAVE_CACHE at a folder"):
        path = codecache.source_file(source, key)
    assert not str(path).startswith(str(shared))  # a private temporary folder instead
    module = import_module_file(f"cocoweave_test_planted_{key}", str(path))
    assert module.x == 1 and not marker.exists()


def test_a_new_cache_is_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv(codecache.CACHE_ENV, str(tmp_path / "new" / "cache"))
    old = os.umask(0o002)  # a umask that would leave new folders group-writable
    try:
        path = codecache.write_source("x = 1\n", "k")
    finally:
        os.umask(old)
    assert path == tmp_path / "new" / "cache" / "plans" / "k.py"
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in (path.parent, path.parent.parent)} == {0o700}


def test_source_is_cached_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(codecache.CACHE_ENV, str(tmp_path))
    path = codecache.write_source("x = 1\n", "k1")
    assert path == tmp_path / "plans" / "k1.py" and path.read_text() == "x = 1\n"
    assert codecache.write_source("x = 1\n", "k1") == path
    assert codecache.write_source("x = 2\n", "k1").read_text() == "x = 2\n"  # stale content is replaced
    assert sorted(p.name for p in path.parent.iterdir()) == ["k1.py"]  # no temporary files left


def test_an_unwritable_cache_warns_once_and_returns_none(unwritable):
    with pytest.warns(codecache.CacheWarning, match=r"the code cache .*not-a-folder/plans cannot be written .*"
                                                    r"runs from memory") as record:
        assert codecache.write_source("x = 1\n", "a") is None
        assert codecache.write_source("x = 2\n", "b") is None
    assert len(record) == 1


def test_a_step_runs_from_memory_when_the_cache_is_unwritable(unwritable):
    program = load_example("adam.py:adam", N=8)
    with pytest.warns(codecache.CacheWarning):
        exe = Executable(lower(Schedule(program)), 0, 1, {}, "cpu", kernels="torch")
    assert exe.path is None
    w = torch.ones(8)
    exe.run({"g": torch.ones(8), "w": w, "m": torch.zeros(8), "v": torch.zeros(8), "lr": 0.1, "beta1": 0.9,
             "beta2": 0.99, "eps": 1e-8, "step": 1.0})
    assert torch.allclose(w, torch.full((8,), 0.9))  # one Adam step of lr 0.1 on a constant gradient


def test_kernel_source_falls_back_to_a_private_temporary_folder(unwritable):
    with pytest.warns(codecache.CacheWarning):
        path = codecache.source_file("y = 3\n", "kern")
    assert path.read_text() == "y = 3\n" and not str(path).startswith(str(unwritable))
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_kernels_build_and_run_with_an_unwritable_cache(unwritable, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    program = load_example("adam.py:adam", N=8)
    schedule = next(s for s in enumerate_schedules(program) if s.name == "AR-C")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", codecache.CacheWarning)
        exe = Executable(lower(schedule), 0, 1, {}, "cpu", kernels="triton")
        kernels = exe.ctx.kernels
        assert kernels and all(k.path.is_file() for k in kernels.values())
        w = torch.ones(8)
        exe.run({"g": torch.ones(8), "w": w, "m": torch.zeros(8), "v": torch.zeros(8), "lr": 0.1, "beta1": 0.9,
                 "beta2": 0.99, "eps": 1e-8, "step": 1.0})
    assert torch.allclose(w, torch.full((8,), 0.9))


def test_writing_prunes_the_cache_to_its_newest_files(tmp_path, monkeypatch):
    monkeypatch.setenv(codecache.CACHE_ENV, str(tmp_path))
    folder = tmp_path / "plans"
    for i in range(8):
        path = codecache.write_source(f"x = {i}\n", f"k{i}")
        os.utime(path, (1000 + i, 1000 + i))  # distinct ages, oldest first
    monkeypatch.setenv(codecache.MAX_FILES_ENV, "5")
    codecache.write_source("x = 0\n", "k0")  # a hit makes k0 the newest
    codecache.write_source("x = 8\n", "k8")
    assert sorted(p.name for p in folder.iterdir()) == ["k0.py", "k5.py", "k6.py", "k7.py", "k8.py"]


def test_pruning_bounds_the_bytes_too(tmp_path, monkeypatch):
    monkeypatch.setenv(codecache.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(codecache.MAX_MB_ENV, "0.0025")  # 2500 bytes: two files of 1000 bytes each
    for i in range(5):
        os.utime(codecache.write_source(f"# {i}" + "x" * 997, f"k{i}"), (1000 + i, 1000 + i))
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == ["k3.py", "k4.py"]


def test_the_cache_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv(codecache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert codecache.cache_dir() == tmp_path / "xdg" / "cocoweave" / "plans"
    assert codecache.write_source("x = 1\n", "k1") == tmp_path / "xdg" / "cocoweave" / "plans" / "k1.py"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG rule: a relative value is ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert codecache.cache_dir() == tmp_path / "home" / ".cache" / "cocoweave" / "plans"
    monkeypatch.setenv(codecache.CACHE_ENV, str(tmp_path / "mine"))  # the project's own variable wins
    assert codecache.cache_dir() == tmp_path / "mine" / "plans"
