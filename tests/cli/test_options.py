"""One convention for every command: -n as 4, 1-8 or 1,2,4 (default 4), --json PATH with '-' for stdout,
--timeout per wait and --wall-timeout, and bad input (timeouts, sizes, output paths, program files that end the
process or never return) refused with one sentence and exit code 2 before anything runs or is written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cocoweave.launch
from cocoweave.cli import app
from cocoweave.cli.options import check_fits, check_output, parse_seconds, parse_world_sizes
from cocoweave.errors import LoadError
from cocoweave.ir.loader import load_example

ROOT = Path(__file__).resolve().parents[2]
ADAM = f"{ROOT / 'examples/adam.py'}:adam"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if a command starts a local world: bad input must be refused before that."""
    def refuse(*args, **kwargs):
        raise AssertionError("a LocalWorld was started")

    monkeypatch.setattr(cocoweave.launch, "LocalWorld", refuse)


def test_world_sizes_timeouts_outputs_and_sizes_are_checked(tmp_path):
    assert parse_world_sizes("4") == [4] and parse_world_sizes("1-3,8") == [1, 2, 3, 8]
    for bad in (float("inf"), float("nan"), 0.0, -1.0, 1e9):
        with pytest.raises(LoadError, match="--timeout must be a finite number of seconds above 0"):
            parse_seconds(bad)
    assert parse_seconds(0.5) == 0.5
    with pytest.raises(LoadError, match="is a folder; give a file path"):
        check_output(tmp_path, "--trace")
    with pytest.raises(LoadError, match="the folder .*missing does not exist"):
        check_output(tmp_path / "missing" / "t.json", "--trace")
    assert check_output("-", "--json") is None and check_output(tmp_path / "t.json", "--json") == tmp_path / "t.json"
    check_fits(load_example("adam.py:adam", N=1 << 20), {}, [4])
    with pytest.raises(LoadError, match=r"program `adam` at N=1000000000000000 needs 56.8 PiB for its inputs on 4 "
                                        r"ranks, more than this machine's .* of memory; use smaller sizes or fewer "
                                        r"ranks$"):
        check_fits(load_example("adam.py:adam", N=10**15), {}, [1, 4], {"N": 10**15})


@pytest.mark.parametrize("args, words", [
    (["run", ADAM, "--timeout", "inf"], "--timeout must be a finite number of seconds above 0"),
    (["run", ADAM, "--backend", "torch", "--wall-timeout", "inf"], "--wall-timeout must be a finite number"),
    (["check", ADAM, "--backend", "torch", "--timeout", "nan"], "--timeout must be a finite number"),
    (["tune", ADAM, "--timeout", "inf"], "--timeout must be a finite number"),
    (["measure", ADAM, "--wall-timeout", "-1"], "--wall-timeout must be a finite number"),
    (["run", ADAM, "-s", "N=1000000000000000"], "needs 56.8 PiB for its inputs on 4 ranks"),
    (["run", ADAM, "-s", "N=1000000000000000", "--backend", "torch"], "needs 56.8 PiB"),
    (["check", ADAM, "-s", "N=1000000000000000", "-n", "1-2"], "needs 28.4 PiB for its inputs on 2 ranks"),
    (["check", ADAM, "-s", "N=10**15"], "size N must be an integer, got '10**15'"),
    (["run", ADAM, "-s", "N=-3"], "size N must not be negative"),
    (["measure", ADAM, "-s", "N=1000000000000000"], "needs 56.8 PiB"),
    (["run", ADAM, "-n", "2,3", "--backend", "torch", "--trace", "t.json"], "--trace writes one world's trace"),
    (["run", ADAM, "-n", "10000", "--backend", "torch"], "a local world of 10000 ranks is more than"),
    (["demo", "-n", "2,10000"], "a local world of 10000 ranks is more than"),
    (["demo", "--wall-timeout", "inf"], "--wall-timeout must be a finite number"),
])
def test_bad_input_exits_2_with_one_sentence_before_any_rank_starts(args, words, no_ranks):
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert words in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.output, r.stderr


def test_output_paths_are_checked_before_the_run(tmp_path, no_ranks):
    for option in ("--trace", "--json"):
        for path, words in [(tmp_path, "is a folder"), (tmp_path / "no" / "x.json", "does not exist")]:
            r = invoke("run", ADAM, "--backend", "torch", option, path)
            assert r.exit_code == 2 and words in r.stderr, r.output
    assert sorted(os.listdir(tmp_path)) == []


def test_a_trace_in_a_folder_the_user_cannot_write_is_refused_before_the_run(tmp_path, monkeypatch, no_ranks):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    if os.getuid() == 0:  # root writes anywhere a user cannot: play a read-only filesystem (EROFS) instead
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and not str(p).startswith(str(folder)))
    r = invoke("run", ADAM, "--backend", "torch", "--trace", folder / "t.json")
    assert r.exit_code == 2, r.output
    assert r.stderr == f"error: --trace {folder / 't.json'}: the folder {folder} is not writable\n"
    assert os.listdir(folder) == []


def test_json_goes_to_a_file_or_with_dash_to_stdout_instead_of_the_table(tmp_path):
    out = tmp_path / "schedules.json"
    r = invoke("schedules", ADAM, "-s", "N=8", "--json", out)
    assert r.exit_code == 0 and "schedules of adam" in r.stdout  # the table, and the file
    assert [s["name"] for s in json.loads(out.read_text())][:2] == ["AR-c", "AR-C"]
    r = invoke("schedules", ADAM, "-s", "N=8", "--json", "-")
    assert json.loads(r.stdout) == json.loads(out.read_text())
    r = invoke("show", ADAM, "-s", "N=8", "--json", "-")
    doc = json.loads(r.stdout)
    assert doc["program"] == "adam" and doc["text"].startswith("program adam")


def test_world_sizes_run_each_in_turn_and_default_to_4():
    r = invoke("run", ADAM, "-s", "N=9", "-n", "2,3", "--json", "-")
    assert r.exit_code == 0, r.output
    assert [d["world_size"] for d in json.loads(r.stdout)] == [2, 3]
    assert json.loads(invoke("run", ADAM, "-s", "N=9", "--json", "-").stdout)["world_size"] == 4
    r = invoke("show", ADAM, "-s", "N=9", "--code")
    assert "for rank 0 of 4" in r.stdout
    r = invoke("show", ADAM, "-s", "N=9", "--code", "-n", "2-3", "--json", "-")
    code = json.loads(r.stdout)["code"]
    assert [c["world_size"] for c in code] == [2, 3]
    assert all(f"for rank 0 of {c['world_size']}" in c["source"] for c in code)


def _program(tmp_path, text):
    path = tmp_path / "prog.py"
    path.write_text(text)
    return f"{path}:f"


def test_a_program_that_ends_the_process_or_never_returns_exits_2_with_a_sentence(tmp_path):
    spec = _program(tmp_path, "import os\n\ndef f():\n    os._exit(0)\n")
    proc = subprocess.run([sys.executable, "-m", "cocoweave", "show", spec], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.endswith("prog.py:4: the program called os._exit(0); a program "
                                                         "file must return a Program, not end the process\n")
    spec = _program(tmp_path, "def f():\n    while True:\n        pass\n")
    proc = subprocess.run([sys.executable, "-m", "cocoweave", "run", spec], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COCOWEAVE_LOAD_TIMEOUT": "1"})
    assert proc.returncode == 2 and "still running after 1 s of loading" in proc.stderr, proc.stderr
