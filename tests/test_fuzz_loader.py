"""Fuzzing bad input: malformed program files, sizes and CLI arguments, and wrong per-rank inputs (shapes,
dtypes, devices, NaN/Inf under the finite check) give one clear sentence (a CocoweaveError; exit code 2
from the CLI), never a traceback, and write nothing."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cocoweave.backends import reference
from cocoweave.backends.inputs import check_inputs, make_inputs
from cocoweave.cli import app
from cocoweave.errors import CocoweaveError, InputError
from cocoweave.ir.graph import Program
from cocoweave.ir.loader import examples_dir, load_example, load_program

EXAMPLES = {name: (examples_dir() / f"{name}.py").read_text() for name in ("adam", "model_parallel")}
FUNCS = {"adam": "adam", "model_parallel": "layer"}
SNIPPETS = ["(", ")", ":", "\n    ", "\x00", "cw.Sliced(7)", "cw.Sliced(-1)", "cw.Local", "'float33'", "'int8'",
            "None", "-1", "0", "1e9", "return 3\n", "raise ValueError('boom')\n", "import sys; sys.exit(3)\n",
            "cw.no_such_op(", "cw.all_gather(", "cw.matmul(", "p.output(", "lambda: 0", "\ufffd", "é", "# "]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def mutated_programs(draw: st.DrawFn) -> tuple[str, str]:
    """An example program with a random edit: truncated, a span deleted, or a snippet inserted."""
    name = draw(st.sampled_from(sorted(EXAMPLES)))
    text = EXAMPLES[name]
    i = draw(st.integers(0, len(text)))
    kind = draw(st.sampled_from(["truncate", "delete", "insert", "insert"]))
    if kind == "truncate":
        text = text[:i]
    elif kind == "delete":
        text = text[:i] + text[i + draw(st.integers(1, 40)):]
    else:
        text = text[:i] + draw(st.sampled_from(SNIPPETS)) + text[i:]
    return text, FUNCS[name]


size_values = st.one_of(st.integers(-3, 12), st.sampled_from(["x", "", "1.5", "2**4", "1_6", "99999999999999999"]))
sizes = st.dictionaries(st.sampled_from(["N", "B", "S", "H", "Q", "n"]), size_values, max_size=4)


def _one_sentence(message: str) -> None:
    assert message and "Traceback" not in message and "\n" not in message.strip(), message


@FUZZ
@given(case=mutated_programs(), sizes=sizes)
def test_load_program_on_mutated_files_returns_a_program_or_one_sentence(tmp_path, case, sizes):
    text, func = case
    path = tmp_path / "prog.py"
    path.write_text(text)
    before = sorted(os.listdir(tmp_path))
    try:
        ints = {k: int(str(v)) for k, v in sizes.items()}
    except ValueError:
        ints = {"N": 4}
    try:
        program = load_program(f"{path}:{func}", {k: v for k, v in ints.items() if abs(v) < 10**6})
    except CocoweaveError as exc:
        _one_sentence(str(exc))
    else:
        assert isinstance(program, Program)
    assert sorted(os.listdir(tmp_path)) == before  # no __pycache__ or anything else next to the file


@FUZZ
@given(data=st.binary(max_size=200))
def test_load_program_on_random_bytes_gives_one_sentence(tmp_path, data):
    path = tmp_path / "prog.py"
    path.write_bytes(data)
    try:
        load_program(f"{path}:f", {})
    except CocoweaveError as exc:
        _one_sentence(str(exc))
    else:  # pragma: no cover - random bytes never define f
        pytest.fail("random bytes loaded as a program")


runner = CliRunner()


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """An empty working directory and plan cache: commands that fail must leave both empty."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COCOWEAVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


@settings(FUZZ, max_examples=30)
@given(case=mutated_programs(), sizes=sizes, command=st.sampled_from(["show", "run"]),
       world=st.sampled_from(["-1", "0", "1", "2", "3", "two"]))
def test_cli_on_bad_programs_sizes_and_worlds_exits_2_with_one_line(sandbox, case, sizes, command, world):
    text, func = case
    prog = sandbox / "prog.py"
    prog.write_text(text)
    args = [command, f"{prog}:{func}"] + [f"--size={k}={v}" for k, v in sizes.items()]
    if command == "run":
        if any(isinstance(v, int) and v > 64 or v == "99999999999999999" for v in sizes.values()):
            return  # large sizes would allocate real inputs; `show` covers them
        args += ["--world-size", world, "--json", "-"]
    r = runner.invoke(app, args)
    assert r.exit_code in (0, 2), (args, r.output)
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    if r.exit_code == 2:
        assert sorted(os.listdir(sandbox)) == ["prog.py"], os.listdir(sandbox)
        assert r.stderr.count("\n") <= 1 or "Usage:" in r.stderr, r.stderr


def _mutate(inputs: dict, how: str, name: str) -> dict:
    out = dict(inputs)
    t = out[name]
    if how == "dtype":
        out[name] = t.double() if t.dtype != torch.float64 else t.float()
    elif how == "shape":
        out[name] = t.reshape(-1)[:-1] if t.numel() else torch.zeros(3)
    elif how == "rank":
        out[name] = t.unsqueeze(0)
    elif how == "device":
        out[name] = t.to("meta")
    elif how == "missing":
        del out[name]
    elif how == "extra":
        out[name + "_extra"] = t
    elif how == "type":
        out[name] = t.tolist()
    elif how in ("nan", "inf"):
        bad = t.clone()
        bad.view(-1)[0] = math.nan if how == "nan" else -math.inf
        out[name] = bad
    return out


@settings(max_examples=60, deadline=None)
@given(how=st.sampled_from(["dtype", "shape", "rank", "device", "missing", "extra", "type", "nan", "inf"]),
       name=st.sampled_from(["g", "w", "m", "v"]), rank=st.integers(0, 2), world_size=st.integers(1, 3))
def test_wrong_inputs_are_named_and_nan_inf_only_under_the_finite_check(how, name, rank, world_size):
    program = load_example("adam.py:adam", N=7)
    inputs = make_inputs(program, world_size, {})
    rank = min(rank, world_size - 1)
    inputs[rank] = _mutate(inputs[rank], how, name)
    if how in ("nan", "inf"):
        check_inputs(program, inputs, {})  # off by default: NaN/Inf are values like others
        from cocoweave.backends import inputs as inputs_module

        previous, inputs_module.CHECK_FINITE = inputs_module.CHECK_FINITE, True
        try:
            with pytest.raises(InputError, match=rf"^rank {rank}: input `{name}` has 1 NaN or Inf value \(of 7\)"):
                check_inputs(program, inputs, {})
        finally:
            inputs_module.CHECK_FINITE = previous
        return
    with pytest.raises(InputError) as info:
        reference.run(program, inputs, {})
    msg = str(info.value)
    _one_sentence(msg)
    named = f"`{name}" in msg or (how == "device" and "ranks before it" in msg)
    assert msg.startswith(f"rank {rank}: ") and named, msg


def test_scalars_that_are_not_finite_are_refused_under_the_check():
    program = load_example("adam.py:adam", N=4)
    inputs = make_inputs(program, 2, {})
    inputs[1]["lr"] = math.inf
    from cocoweave.backends.inputs import check_rank_inputs

    check_rank_inputs(program, 1, 2, inputs[1], {})
    with pytest.raises(InputError, match=r"^rank 1: scalar `lr` is inf; inputs are checked"):
        check_rank_inputs(program, 1, 2, inputs[1], {}, check_finite=True)
