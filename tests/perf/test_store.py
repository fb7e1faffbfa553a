"""The measurement store: round trip, schema errors, atomic appends, unreadable parts, provenance."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from cocoweave.errors import StoreError
from cocoweave.perf import store as store_mod
from cocoweave.perf.store import COLUMNS, MeasurementStore, provenance


def record(program: str = "adam", total_ms: float = 3.5, **over) -> dict:
    rec = {
        "program": program, "program_fingerprint": "p123", "schedule": "split+reorder",
        "schedule_fingerprint": "s456", "sizes": {"N": 1024}, "world_size": 4, "backend": "torch",
        "device": "cpu", "stage_times_ms": {"all_reduce": 2.0, "adam": 1.5}, "total_ms": total_ms,
        "iters": 10, "host": "h", "git_commit": None,
        "versions": {"python": "3.11", "torch": "2.13"}, "time": datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
    }
    rec.update(over)
    return rec


def test_round_trip_keeps_every_value(tmp_path):
    store = MeasurementStore(tmp_path / "s")
    store.append([record("adam", 3.5), record("lamb", 4.0, extra={"note": "warm"})])
    store.append([record("adam", 2.5, git_commit="abc")])
    df = store.load()
    assert list(df.columns) == list(COLUMNS)
    assert len(df) == 3 and len(store.parts()) == 2
    assert sorted(df["total_ms"]) == [2.5, 3.5, 4.0]
    lamb = df[df["program"] == "lamb"].iloc[0]
    assert json.loads(lamb["extra"]) == {"note": "warm"}
    assert json.loads(lamb["stage_times_ms"]) == {"all_reduce": 2.0, "adam": 1.5}
    assert json.loads(lamb["sizes"]) == {"N": 1024}
    assert lamb["world_size"] == 4
    assert lamb["time"] == datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert set(df["git_commit"].dropna()) == {"abc"}


def test_empty_store_loads_an_empty_frame_with_the_schema(tmp_path):
    df = MeasurementStore(tmp_path / "nothing-yet").load()
    assert df.empty and list(df.columns) == list(COLUMNS)
    assert str(df["world_size"].dtype) == "int64" and str(df["total_ms"].dtype) == "float64"


def test_json_text_columns_are_accepted_and_canonicalised(tmp_path):
    store = MeasurementStore(tmp_path)
    store.append([record(sizes='{"b": 2, "a": 1}')])
    assert store.load()["sizes"].iloc[0] == '{"a": 1, "b": 2}'


@pytest.mark.parametrize("bad, words", [
    ({"world_size": "4"}, ["'world_size'", "record 1", "str", "int"]),
    ({"world_size": True}, ["'world_size'", "bool"]),
    ({"total_ms": float("nan")}, ["'total_ms'", "finite"]),
    ({"sizes": "[1, 2"}, ["'sizes'", "not valid JSON"]),
    ({"sizes": [1, 2]}, ["'sizes'", "JSON object"]),
    ({"stage_times_ms": {"ar": "fast"}}, ["'stage_times_ms'", "'ar'"]),
    ({"time": datetime(2025, 1, 1)}, ["'time'", "naive"]),
    ({"program": None}, ["'program'", "required"]),
    ({"walltime": 3}, ["'walltime'", "extra", "allowed columns: program, program_fingerprint"]),
])
def test_mistyped_or_unknown_columns_name_the_column_and_record(tmp_path, bad, words):
    store = MeasurementStore(tmp_path)
    with pytest.raises(StoreError) as info:
        store.append([record(), record(**bad)])
    for word in words:
        assert word in str(info.value)
    assert store.parts() == []  # a bad batch writes nothing


def test_missing_column_names_the_column_and_record(tmp_path):
    rec = record("lamb")
    del rec["iters"]
    with pytest.raises(StoreError, match=r"record 0 \(program 'lamb'\) is missing column 'iters'"):
        MeasurementStore(tmp_path).append([rec])


def test_crash_while_writing_leaves_no_readable_garbage(tmp_path, monkeypatch):
    store = MeasurementStore(tmp_path)
    store.append([record("before")])

    def half_write(table, where, **kwargs):
        with open(where, "wb") as fh:
            fh.write(b"PAR1 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod.pq, "write_table", half_write)
    with pytest.raises(StoreError, match="No space left"):
        store.append([record("during")])
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in store.parts()]  # no temp file left
    assert list(store.load()["program"]) == ["before"]
    store.append([record("after")])
    assert sorted(store.load()["program"]) == ["after", "before"]


def test_an_unreadable_part_is_quarantined_with_a_warning_and_the_others_load(tmp_path):
    store = MeasurementStore(tmp_path)
    store.append([record("first")])
    bad = tmp_path / "part-99999999T000000000000Z-corrupt.parquet"
    bad.write_bytes(b"not parquet at all")
    store.append([record("second"), record("third")])
    with pytest.warns(store_mod.StoreWarning, match=r"part-99999999T000000000000Z-corrupt.parquet is unreadable "
                                                    r".*moved it to .*quarantine"):
        df = store.load()
    assert sorted(df["program"]) == ["first", "second", "third"]  # no batch is lost
    assert not bad.exists() and (tmp_path / "quarantine" / bad.name).read_bytes() == b"not parquet at all"
    assert len(store.load()) == 3 and len(store.parts()) == 2  # quarantined parts are never read again


def test_a_part_of_another_schema_is_skipped_with_a_warning_and_kept(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    store = MeasurementStore(tmp_path)
    store.append([record("kept")])
    other = tmp_path / "part-00000000T000000000000Z-old.parquet"
    pq.write_table(pa.table({"program": ["old"]}), other)
    with pytest.warns(store_mod.StoreWarning, match="does not have the store's schema; skipped it"):
        assert list(store.load()["program"]) == ["kept"]
    assert other.exists()


def test_default_location_and_env_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(store_mod.STORE_ENV, raising=False)
    assert MeasurementStore().path == tmp_path / ".cocoweave" / "store"
    monkeypatch.setenv(store_mod.STORE_ENV, str(tmp_path / "elsewhere"))
    MeasurementStore().append([record()])
    assert len(MeasurementStore(tmp_path / "elsewhere").load()) == 1


def test_provenance_fills_host_versions_time_and_no_commit_outside_a_repo(tmp_path):
    prov = provenance(cwd=tmp_path)
    assert prov["git_commit"] is None
    assert prov["host"] and prov["time"].tzinfo is not None
    assert {"python", "torch", "triton", "cocoweave"} <= set(prov["versions"])
    store = MeasurementStore(tmp_path / "s")
    store.append([record(**prov)])  # provenance() output is valid store input
    assert store.load()["host"].iloc[0] == prov["host"]
