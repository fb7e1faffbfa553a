"""What every command shares: errors print as plain text (never rich markup) on one line, tables never cut what
they show, and the top-level help says what program files are (trusted code)."""

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from cocoweave.cli import app
from cocoweave.cli.common import fail

ROOT = Path(__file__).resolve().parents[2]


def cocoweave(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "cocoweave", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


def test_brackets_in_a_message_print_as_they_are(tmp_path):
    for name in ("x[/y].py", "[bold]z.py"):
        proc = cocoweave("show", f"{tmp_path / name}:f")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == f"error: {tmp_path / name}: no such program file\n", proc.stderr


def test_a_gloo_message_is_printed_verbatim(capsys):
    message = "rank 0: another rank failed ([/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:99)"
    exit_ = fail(message, 4)
    assert exit_.exit_code == 4
    assert capsys.readouterr().err == f"error: {message}\n"


def test_tables_are_never_cut_when_output_is_not_a_terminal():
    proc = cocoweave("check", ROOT / "examples/adam.py:adam", "-s", "N=9", "-n", "2", env={"COLUMNS": "40"})
    assert proc.returncode == 0, proc.stderr
    assert "fuse(RS-C-AG)@ring+slice(m,v)" in proc.stdout and "…" not in proc.stdout
    assert "tolerance: every element must satisfy |actual - expected| <= atol + rtol x |expected|; float32: " \
           "atol 1e-04, rtol 1e-04" in proc.stdout


def test_the_help_says_program_files_are_trusted_code_and_states_the_conventions():
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "1000"}).stdout  # a paragraph per line
    for words in ("are trusted code", "Run only programs you trust", "COCOWEAVE_LOAD_TIMEOUT", "-n/--world-size 4, "
                  "1-8 or 1,2,4", "--json PATH", "--wall-timeout", "4 a rank failed or hung"):
        assert words in out, words
