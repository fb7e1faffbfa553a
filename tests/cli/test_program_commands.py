"""`cocoweave show`, `run` and `--version` as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from cocoweave import __version__
from cocoweave.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"cocoweave {__version__}"


def test_show_prints_program_and_fingerprint():
    r = invoke("show", ROOT / "examples/adam.py:adam", "--size", "N=64")
    assert r.exit_code == 0
    assert "input  g: float32[64] Local" in r.stdout and "fingerprint " in r.stdout


def test_run_json_summarises_every_result():
    r = invoke("run", ROOT / "examples/lamb.py:lamb", "--world-size", 3, "--size", "N=101", "--json", "-")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["world_size"] == 3
    assert {row["name"] for row in data["results"]} == {"m", "v", "w"}
    assert all(row["finite"] and row["shape"] == [101] for row in data["results"])


def test_run_table_for_pipeline():
    r = invoke("run", ROOT / "examples/pipeline_parallel.py:boundary", "-n", 2, "-s", "H=16", "-s", "S=4")
    assert r.exit_code == 0, r.output
    assert "pipeline_parallel on 2 ranks" in r.stdout


def test_user_errors_exit_2_with_one_line_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import cocoweave as cw\ndef f():\n    p = cw.Program('x')\n"
                   "    return cw.all_reduce(p.tensor('a', (4,), 'float32'))\n")
    # `show` in this process (its errors as a separate process prints them: tests/cli/test_common.py); `run` as
    # the user runs it, since it starts rank processes
    for args in (["show", f"{bad}:f"], ["show", f"{bad}:g"]):
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.stderr and r.stderr.startswith("error: ") and not r.stdout, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for args in (["run", f"{bad}:f"], ["run", ROOT / "examples/adam.py:adam", "--size", "Q=3"],
                 ["run", ROOT / "examples/pipeline_parallel.py:boundary", "-n", 3]):
        proc = subprocess.run([sys.executable, "-m", "cocoweave", *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: "), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
