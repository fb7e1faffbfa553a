"""The tuning cache: JSON round trips, atomic replacement, clear errors, and compile(schedule="auto")."""

from __future__ import annotations

import json
import warnings

import pytest

from cocoweave.compiler import compile as cw_compile
from cocoweave.errors import CocoweaveError
from cocoweave.ir.loader import load_example
from cocoweave.schedule.enumerate import enumerate_schedules
from cocoweave.tune import TuneCache, auto_schedule, cache_key, cached_schedule


def test_entries_round_trip_and_writes_leave_no_temporary_files(tmp_path):
    cache = TuneCache(tmp_path / "sub" / "cache.json")
    assert cache.get("k") is None and cache.entries() == {}
    cache.put("a", {"schedule": "AR-C", "steps": [{"op": "fuse"}]})
    cache.put("b", {"schedule": "RS-C"})
    cache.put("a", {"schedule": "AR-c", "steps": []})
    again = TuneCache(tmp_path / "sub" / "cache.json")
    assert set(again.entries()) == {"a", "b"} and again.get("a")["schedule"] == "AR-c"
    assert "time" in again.get("b")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["cache.json", "cache.json.lock"]


def test_a_write_waits_a_bounded_time_for_another_writers_lock(tmp_path, monkeypatch):
    from filelock import FileLock

    from cocoweave.tune import cache as cache_module

    path = tmp_path / "cache.json"
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 0.2)
    with FileLock(tmp_path / "cache.json.lock"):  # another tuner is writing
        with pytest.raises(CocoweaveError, match="stayed locked by another process for 0.2 s"):
            TuneCache(path).put("a", {"schedule": "AR-C"})
    TuneCache(path).put("a", {"schedule": "AR-C"})  # released: the write goes through
    assert TuneCache(path).get("a")["schedule"] == "AR-C"


@pytest.mark.parametrize("text", ["{not json", json.dumps([1, 2]), json.dumps({"entries": 3})])
def test_a_damaged_cache_is_one_sentence(tmp_path, text):
    path = tmp_path / "cache.json"
    path.write_text(text)
    with pytest.raises(CocoweaveError, match="tuning cache .* delete it to start over"):
        TuneCache(path).get("x")


def test_keys_separate_sizes_world_sizes_backends_and_devices():
    p = load_example("adam.py:adam", N=64)
    bigger = load_example("adam.py:adam", N=128)
    keys = {cache_key(p, {}, 4, "torch", "cpu"), cache_key(p, {}, 2, "torch", "cpu"),
            cache_key(p, {}, 4, "torch", "cuda:1"), cache_key(bigger, {}, 4, "torch", "cpu")}
    assert len(keys) == 4
    assert cache_key(p, {}, 4, "torch", "cuda:0") == cache_key(p, {}, 4, "torch", "cuda:1")


def test_compile_auto_uses_the_cached_choice_and_warns_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("COCOWEAVE_TUNE_CACHE", str(tmp_path / "cache.json"))
    program = load_example("adam.py:adam", N=64)
    with pytest.warns(UserWarning, match="no tuned schedule of adam for world size 1"):
        exe = cw_compile(program, "torch", {}, device="cpu", rank=0, world_size=1, schedule="auto")
    assert exe.plan.fingerprint == cw_compile(program, "torch", {}, device="cpu", rank=0, world_size=1).plan.fingerprint
    chosen = enumerate_schedules(program)[1]
    TuneCache().put(cache_key(program, {}, 1, "torch", "cpu"), {"schedule": chosen.name, "steps": chosen.steps_json()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exe = cw_compile(program, "torch", {}, device="cpu", rank=0, world_size=1, schedule="auto")
        assert auto_schedule(program, {}, 1, "torch", "cpu").fingerprint() == chosen.fingerprint()
    from cocoweave.plan import lower

    assert exe.plan.fingerprint == lower(chosen).fingerprint
    with pytest.raises(CocoweaveError, match="schedule must be None or 'auto'"):
        cw_compile(program, "torch", {}, device="cpu", rank=0, world_size=1, schedule="fastest")


BROKEN = {"not UTF-8": b"\xff\xfe{not text", "no entries": b'{"entries": 3}',
          "an entry that is not an object": b'{"entries": {"k": 3}}', "not JSON": b"{not json"}


@pytest.mark.parametrize("content", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_cache_is_one_sentence_and_means_no_cached_choice(tmp_path, content):
    path = tmp_path / "cache.json"
    path.write_bytes(content)
    with pytest.raises(CocoweaveError, match=r"^the tuning cache .* delete it to start over\.$"):
        TuneCache(path).entries()
    program = load_example("adam.py:adam", N=64)
    with pytest.warns(UserWarning, match="tuning cache .*; using no tuned schedule"):
        assert cached_schedule(program, {}, 2, "torch", "cpu", TuneCache(path)) is None


@pytest.mark.parametrize("steps", [5, [{"step": "split"}], [{"step": "nope"}], [7]])
def test_an_entry_whose_steps_do_not_replay_is_ignored_with_a_warning(tmp_path, steps):
    program = load_example("adam.py:adam", N=64)
    cache = TuneCache(tmp_path / "cache.json")
    cache.put(cache_key(program, {}, 2, "torch", "cpu"), {"schedule": "x", "steps": steps})
    with pytest.warns(UserWarning, match="the cached schedule 'x' for adam no longer applies"):
        assert cached_schedule(program, {}, 2, "torch", "cpu", cache) is None


def _auto_adamw(rank: int, world_size: int, cache_path: str) -> tuple[str, list[str]]:
    import os

    import torch

    from cocoweave.optim import DistributedAdamW

    os.environ["COCOWEAVE_TUNE_CACHE"] = cache_path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = DistributedAdamW([torch.nn.Parameter(torch.ones(8))], lr=0.1, schedule="auto")
    del os.environ["COCOWEAVE_TUNE_CACHE"]
    return type(opt).__name__, [str(w.message) for w in caught]


def test_distributed_adamw_auto_constructs_with_a_broken_cache(local_world, tmp_path):
    path = tmp_path / "cache.json"
    path.write_bytes(BROKEN["not UTF-8"])
    for name, messages in local_world(2).run(_auto_adamw, str(path)):
        assert name == "DistributedAdamW"
        assert any("is not UTF-8 text" in m and "using no tuned schedule" in m for m in messages), messages
