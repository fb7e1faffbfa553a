"""What every command shares, as a user sees it: `-h` is help everywhere, help text is wrapped by sentence
(not cut where the source broke its lines), `--json -` puts the JSON alone on stdout in every command, `--device`
is a choice that --help lists, `--jobs` has a lower bound, and `-v` logs what cocoweave does on stderr."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cocoweave.cli import app

ROOT = Path(__file__).resolve().parents[2]
ADAM = str(ROOT / "examples" / "adam.py:adam")
runner = CliRunner()


def invoke(*args: object, width: int = 200):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(width)})


COMMANDS = [["show"], ["run"], ["schedules"], ["check"], ["demo"], ["plan"], ["preflight"], ["profile"], ["measure"],
            ["tune"], ["perf"], ["perf", "calibrate"], ["perf", "predict"], ["perf", "accuracy"], ["perf", "cmdare"]]


@pytest.mark.parametrize("command", [[], *COMMANDS], ids=lambda c: " ".join(c) or "cocoweave")
def test_dash_h_is_help_in_every_command(command):
    r = invoke(*command, "-h")
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.stdout and r.stdout == invoke(*command, "--help").stdout


def test_help_text_wraps_by_sentence_not_where_the_source_broke_its_lines():
    out = invoke("--help", width=1000).stdout  # wide enough for a paragraph per line
    assert "runs them in its own process, as `python FILE.py` would, so they can read" in out
    assert "2 bad input, 3 a bug of cocoweave, 4 a rank failed or hung" in out
    assert "its schedules with its steps, stages, rewritten program and plan" in out  # `show`, in the list
    legend = invoke("schedules", "-h").stdout  # an indented legend keeps its lines
    assert "\n   C              computation fused into one generated kernel" in legend


@pytest.mark.parametrize("command", [["run"], ["check"], ["measure"], ["tune"], ["perf", "calibrate"],
                                     ["perf", "predict"], ["perf", "accuracy"]], ids=" ".join)
def test_device_is_a_choice_that_help_lists_and_others_are_refused(command):
    assert "cpu|cuda" in invoke(*command, "-h").stdout
    r = invoke(*command, *([] if command[0] == "perf" and command[1] != "predict" else [ADAM]), "--device", "tpu")
    assert r.exit_code == 2 and "'tpu' is not one of 'cpu', 'cuda'" in r.output


def test_demo_device_lists_auto_too():
    assert "auto|cpu|cuda" in invoke("demo", "-h").stdout


def test_jobs_has_a_lower_bound():
    r = invoke("perf", "cmdare", "--jobs", "0")
    assert r.exit_code == 2 and "greater than or equal to 1" in r.output
    assert "x>=1" in invoke("perf", "cmdare", "-h").stdout


PROFILE = """\
name: my-transformer
checkpoint_s: 20
step_time_s:
  K80: {1: 0.9, 2: 0.47, 4: 0.25, 8: 0.15}
"""


@pytest.mark.parametrize("command", [["show", ADAM], ["schedules", ADAM],
                                     ["plan", "--profile", "PROFILE", "--budget", "100", "--steps", "1000"]],
                         ids=lambda c: c[0])
def test_json_dash_is_json_alone_on_stdout_and_no_table_anywhere(command, tmp_path):
    (tmp_path / "profile.yaml").write_text(PROFILE)
    r = invoke(*[tmp_path / "profile.yaml" if a == "PROFILE" else a for a in command], "--json", "-")
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # stdout is the JSON and nothing else
    assert not any(c in r.stderr for c in "┏━┃│"), r.stderr  # the tables are not printed at all


@pytest.fixture
def restore_logging():
    logger = logging.getLogger("cocoweave")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:], logger.level = handlers, level


def test_verbose_logs_the_launch_on_stderr_apart_from_the_json(restore_logging):
    r = invoke("-v", "run", ADAM, "-s", "N=8", "--backend", "torch", "-n", "1", "--json", "-")
    assert r.exit_code == 0, r.output
    assert "cocoweave.launch.world INFO: local world of 1 ranks started (gloo on cpu)" in r.stderr
    json.loads(r.stdout)  # logging never mixes with the JSON
